"""configs/coevolve.toml end to end, small: `decentrl run` with real workers playing units of roles
(a proposer's sample, then its solver node's sub-leases), the trainer training whole units, each
sample with its role; nothing left running."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.codec import decode_rollout
from tests.pipeline.test_pipeline import processes_mentioning, read_metrics

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]


def test_coevolve_config_trains_whole_units_with_roles(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    sets = ["trainer.steps=2", "trainer_ranks=1", "trainer.groups_per_step=4", "orchestrator.roles.solvers=4",
            "orchestrator.roles.sub_lease_size=2", "orchestrator.roles.min_fill=4", "orchestrator.batches_kept=4"]
    command = [sys.executable, "-m", "decentrl", "run", str(ROOT / "configs/coevolve.toml"), "--run-dir", str(run_dir)]
    for item in sets:
        command += ["--set", item]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    metrics = read_metrics(run_dir)
    assert [m["step"] for m in metrics] == [1, 2]
    db = sqlite3.connect(run_dir / "journal.sqlite")
    served = db.execute("SELECT lease_id, rewards FROM leases WHERE status = 'served'").fetchall()
    assert len(served) == 8, "4 units a step, 2 steps"
    roles_seen: set[str] = set()
    for lease_id, rewards in served:
        sizes = len(json.loads(rewards))
        assert sizes in (1, 5), "an invalid proposal alone, or a proposer and its 4 solvers"
        rows = db.execute("SELECT rollout_id, data FROM rollouts WHERE lease_id = ?", (lease_id,)).fetchall()
        samples = [decode_rollout(data, rollout_id=rid, lease_id=lease_id, run_name="", prompt_token_ids=[]) for rid, data in rows]
        assert len(samples) == sizes
        roles = [s.node.role if s.node is not None else None for s in samples]
        assert roles[0] == "proposer" and roles[1:] == ["solver"] * (sizes - 1)
        roles_seen.update(r for r in roles if r)
    assert roles_seen == {"proposer", "solver"}, "some proposal was valid and answered"
    assert processes_mentioning(str(run_dir)) == []


def test_two_policies_each_trained_by_its_own_trainer_from_its_own_stream(tmp_path: Path) -> None:
    """[orchestrator.roles] policies = 'per_role': a trainer and a stream of versions per role, a
    proposer worker and a solver worker; both streams advance and each trainer trains only its role."""
    run_dir = tmp_path / "run"
    sets = ["trainer.steps=2", "trainer_ranks=1", "trainer.groups_per_step=4", "orchestrator.roles.solvers=4",
            "orchestrator.roles.sub_lease_size=2", "orchestrator.roles.min_fill=4", "orchestrator.batches_kept=8",
            "orchestrator.roles.policies=per_role", "num_workers=2"]
    command = [sys.executable, "-m", "decentrl", "run", str(ROOT / "configs/coevolve.toml"), "--run-dir", str(run_dir)]
    for item in sets:
        command += ["--set", item]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    trained = {}
    for policy in ("proposer", "solver"):
        metrics = trained[policy] = [json.loads(line) for line in (run_dir / f"metrics-{policy}.jsonl").read_text().splitlines()]
        assert [m["step"] for m in metrics] == [1, 2]
        assert (run_dir / "checkpoints" / policy / "v000002" / "manifest.json").exists(), f"{policy}'s stream advanced"
    assert not (run_dir / "checkpoints" / "v000000").exists(), "no stream outside the policies'"
    status = json.loads((run_dir / "status.json").read_text())
    assert status["rollouts_accepted"] > 0
    # Each trainer trains its own role's samples: a proposer's one a unit, a solver node's 4 (min_fill = solvers).
    assert [m["samples"] for m in trained["proposer"]] == [4, 4]
    assert [m["samples"] for m in trained["solver"]] == [16, 16]
    assert processes_mentioning(str(run_dir)) == []
