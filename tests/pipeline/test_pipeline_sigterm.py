"""SIGTERM to every role of a live run (issue 46, F10): `decentrl run` with an orchestrator, two
a worker, a two-rank trainer (torchrun) and a scorer, training; then each role's process gets SIGTERM at once,
as an operator's `kill` or a service manager sends it. Each ends within STOP_S, no log holds a
traceback or asyncio's "Task was destroyed but it is pending", and nothing is left half written:
no temporary file in the run dir, every version in the store verifies, the journal checks whole."""

from __future__ import annotations

import contextlib
import os
import signal
import sqlite3
import subprocess
import time
from pathlib import Path

import pytest

from decentrl.cli.launch import running
from decentrl.store.checkpoints import CheckpointStore
from tests.pipeline.test_pipeline import decentrl_run_command, pipeline_config, read_metrics
from tests.pipeline.test_pipeline_scorers import TABLES

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]
STOP_S = 5.0  # the most any role may take to end after SIGTERM (docs/deploy.md, "What happens when ...")
ROLES = ("orchestrator", "trainer", "worker-0", "scorer-0")


def children(pid: int) -> list[int]:
    """`pid`'s child processes, as Linux lists them (each thread's children: torchrun's are in threads too)."""
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            found += [int(child) for child in (task / "children").read_text().split()]
    return found


def tree(pid: int) -> list[int]:
    """`pid` and every process below it."""
    found, todo = [pid], [pid]
    while todo:
        below = children(todo.pop())
        found += below
        todo += below
    return found


def role_of(pid: int) -> str | None:
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    if b"decentrl.trainer.torchrun" in argv:
        return "trainer"
    for flag in (b"--worker-id", b"--scorer-id"):
        if flag in argv:
            return argv[argv.index(flag) + 1].decode()
    return "orchestrator" if b"orchestrator" in argv else None


def test_sigterm_ends_every_role_cleanly(tmp_path: Path) -> None:
    text = "num_scorers = 1\ntolerate_worker_exits = true\n" + pipeline_config(
        run_name="sigterm", steps=500, max_staleness=1, lr=3e-3, extra=TABLES
    ).replace("num_workers = 2", "num_workers = 1")
    command, run_dir = decentrl_run_command(tmp_path, text)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    launcher = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                start_new_session=True)
    stopped: dict[str, float] = {}
    try:
        deadline = time.monotonic() + 240
        while not (run_dir / "metrics.jsonl").is_file() or len(read_metrics(run_dir)) < 1:  # training, publishing
            assert launcher.poll() is None and time.monotonic() < deadline, launcher.communicate()[0]
            time.sleep(0.2)
        roles = {role_of(pid): pid for pid in children(launcher.pid)}
        assert set(roles) == set(ROLES), roles
        trees = {name: tree(pid) for name, pid in roles.items()}
        started = time.monotonic()
        for pid in roles.values():
            os.kill(pid, signal.SIGTERM)
        while len(stopped) < len(roles) and time.monotonic() - started < 3 * STOP_S:
            for name, pids in trees.items():
                if name not in stopped and not any(running(pid) for pid in pids):
                    stopped[name] = time.monotonic() - started
            time.sleep(0.02)
        output, _ = launcher.communicate(timeout=60)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
    print({name: round(seconds, 2) for name, seconds in stopped.items()})
    assert set(stopped) == set(ROLES) and max(stopped.values()) < STOP_S, (stopped, output)

    logs = {path.name: path.read_text(errors="replace") for path in (run_dir / "logs").iterdir()}
    for name, text in logs.items():
        assert "Task was destroyed but it is pending" not in text, (name, text[-3000:])
        assert "Traceback" not in text, (name, text[-3000:])
    assert not [p for p in run_dir.rglob("*") if ".tmp" in p.name], "a half-written file is left"
    store = CheckpointStore(str(run_dir / "checkpoints"))
    assert store.versions() and all(store.verify(v) == [] for v in store.versions())
    with sqlite3.connect(run_dir / "journal.sqlite") as journal:
        assert journal.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
