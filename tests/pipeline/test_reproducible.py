"""Reproducible runs (issue 17, docs/reproducibility.md): `decentrl run configs/local.toml` with
`deterministic = true`, shrunk with --set, twice - 2 workers without injected latency and 3
workers with log-normal latency - must publish byte-identical weights at the last step and log
identical rewards and losses, for max_staleness 0 and 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from decentrl.store import CheckpointStore

pytestmark = pytest.mark.integration

DEMO = str(Path(__file__).resolve().parents[2] / "configs" / "local.toml")
STEPS = 3
# The demo config, shrunk to a test's size: a tinier model, groups of 4, 8 groups a step.
SMALL = [
    "deterministic=true", "seed=7", f"trainer.steps={STEPS}", "trainer.groups_per_step=8", "group_size=4",
    "model.hidden_size=32", "model.num_layers=1", "model.num_heads=2", "model.intermediate_size=64",
    "worker.groups_per_request=2", "orchestrator.lease_wait_s=0.5",
]


def run_demo(run_dir: Path, overrides: list[str]) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "decentrl", "run", DEMO, "--run-dir", str(run_dir)]
    for item in SMALL + overrides:
        command += ["--set", item]
    return subprocess.run(command, capture_output=True, text=True, timeout=600)


def published_weights(run_dir: Path, version: int) -> dict[str, bytes]:
    """The weight files of `version` in the run's store, as bytes (the manifest's timestamps differ)."""
    directory = Path(CheckpointStore(str(run_dir / "checkpoints")).pull(version, str(run_dir / "pulled")))
    return {path.name: path.read_bytes() for path in sorted(directory.glob("*.safetensors"))}


def logged(run_dir: Path) -> list[tuple[int, float, float, dict[str, int]]]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["reward_mean"], r["loss"], r["staleness_histogram"]) for r in records]


@pytest.mark.parametrize("max_staleness", [0, 2])
def test_same_seed_same_run_whatever_the_workers(tmp_path: Path, max_staleness: int) -> None:
    common = [f"max_staleness={max_staleness}"]
    first = run_demo(tmp_path / "two", common + ["num_workers=2"])
    assert first.returncode == 0, first.stdout + first.stderr
    second = run_demo(
        tmp_path / "three",
        common + ["num_workers=3", "simulation.latency_median_s=0.05", "simulation.latency_sigma=1.0", "simulation.seed=3"],
    )
    assert second.returncode == 0, second.stdout + second.stderr

    one, other = logged(tmp_path / "two"), logged(tmp_path / "three")
    assert [step for step, *_ in one] == list(range(1, STEPS + 1))
    assert one == other
    # Each group was sampled under the version its place fixes: the pipeline is max_staleness deep.
    for step, _, _, histogram in one:
        assert histogram == {str(min(step - 1, max_staleness)): 32}

    weights = published_weights(tmp_path / "two", STEPS)
    assert weights, "no weight files in the published version"
    assert weights == published_weights(tmp_path / "three", STEPS)
    # and training moved them: the published step differs from the initial model
    assert weights != published_weights(tmp_path / "two", 0)
