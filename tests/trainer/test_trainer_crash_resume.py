"""Crash-resume of the trainer in a live run: an orchestrator, a worker and a two-rank trainer
(torchrun, gloo) as separate processes; the trainer is killed with SIGKILL between two
checkpoints and the same command is started again. It must resume from the last checkpoint,
replay the journaled steps to exactly the weights it had published, and carry on: versions
continue without a gap or a repeat, and the worker (never restarted) keeps serving the run."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from decentrl.cli.launch import free_port, running
from decentrl.config import parse_config
from decentrl.store.checkpoints import CheckpointStore
from orchestrator.auth import add_token

pytestmark = pytest.mark.integration

STEPS, EVERY = 12, 3
CONFIG = {
    "run_name": "resume",
    "max_staleness": 1,
    "group_size": 4,
    "num_workers": 1,
    "trainer_ranks": 2,
    "model": {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "intermediate_size": 64},
    "sampling": {"max_tokens": 6},
    "store": {"keep_last": 50},  # keep every version, so the test can read the whole history
    "worker": {"groups_per_request": 4},
    "trainer": {"steps": STEPS, "groups_per_step": 4, "lr": 3e-3, "checkpoint_every": EVERY},
}


def start(argv: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    # Its own session, so the whole group (torchrun and its ranks) can be killed at once.
    with open(log, "ab") as out:
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env={**os.environ, **env, "OMP_NUM_THREADS": "1"}, start_new_session=True)


def read_metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def wait_for(predicate, timeout_s: float, what: str, processes: list[subprocess.Popen[bytes]]) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        for process in processes:
            assert process.poll() is None, f"{process.args[:4]} exited with {process.returncode} while waiting for {what}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def family(pid: int) -> list[int]:
    """`pid` and all its descendants (torchrun starts each rank in a session of its own, so a
    process group does not reach them)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        found.append(todo.pop())
        todo.extend(children.get(found[-1], []))
    return found


def stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_trainer_resume_after_kill_9_continues_versions_and_workers_carry_on(tmp_path: Path, lora: bool) -> None:
    run_dir = tmp_path / "run"
    (run_dir / "logs").mkdir(parents=True)
    port = free_port()
    # LoRA: the DCP checkpoint holds base and adapters, the store only adapters after v0.
    trainer = {**CONFIG["trainer"], "lora": {"rank": 2, "alpha": 4.0}} if lora else CONFIG["trainer"]
    config = parse_config({**CONFIG, "trainer": trainer, "orchestrator": {"port": port}}).with_store_url(str(run_dir / "checkpoints"))
    config_path = run_dir / "config.json"
    config_path.write_text(config.model_dump_json())
    trainer_token = add_token(str(run_dir / "tokens.json"), name="trainer", role="trainer")
    worker_token = add_token(str(run_dir / "tokens.json"), name="worker-0", role="worker")
    url = f"http://127.0.0.1:{port}"
    py = [sys.executable, "-m"]
    trainer_argv = py + ["torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "decentrl", "trainer",
                         str(config_path), "--orchestrator", url, "--run-dir", str(run_dir)]
    logs = run_dir / "logs"
    started: list[subprocess.Popen[bytes]] = []
    try:
        orchestrator = start(py + ["decentrl", "orchestrator", str(config_path), "--run-dir", str(run_dir)], logs / "orchestrator.log", {})
        started.append(orchestrator)
        trainer = start(trainer_argv, logs / "trainer-1.log", {"DECENTRL_TOKEN": trainer_token})
        started.append(trainer)
        worker = start(py + ["decentrl", "worker", "--orchestrator", url, "--worker-id", "worker-0",
                             "--cache-dir", str(run_dir / "cache" / "worker-0")], logs / "worker.log", {"DECENTRL_TOKEN": worker_token})
        started.append(worker)

        # Kill between two checkpoints, so there are journaled steps to replay and published
        # versions past the checkpoint that must not be published again.
        def between_checkpoints() -> bool:
            steps = [m["step"] for m in read_metrics(run_dir)]
            return bool(steps) and steps[-1] > EVERY and steps[-1] % EVERY != 0

        wait_for(between_checkpoints, 300, "the trainer to pass its first checkpoint", started)
        ranks = family(trainer.pid)
        assert len(ranks) >= 3, "torchrun and its two ranks"
        for pid in ranks:  # kill -9, every trainer process at once
            os.kill(pid, signal.SIGKILL)
        trainer.wait()
        wait_for(lambda: not any(running(pid) for pid in ranks), 30, "the trainer's processes to die", [])
        at_kill = read_metrics(run_dir)
        killed_at = at_kill[-1]["step"]
        checkpoint = killed_at - killed_at % EVERY
        published_before = CheckpointStore(str(run_dir / "checkpoints")).latest()
        # The killed publisher's files stay in the trainer's scratch, not /tmp (full runs keep the
        # last version there as the next one's delta base); the restart clears them.
        scratch = run_dir / "trainer" / "scratch"
        assert lora or list(scratch.glob("decentrl-v*"))
        (scratch / "decentrl-v99-killed").mkdir()

        restarted = start(trainer_argv, logs / "trainer-2.log", {"DECENTRL_TOKEN": trainer_token})
        started.append(restarted)
        assert restarted.wait(timeout=300) == 0, (logs / "trainer-2.log").read_text()[-3000:]

        # It resumed from the last checkpoint and replayed the journal since.
        second_log = (logs / "trainer-2.log").read_text()
        match = re.search(
            r"resuming from checkpoint step (\d+); replaying steps (\d+)\.\.(\d+) from the journal; store holds up to v(\d+)", second_log
        )
        assert match, second_log[-3000:]
        resumed_from, replay_from, replay_through, store_held = map(int, match.groups())
        assert resumed_from == checkpoint and replay_from == checkpoint + 1
        # The batch of the step in flight may be journaled, and the next one, fetched ahead (prefetch.py).
        assert killed_at <= replay_through <= killed_at + 2
        assert store_held == published_before and checkpoint <= store_held <= replay_through

        # One metrics record per step, versions without a gap or a repeat.
        metrics = read_metrics(run_dir)
        assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
        assert [m["policy_version"] for m in metrics] == list(range(1, STEPS + 1))
        assert [m["step"] for m in metrics if m["replayed"]] == list(range(checkpoint + 1, replay_through + 1))
        # The records of the steps before the checkpoint are those written before the crash.
        assert metrics[:checkpoint] == at_kill[:checkpoint]
        # Replayed on the same batches, the weights equal the version published before the crash.
        if store_held > checkpoint:
            (replayed,) = [m for m in metrics if "replay_max_abs_diff" in m]
            assert replayed["step"] == store_held
            assert replayed["replay_max_abs_diff"] == 0.0

        store = CheckpointStore(str(run_dir / "checkpoints"))
        versions = store.versions()
        assert versions[0] == 0 and versions[-1] == STEPS
        for version in versions:
            assert store.verify(version) == []
            assert store.manifest(version).parent == (version - 1 if version else None)
            assert store.manifest(version).base_version == (0 if lora and version else None)
        created = [store.manifest(v).created_at for v in versions]
        assert created == sorted(created), "each version was published once, in order"
        # Every version the first trainer published survived unchanged: none was published again.
        assert all(created[versions.index(v)] < os.path.getmtime(logs / "trainer-2.log") for v in versions if v <= published_before)

        # The worker was never restarted and kept generating for the resumed trainer.
        assert worker.poll() is None and orchestrator.poll() is None
        assert metrics[-1]["rollouts_accepted"] > at_kill[-1]["rollouts_accepted"]
        loaded = [int(v) for v in re.findall(r"loaded version (\d+)", (logs / "worker.log").read_text())]
        assert max(loaded) > published_before
        with urllib.request.urlopen(urllib.request.Request(f"{url}/v1/status", headers={"Authorization": f"Bearer {trainer_token}"})) as r:
            assert json.loads(r.read())["policy_version"] == STEPS
        assert list(scratch.iterdir()) == []  # the killed trainer's leftovers went at the restart, its own at its end
        assert sorted(os.listdir(run_dir / "trainer" / "checkpoints")) == [f"step_{STEPS - EVERY:06d}", f"step_{STEPS:06d}"]
    finally:
        for process in reversed(started):
            stop(process)
