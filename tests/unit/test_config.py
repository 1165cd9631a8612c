"""Unit tests for decentrl.config: loading TOML/JSON and errors that name the file and the field."""

from __future__ import annotations

from pathlib import Path

import pytest

from decentrl.config import ConfigError, PretrainedModelConfig, RunConfig, TinyModelConfig, load_config

REPO = Path(__file__).resolve().parents[2]
LOCAL_TOML = REPO / "configs" / "local.toml"


def write(tmp_path: Path, text: str, name: str = "run.toml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_local_toml_loads() -> None:
    config = load_config(str(LOCAL_TOML))
    assert isinstance(config, RunConfig)
    assert config.run_name == "sort-demo"
    assert isinstance(config.model, TinyModelConfig)
    assert config.task.type == "sorting"
    # The file's own batch must split evenly over its trainer ranks (checked by the validator).
    assert config.trainer.groups_per_step * config.group_size % config.trainer_ranks == 0


def test_empty_file_gives_all_defaults(tmp_path: Path) -> None:
    assert load_config(write(tmp_path, "")) == RunConfig()


@pytest.mark.parametrize(
    ("text", "fields"),
    [
        ("[trainer]\nlr = -1\n", ["trainer.lr"]),
        ("[trainer]\nlrr = 0.001\n", ["trainer.lrr"]),  # typo: unknown keys are errors
        ("group_size = 1\n", ["group_size"]),
        ("max_staleness = -1\n", ["max_staleness"]),
        ("[sampling]\ntemperature = 0\n", ["sampling.temperature"]),
        ('run_name = "has space"\n', ["run_name"]),
        ('[model]\ntype = "tiny"\nhidden_size = 30\nnum_heads = 4\n', ["model", "num_heads", "hidden_size"]),
        (
            "trainer_ranks = 3\ngroup_size = 2\n[trainer]\ngroups_per_step = 4\n",
            ["trainer_ranks", "trainer.groups_per_step", "group_size"],
        ),
    ],
    ids=["negative-lr", "typo-key", "group-size-1", "negative-staleness", "zero-temperature", "run-name",
         "heads-divide", "batch-divides-ranks"],
)
def test_bad_value_names_field_and_file(tmp_path: Path, text: str, fields: list[str]) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert path in message
    for field in fields:
        assert field in message


def test_error_lists_every_bad_field(tmp_path: Path) -> None:
    path = write(tmp_path, "group_size = 0\n[trainer]\nlr = 5\nsteps = 0\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    for field in ("group_size", "trainer.lr", "trainer.steps"):
        assert field in message


def test_unknown_model_type_is_an_error(tmp_path: Path) -> None:
    path = write(tmp_path, '[model]\ntype = "huge"\n')
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert "model" in str(info.value) and "huge" in str(info.value)


def test_pretrained_model_section(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, '[model]\ntype = "pretrained"\npath = "/models/qwen"\n'))
    assert config.model == PretrainedModelConfig(path="/models/qwen")


def test_model_section_without_type_is_tiny(tmp_path: Path) -> None:
    # `type` defaults to "tiny" in TinyModelConfig, so a [model] section may leave it out.
    config = load_config(write(tmp_path, "[model]\nhidden_size = 64\nnum_heads = 4\n"))
    assert config.model == TinyModelConfig(hidden_size=64, num_heads=4)


def test_nested_field_error_names_the_path_in_the_file(tmp_path: Path) -> None:
    # The file has model.hidden_size; the union's tag ("tiny") is not part of that path.
    path = write(tmp_path, '[model]\ntype = "tiny"\nhidden_size = 8\n')
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert "model.hidden_size" in str(info.value)


def test_invalid_toml_is_a_config_error(tmp_path: Path) -> None:
    path = write(tmp_path, "[trainer\nlr = 0.1\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert path in str(info.value) and "TOML" in str(info.value)


def test_invalid_json_is_a_config_error(tmp_path: Path) -> None:
    path = write(tmp_path, '{"group_size": 4,', name="resolved.json")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert path in str(info.value) and "JSON" in str(info.value)


def test_json_that_is_not_an_object_is_a_config_error(tmp_path: Path) -> None:
    path = write(tmp_path, "[1, 2]", name="resolved.json")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert path in str(info.value)


def test_missing_file_is_a_config_error(tmp_path: Path) -> None:
    path = str(tmp_path / "nope.toml")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert path in str(info.value)


def test_directory_is_not_a_config_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError):
        load_config(str(tmp_path))


def test_non_utf8_file_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "latin1.toml"
    path.write_bytes('run_name = "caf\u00e9"\n'.encode("latin-1"))
    with pytest.raises(ConfigError) as info:
        load_config(str(path))
    assert str(path) in str(info.value)


def test_resolved_json_round_trips(tmp_path: Path) -> None:
    config = load_config(str(LOCAL_TOML)).with_store_url("memory://bucket/run")
    resolved = write(tmp_path, config.model_dump_json(indent=1), name="resolved.json")
    again = load_config(resolved)
    assert again == config
    assert again.store.url == "memory://bucket/run"
    assert again.model_dump_json() == config.model_dump_json()


def test_pretrained_config_round_trips(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, '[model]\ntype = "pretrained"\npath = "/m"\n'))
    again = load_config(write(tmp_path, config.model_dump_json(), name="resolved.json"))
    assert again == config
    assert isinstance(again.model, PretrainedModelConfig)


def test_config_is_frozen() -> None:
    config = load_config(str(LOCAL_TOML))
    with pytest.raises(ValueError):
        config.trainer.lr = 0.5  # type: ignore[misc]
