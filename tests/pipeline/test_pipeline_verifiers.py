"""A verifiers environment through the real pipeline: `decentrl run` (orchestrator, two workers,
two-rank FSDP2 trainer over loopback) on the multi-turn guess Env of tests/verifiers_envs.py.
The workers build the Env from the task the orchestrator announces and play it; the
orchestrator replays it and scores each episode with the task's reward functions in its reward
guard. Skipped, with the reason, where the `verifiers` extra is not installed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.verifiers_envs import write_environments

pytestmark = pytest.mark.integration
pytest.importorskip("verifiers", reason='needs the verifiers extra: pip install -e ".[verifiers]"')

STEPS = 2
CONFIG = f"""
run_name = "vf"
max_staleness = 1
group_size = 4
num_workers = 2
trainer_ranks = 2
[model]
hidden_size = 32
num_layers = 1
num_heads = 2
intermediate_size = 64
[task]
type = "verifiers"
taskset = "vf_guess"
max_turns = 4
max_turn_tokens = 2
[sampling]
max_tokens = 16
[orchestrator]
port = 0
[worker]
groups_per_request = 4
[trainer]
steps = {STEPS}
groups_per_step = 4
lr = 3e-3
"""


def test_a_multi_turn_verifiers_env_trains(tmp_path: Path) -> None:
    environments = tmp_path / "envs"
    environments.mkdir()
    write_environments(environments)
    config = tmp_path / "vf.toml"
    config.write_text(CONFIG)
    run_dir = tmp_path / "run"
    # Every role imports the environment by its module name: the orchestrator, its reward guard's
    # child and each worker (docs/tasks.md, "what runs where").
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(environments), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, "-m", "decentrl", "run", str(config), "--run-dir", str(run_dir)],
                            capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["policy_version"] for m in metrics] == list(range(1, STEPS + 1))
    assert all(0.0 <= m["reward_mean"] <= 1.0 and m["samples"] == 16 for m in metrics)
    assert metrics[-1]["rollouts_accepted"] >= 16 * STEPS
