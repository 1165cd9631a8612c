"""A run that publishes its versions in bf16 (`store.publish_dtype`) and as deltas (the default
store.full_every): the trainer keeps float32 master weights, the workers and the verifier load and
sample with the bf16 weights rebuilt from deltas, and the run learns. The real pipeline (`decentrl run`:
orchestrator, two workers, a two-rank gloo trainer)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from decentrl.store.checkpoints import CheckpointStore
from tests.pipeline.test_pipeline import processes_mentioning, read_metrics, run_config

pytestmark = pytest.mark.integration

# configs/local.toml (4-digit sorting, the demo's model and learning rate), shortened, with the
# versions published in bf16 and the verifier on: a new worker's first 64 rollouts and a quarter of
# the rest are recomputed, and one strike revokes a worker, so a worker that sampled with other
# weights than the published bf16 ones would be banned and the run could not finish. The bf16
# bounds are the tiny model's (2 layers round within 0.05 at a token; docs/store.md), far tighter
# than the defaults, which are calibrated on a 30-layer model.
STEPS = 30
BF16 = """
[orchestrator.verification]
enabled = true
new_worker_checks = 64
spot_check_fraction = 0.25
max_strikes = 1
half_tolerance = 0.05
half_mean_tolerance = 0.05
"""


def bf16_config() -> str:
    text = (Path(__file__).parents[2] / "configs" / "local.toml").read_text()
    text = text.replace("steps = 150", f"steps = {STEPS}").replace("groups_per_step = 32", "groups_per_step = 16")
    text = text.replace("keep_last = 4", 'keep_last = 4\npublish_dtype = "bf16"')
    return text.replace('run_name = "sort-demo"', 'run_name = "bf16"') + BF16


def test_a_bf16_published_run_learns_and_is_verified(tmp_path: Path) -> None:
    steps = STEPS
    result, run_dir = run_config(tmp_path, bf16_config())
    assert result.returncode == 0, result.stdout + result.stderr
    assert json.loads((run_dir / "config.json").read_text())["store"]["publish_dtype"] == "bf16"

    metrics = read_metrics(run_dir)
    assert [m["policy_version"] for m in metrics] == list(range(1, steps + 1))
    rewards = [m["reward_mean"] for m in metrics]
    assert sum(rewards[-5:]) / 5 > sum(rewards[:5]) / 5 + 0.05, f"the bf16-published run did not learn: {rewards}"

    store = CheckpointStore(str(run_dir / "checkpoints"))
    # Deltas are on by default (store.full_every = 8): the workers pulled most versions as deltas.
    bases = [store.manifest(v).delta_base for v in store.versions()]
    assert sum(base is not None for base in bases) >= steps // 2, bases
    cache = tmp_path / "pulled"
    first = load_file(Path(store.pull(0, str(cache))) / "model.safetensors")
    last = load_file(Path(store.pull(steps, str(cache))) / "model.safetensors")
    assert {t.dtype for t in first.values()} == {t.dtype for t in last.values()} == {torch.bfloat16}
    assert json.loads((Path(store.pull(steps, str(cache))) / "config.json").read_text())["dtype"] == "bfloat16"
    unchanged = [name for name in first if torch.equal(first[name], last[name])]
    assert unchanged == [], f"bf16 parameters not changed by training: {unchanged}"
    assert processes_mentioning(str(run_dir)) == []
