"""`[orchestrator.rewards]` and `num_scorers` (decentrl/config/orchestrator.py, run.py): what a
file may say, and errors that say how to fix it."""

from __future__ import annotations

from pathlib import Path

import pytest

from decentrl.config import ConfigError, load_config


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "run.toml"
    path.write_text(text)
    return str(path)


def test_defaults_are_the_verifier(tmp_path: Path) -> None:
    rewards = load_config(write(tmp_path, "")).orchestrator.rewards
    assert rewards.type == "verifier" and not rewards.uses_model and rewards.score_range == (0.0, 1.0)


def test_a_sum_with_local_scorers_loads(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, (
        'num_scorers = 2\n[orchestrator.rewards]\ntype = "sum"\nmodel_weight = 0.5\nscore_range = [-1.0, 1.0]\n'
        '[scorer]\ntype = "python"\nfunction = "m:f"\n'
    )))
    assert config.num_scorers == 2 and config.orchestrator.rewards.uses_model


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ('[orchestrator.rewards]\ntype = "judge"\n', ["orchestrator.rewards.type"]),
        ("[orchestrator.rewards]\nscore_range = [1.0, 0.0]\n", ["score_range", "min < max"]),
        ("[orchestrator.rewards]\nscore_range = [0.0, inf]\n", ["score_range"]),
        ("[orchestrator.rewards]\nscore_range = [0.0]\n", ["score_range"]),
        ("[orchestrator.rewards]\ndefault_score = 2.0\n", ["default_score", "score_range"]),
        ("[orchestrator.rewards]\ndefault_score = nan\n", ["default_score"]),
        ("[orchestrator.rewards]\nmodel_weight = -1\n", ["model_weight"]),
        ('[orchestrator.rewards]\non_parse_failure = "zero"\n', ["on_parse_failure"]),
        ("[orchestrator.rewards]\nstep_scores = true\n", ["step_scores", "model"]),
        ('[orchestrator.rewards]\ntype = "model"\nstep_scores = "yes"\n', ["step_scores"]),
        ("[orchestrator.rewards]\nlease_timeout_s = 0\n", ["lease_timeout_s"]),
        ('num_scorers = 1\n[orchestrator.rewards]\ntype = "model"\n', ["num_scorers", "[scorer]"]),
        ('num_scorers = 1\n[scorer]\ntype = "python"\nfunction = "m:f"\n', ["num_scorers", "verifier"]),
    ],
    ids=["type", "range-order", "range-inf", "range-length", "default-out", "default-nan", "weight", "policy",
         "steps-need-model", "steps-bool", "timeout", "scorers-need-backend", "scorers-need-model"],
)
def test_bad_reward_settings_say_how_to_fix_them(tmp_path: Path, text: str, words: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, text))
    for word in words:
        assert word in str(info.value), str(info.value)
