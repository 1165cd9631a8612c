"""Issue 46's F7, reduced: benchmarks/faults.py's trainer killed mid-publish, with the tiny model
(configs/local.toml) in place of SmolLM2. A real `decentrl` orchestrator, trainer and worker on one
host, the store moto's S3 behind the fault front; the trainer's process group is killed (-9) while
the front holds part of the key version's weights and no manifest, then the same command is
started again. About 3 min on 2 loaded cores, past CI's budget: it runs with DECENTRL_LONG_TESTS=1. The
real model's run (about 15 min, a 12 GB trainer): `benchmarks/faults.py --only F7`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(
    os.environ.get("DECENTRL_LONG_TESTS") != "1",
    reason="a whole decentrl run killed and restarted (about 3 min), beyond CI's budget: run with DECENTRL_LONG_TESTS=1; "
    "the real model's: benchmarks/faults.py --only F7",
)


def test_a_trainer_killed_mid_publish_resumes_with_continuous_versions() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "faults.py"), "--only", "F7", "--f7-config", "configs/local.toml",
         "--f7-timeout-s", "300"],
        capture_output=True, text=True, timeout=900, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])["faults"]["F7"]
    key = found["config"]["key_version"]
    # Killed mid-upload: part of the key version's weights in, its manifest not written.
    assert found["at_kill"]["received_bytes"] and found["at_kill"]["key_manifest_in_store"] is False
    assert found["at_kill"]["versions_in_store"] == list(range(key))
    # Resumed from the checkpoint before it, replaying the journaled steps; the version the store
    # held past the checkpoint replayed to the same weights and not published again.
    assert found["resumed_from"]["checkpoint"] == 2 and found["resumed_from"]["replayed"][0] == 3
    assert found["replay_difference"] == {"version": key - 1, "max_abs": 0.0}
    versions = found["versions"]
    assert versions["gaps"] == [] and versions["published_twice"] == [] and versions["held_at_kill_changed"] == []
    assert versions["published_by_restarted"][0] == key and versions["in_store"] == list(range(found["config"]["steps"] + 1))
    assert found["worker"]["cache_problems"] == {} and found["worker"]["partial_dirs_left"] == []
    assert key in found["worker"]["loaded"] and found["half_versions_loaded"] == 0
    assert found["lost"] == 0 and found["trained_twice"] == 0 and found["tracebacks_in_logs"] == 0
    assert found["trainer_exit_after_restart"] == 0
