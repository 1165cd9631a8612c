"""A whole run with model rewards: `decentrl run` with two scorer processes (`num_scorers`), one
of them SIGKILLed mid-run while it holds a score lease. Its lease expires, the other scorer scores
the samples (reassigned), and the run trains to its last step."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from tests.pipeline.test_pipeline import decentrl_run_command, pipeline_config, processes_mentioning

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]
STEPS = 8
TOP = 'num_scorers = 2\ntolerate_worker_exits = true\n'  # top-level keys go before the tables
TABLES = """
[orchestrator.rewards]
type = "sum"
model_weight = 0.1
lease_timeout_s = 3.0
[scorer]
type = "python"
function = "tests.scorer_functions:by_length"
options = { delay_s = 1.0 }
max_items = 16
min_wait_s = 0.1
"""


def status(run_dir: Path) -> dict | None:
    """GET /v1/status with the run's trainer token (None while the orchestrator is not up)."""
    config = json.loads((run_dir / "config.json").read_text())
    token = next(t["token"] for t in json.loads((run_dir / "tokens.json").read_text())["tokens"] if t["role"] == "trainer")
    request = urllib.request.Request(
        f"http://127.0.0.1:{config['orchestrator']['port']}/v1/status", headers={"Authorization": f"Bearer {token}"}
    )
    try:
        with urllib.request.urlopen(request, timeout=5) as answer:
            return json.loads(answer.read())
    except OSError:
        return None


def test_a_run_survives_a_scorer_killed_while_it_holds_a_lease(tmp_path: Path) -> None:
    text = TOP + pipeline_config(run_name="scored", steps=STEPS, max_staleness=1, lr=3e-3, extra=TABLES)
    command, run_dir = decentrl_run_command(tmp_path, text)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        deadline = time.monotonic() + 240
        while True:  # both scorers hold a lease (scoring takes 1 s a lease): kill scorer-1 now
            assert process.poll() is None and time.monotonic() < deadline, process.stdout.read() if process.stdout else ""
            found = status(run_dir) if (run_dir / "tokens.json").is_file() else None
            if found and found["scoring"]["leases_open"] == 2:
                break
            time.sleep(0.1)
        scorer = [pid for pid in processes_mentioning(str(run_dir)) if b"scorer-1" in Path(f"/proc/{pid}/cmdline").read_bytes()]
        assert len(scorer) == 1
        os.kill(scorer[0], signal.SIGKILL)
        output, _ = process.communicate(timeout=400)
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGINT)
            process.communicate(timeout=60)
    assert process.returncode == 0, output
    assert "scorer-1 exited with code -9; 1 scorer(s) carry on" in output
    final = json.loads((run_dir / "status.json").read_text())
    assert final["scoring"]["scores_reassigned"] > 0 and final["scoring"]["score_leases_expired"] > 0
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == list(range(1, STEPS + 1))
    assert processes_mentioning(str(run_dir)) == []
