"""benchmarks/coevolve.py's schedule part, small: the real orchestrator with units of roles under
simulated heavy-tailed workers reports every arm (two policies too) and the issue's keys, and the straggler bound
acts (nodes closed short, late samples refused) only where it is on."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_schedule_benchmark_reports_the_issue_keys() -> None:
    out = subprocess.run(
        [sys.executable, "benchmarks/coevolve.py", "--seeds", "1", "--sim-steps", "6", "--workers", "8", "--train-s", "4"],
        check=True, capture_output=True, text=True, cwd=ROOT, timeout=120,
    ).stdout
    result = json.loads(out.strip().splitlines()[-1])
    assert set(result["episode_p90_over_median"]) == {"single", "naive", "ours", "two_policies"}
    assert all(value is not None and value >= 1.0 for value in result["episode_p90_over_median"].values())
    assert result["busy_coevolve_vs_single"] is not None and result["busy_naive_vs_single"] is not None
    arms = result["schedule"]
    assert arms["naive"]["closed_short"] == 0 and arms["naive"]["node_closed_refused"] == 0, "naive waits for every sample"
    assert arms["ours"]["closed_short"] > 0 and arms["ours"]["node_closed_refused"] > 0
    assert arms["ours"]["roles"]["solver"]["n"] > 0 and arms["single"]["roles"]["solver"]["n"] == 0
    # Two policies: proposer and solver workers, a trainer each, both stepping; its ratio reported beside.
    two = arms["two_policies"]
    assert two["roles"]["solver"]["n"] > 0 and result["busy_two_policies_vs_single"] is not None
    assert all(set(run) == {"proposer", "solver"} and all(b is not None and b > 0 for b in run.values())
               for run in two["trainer_busy_by_policy"])
    assert set(result["episode_p90_over_median_by_role"]) == {"naive", "ours", "two_policies"}
