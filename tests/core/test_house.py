"""The orchestrator's import graph stays shallow (issue 28's goal, measured by benchmarks/house.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_orchestrator_is_at_most_eight_import_levels_deep_and_the_script_reports_it() -> None:
    result = subprocess.run([sys.executable, "benchmarks/house.py"], capture_output=True, text=True, check=True, cwd=ROOT)
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["circles"] == 0
    assert report["levels"] <= 8, result.stdout
    # No part below the owner imports the journal: they record events into the journal they are given.
    parts = ("leases", "buffer", "integrity", "batches", "score_queue", "checks", "lease_policy")
    assert not [p for p in parts if "orchestrator.journal" in report["imports_within"][f"orchestrator.{p}"]]
    assert report["code_lines"] < report["lines"]
