"""Unit tests for decentrl.config: loading TOML/JSON, --set overrides, settings that moved, and
errors that name the file and the field as the file spells it (every keyed union)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import get_args

import pytest
from pydantic import BaseModel

from decentrl.config import (
    ConfigError,
    LoRAConfig,
    PretrainedModelConfig,
    RunConfig,
    TinyModelConfig,
    WorkerConfig,
    apply_overrides,
    load_config,
    parse_config,
    path_in_file,
)
from decentrl.config.base import union_members

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


@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("*.toml")), ids=lambda path: path.name)
def test_every_shipped_config_loads(path: Path) -> None:
    config = load_config(str(path))
    assert config.simulation == RunConfig().simulation  # no shipped run is a simulation


def test_empty_file_gives_all_defaults(tmp_path: Path) -> None:
    assert load_config(write(tmp_path, "")) == RunConfig()


@pytest.mark.parametrize(
    ("text", "fields"),
    [
        ("[trainer]\nlr = -1\n", ["trainer.lr"]),
        ("[trainer]\nlrr = 0.001\n", ["trainer.lrr"]),  # typo: unknown keys are errors
        ("[trainer]\nloss_chunk_mb = -1\n", ["trainer.loss_chunk_mb"]),
        ('[trainer]\nloss_chunk_mb = "1GB"\n', ["trainer.loss_chunk_mb"]),
        ('[trainer]\ncompile = "yes"\n', ["trainer.compile"]),
        ("[trainer]\ncompile = true\n[model.moe]\nnum_experts = 4\ntop_k = 2\n", ["trainer.compile", "dense", "[model.moe]"]),
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
    ids=["negative-lr", "typo-key", "negative-loss-chunk", "loss-chunk-not-a-number", "compile-not-a-bool",
         "compile-moe", "group-size-1", "negative-staleness",
         "zero-temperature", "run-name",
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


def test_a_check_across_sections_names_its_values_without_dumping_the_config() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(str(REPO / "configs/local.toml"), ["num_workers=1", "placement.workers.gpus=[0, 1]"])
    message = str(info.value)
    assert "placement.workers.gpus lists 2 GPUs [0, 1] but num_workers = 1" in message
    assert "got" not in message and "run_name" not in message  # not the whole config after it
    assert len(message.splitlines()) == 2


def test_a_long_bad_value_is_shown_shortened(tmp_path: Path) -> None:
    path = write(tmp_path, f'run_name = "{"x" * 1000}"\n')
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert "characters)" in str(info.value) and len(str(info.value)) < 600


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


# -- keyed unions: error paths as the file spells them ------------------------------------------


def keyed_unions(model: type[BaseModel] = RunConfig, prefix: str = "") -> dict[str, dict[str, type[BaseModel]]]:
    """Every keyed union in the config, by dotted path: found by walking the models, so a union
    added later is covered by the tests below without editing them."""
    found: dict[str, dict[str, type[BaseModel]]] = {}
    for name, field in model.model_fields.items():
        path = f"{prefix}{name}"
        members = union_members(field.annotation)
        if members:
            found[path] = members
        sections = [arg for arg in (field.annotation, *get_args(field.annotation))
                    if isinstance(arg, type) and issubclass(arg, BaseModel)]
        for section in sections if not members else members.values():
            found.update(keyed_unions(section, f"{path}."))
    return found


def nested(path: str, value: object) -> dict[str, object]:
    data: object = value
    for part in reversed(path.split(".")):
        data = {part: data}
    assert isinstance(data, dict)
    return data


def nested_in_members(path: str, value: object) -> dict[str, object]:
    """`nested`, with each enclosing union's `type` set to the member that has the next key
    (`scorer.verdict` lives under `[scorer] type = "openai"`)."""
    unions, parts = keyed_unions(), path.split(".")
    data = nested(path, value)
    node: dict[str, object] = data
    for depth in range(len(parts) - 1):
        node = node[parts[depth]]  # type: ignore[assignment]
        members = unions.get(".".join(parts[: depth + 1]), {})
        if members:
            node["type"] = next(tag for tag, member in members.items() if parts[depth + 1] in member.model_fields)
    return data


def test_every_union_is_found_and_its_tags_are_the_members_type_literals() -> None:
    unions = keyed_unions()
    assert {"model", "task", "trainer.loss", "trainer.off_policy"} <= unions.keys()
    assert "guess" in unions["task"]
    for members in unions.values():
        for tag, member in members.items():
            assert member.model_fields["type"].default == tag


@pytest.mark.parametrize(
    ("path", "tag"), [(path, tag) for path, members in keyed_unions().items() for tag in members]
)
def test_a_bad_field_under_every_union_member_names_the_path_in_the_file(path: str, tag: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(nested_in_members(path, {"type": tag, "not_a_field": 1}), source="run.toml")
    message = str(info.value)
    assert f"  {path}.not_a_field: Extra inputs are not permitted" in message
    assert f"{path}.{tag}." not in message  # pydantic's tag is not a key of the file


def test_a_bad_guess_field_names_task_max_turns(tmp_path: Path) -> None:
    path = write(tmp_path, '[task]\ntype = "guess"\nmax_turns = 0\n')
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert "  task.max_turns: Input should be greater than or equal to 1" in str(info.value)
    assert "task.guess" not in str(info.value)


def test_a_key_named_like_a_tag_outside_a_union_stays_in_the_path(tmp_path: Path) -> None:
    # "token" is a loss type's tag; as a worker id under simulation.slowdowns it is a real key.
    path = write(tmp_path, "[simulation]\nslowdowns = { token = 0.5 }\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert "simulation.slowdowns.token:" in str(info.value)
    assert path_in_file(("trainer", "loss", "token", "eps_low")) == "trainer.loss.eps_low"


# -- --set overrides ---------------------------------------------------------------------------


def test_set_overrides_nested_keys_with_toml_values() -> None:
    config = load_config(str(LOCAL_TOML), [
        "worker.concurrency=4", "trainer.lr=1e-4", "orchestrator.journal=false", "worker.device=cuda:0",
        "store.url=s3://bucket/run", 'run_name="123"', 'sampling.stop=["\\n", "END"]',
        "simulation.slowdowns={ worker-0 = 10.0 }", "orchestrator.verification.enabled=true",
    ])
    assert config.worker.concurrency == 4 and config.trainer.lr == 1e-4 and config.orchestrator.journal is False
    assert config.worker.device == "cuda:0" and config.store.url == "s3://bucket/run" and config.run_name == "123"
    assert config.sampling.stop == ["\n", "END"]
    assert config.simulation.slowdowns == {"worker-0": 10.0}
    assert config.orchestrator.verification.enabled
    assert config.trainer.steps == load_config(str(LOCAL_TOML)).trainer.steps  # the rest is the file's


def test_set_without_a_file_starts_from_the_defaults() -> None:
    assert load_config(None) == RunConfig()
    assert load_config(None, ["worker.groups_per_request=2"]).worker.groups_per_request == 2


def test_set_can_fill_an_optional_section_that_a_resolved_config_left_null(tmp_path: Path) -> None:
    resolved = write(tmp_path, RunConfig().model_dump_json(), name="config.json")
    assert json.loads(Path(resolved).read_text())["trainer"]["lora"] is None
    assert load_config(resolved, ["trainer.lora.rank=4"]).trainer.lora == LoRAConfig(rank=4)


@pytest.mark.parametrize(
    ("item", "named"),
    [
        ("worker.concurency=2", "worker.concurency: Extra inputs are not permitted"),
        ("worker.concurrency=0", "worker.concurrency: Input should be greater than or equal to 1"),
        ("trainer.lr=fast", "trainer.lr: Input should be a valid number"),
        ("task.max_turns=0", "task.max_turns: Extra inputs are not permitted"),  # the file's task is sorting
    ],
)
def test_a_bad_set_names_the_key_and_the_override(item: str, named: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(str(LOCAL_TOML), [item])
    message = str(info.value)
    assert f"with --set {item}: invalid config" in message and named in message


@pytest.mark.parametrize(
    ("item", "says"),
    [
        ("worker.concurrency", "expected KEY=VALUE"),
        ("=4", "expected KEY=VALUE"),
        ("worker..concurrency=4", "expected KEY=VALUE"),
        ("group_size.x=1", "--set group_size.x: group_size is a value, not a section"),
    ],
)
def test_a_malformed_set_is_a_config_error(item: str, says: str) -> None:
    with pytest.raises(ConfigError, match=says):
        load_config(str(LOCAL_TOML), [item])


def test_set_does_not_change_the_data_it_was_given() -> None:
    data = {"worker": {"concurrency": 2}}
    assert apply_overrides(data, ["worker.concurrency=3"]) == {"worker": {"concurrency": 3}}
    assert data == {"worker": {"concurrency": 2}}


# -- settings that moved -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "where", "new_place"),
    [
        ("[trainer.advantages]\nnormalize_std = true\n", "trainer.advantages", "[orchestrator.advantages] normalize_std"),
        ("[worker]\nsimulated_latency_median_s = 2.0\n", "worker", "[simulation] latency_median_s"),
        ("[worker]\nsimulated_latency_sigma = 1.0\n", "worker", "[simulation] latency_sigma"),
        ("[worker]\nslowdowns = [10.0]\n", "worker", "[simulation] slowdowns"),
    ],
)
def test_a_moved_setting_says_where_it_lives_now(tmp_path: Path, text: str, where: str, new_place: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert f"  {where}: " in str(info.value) and new_place in str(info.value)


def test_advantages_are_configured_where_they_are_computed(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, "[orchestrator.advantages]\nnormalize_std = true\n[trainer.advantages]\n"
                                         "drop_zero_variance = true\n"))
    assert config.orchestrator.advantages.normalize_std and config.trainer.advantages.drop_zero_variance


def test_simulation_is_its_own_section(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, "[simulation]\nlatency_median_s = 2.0\nslowdowns = { worker-0 = 10.0 }\n"))
    assert config.simulation.active_for("worker-0") and config.simulation.active_for("worker-1")
    assert not RunConfig().simulation.active_for("worker-0")
    assert "simulat" not in " ".join(WorkerConfig.model_fields)  # nothing benchmark-only in [worker]
    with pytest.raises(ConfigError, match="simulation.slowdowns.worker-0: Input should be greater than or equal to 1"):
        load_config(write(tmp_path, "[simulation]\nslowdowns = { worker-0 = 0.5 }\n"))


def test_the_openai_backend_needs_its_server(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"worker: backend = 'openai' needs the server: add \[worker.openai\]"):
        load_config(write(tmp_path, '[worker]\nbackend = "openai"\n'))
    with pytest.raises(ConfigError, match=r"worker.openai.model: Field required"):
        load_config(write(tmp_path, '[worker]\nbackend = "openai"\n[worker.openai]\nurl = "http://x"\n'))
    with pytest.raises(ConfigError, match=r"\[worker.openai\] is only read with backend = 'openai'"):
        load_config(write(tmp_path, '[worker.openai]\nurl = "http://x"\nmodel = "m"\n'))
    config = load_config(None, ["worker.backend=openai", "worker.openai.url=http://127.0.0.1:8000", "worker.openai.model=m"])
    assert config.worker.openai is not None and config.worker.openai.reload == "weights"


def test_every_field_is_described() -> None:
    undescribed = []

    def walk(model: type[BaseModel], prefix: str) -> None:
        for name, field in model.model_fields.items():
            if name != "type" and not field.description:
                undescribed.append(prefix + name)
            for member in [*union_members(field.annotation).values(),
                           *(a for a in (field.annotation, *get_args(field.annotation))
                             if isinstance(a, type) and issubclass(a, BaseModel))]:
                walk(member, f"{prefix}{name}.")

    walk(RunConfig, "")
    assert undescribed == []
