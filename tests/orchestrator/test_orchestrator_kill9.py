"""kill -9 the orchestrator under load, restart it: nothing acknowledged is lost, nothing served twice.

A real `python -m decentrl orchestrator CONFIG --run-dir DIR --port P` (tokens file made with
`orchestrator.auth.add_token`), four worker threads posting through the real OrchestratorClient
(msgpack) and a trainer thread pulling batches. Each worker posts every group in two halves,
so at any moment some leases hold partial groups. After a while the orchestrator gets SIGKILL;
every thread stops at its first connection error, remembering the request it had in flight.

Then the same command starts it again, and:
- its counters, open leases and partial groups are those it had acknowledged (recovered from
  the journal); every rollout a worker had an answer for is in the journal;
- the workers re-post every sample of their leases (answers they got count as duplicates, the
  in-flight ones are accepted now or were already), which completes every group;
- the trainer first re-asks the request it had in flight (same request id: if that batch was
  served before the kill, the same batch comes back), then drains the buffer.
Every acknowledged rollout reaches the trainer, and no rollout is in two different batches.
Leases whose grant was committed but whose answer the kill cut off stay open until they expire.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from pathlib import Path

import pytest

from decentrl.api.client import OrchestratorClient
from decentrl.api.wire import Lease, LeaseRequest, Rollout, RolloutBatch, SamplingParams, TrainBatch
from decentrl.cli.launch import free_port
from decentrl.store.checkpoints import CheckpointStore
from orchestrator.auth import add_token
from tests.pipeline.test_pipeline import TINY_MODEL

pytestmark = pytest.mark.integration

GROUP = 4
WORKERS = 4
CONFIG = f"""
run_name = "kill9"
max_staleness = 1000
group_size = {GROUP}
trainer_ranks = 1
{TINY_MODEL}
[orchestrator]
lease_timeout_s = 600.0
rate_limit_per_s = 0
batch_wait_s = 2.0
[trainer]
groups_per_step = 1
"""


def publish(run_dir: Path, *versions: int) -> None:
    """Put `versions` in the run's default store (RUN_DIR/checkpoints), as a trainer would before
    announcing them: the orchestrator refuses to announce a version the store lacks. Their one
    file is not a model; nothing here pulls them."""
    store = CheckpointStore(str(run_dir / "checkpoints"))
    files = run_dir / "version-files"
    files.mkdir(exist_ok=True)
    (files / "config.json").write_text("{}")
    for version in versions:
        store.publish(version, str(files))


def start(config: Path, run_dir: Path, port: int, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """`decentrl orchestrator` in its own process (extra environment `env`), once /healthz answers."""
    log = open(run_dir / "orchestrator.log", "ab")
    process = subprocess.Popen(
        [sys.executable, "-m", "decentrl", "orchestrator", str(config), "--run-dir", str(run_dir), "--port", str(port)],
        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env={**os.environ, **(env or {})},
    )
    deadline = time.monotonic() + 120
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1) as response:
                if response.status == 200:
                    return process
        except OSError:
            pass
        assert process.poll() is None, (run_dir / "orchestrator.log").read_text()
        assert time.monotonic() < deadline, "orchestrator did not start"
        time.sleep(0.2)


class WorkerThread(threading.Thread):
    """Leases groups and posts each in two halves until the orchestrator goes away."""

    def __init__(self, url: str, token: str, name: str) -> None:
        super().__init__(daemon=True)
        self.client = OrchestratorClient(url, token, timeout_s=10, max_wait_s=0.5)
        self.worker_id = name
        self.leases: dict[str, tuple[Lease, list[Rollout]]] = {}
        self.acknowledged: set[str] = set()
        self.in_flight: set[str] = set()
        self.stopped_by: BaseException | None = None

    def samples(self, lease: Lease, sampling: SamplingParams) -> list[Rollout]:
        return [
            Rollout(
                rollout_id=uuid.uuid4().hex, run_name="kill9", lease_id=lease.lease_id, prompt_id=lease.prompt_id,
                worker_id=self.worker_id, policy_version=0, prompt_token_ids=lease.prompt_token_ids,
                completion_token_ids=[4 + i, 5, 2], logprobs=[-0.5, -0.25, -0.125], finish_reason="stop",
                sampling=sampling,
            )
            for i in range(lease.group_size)
        ]

    def post(self, rollouts: list[Rollout]) -> None:
        self.in_flight = {r.rollout_id for r in rollouts}
        result = self.client.post_rollouts(RolloutBatch(rollouts=rollouts))
        assert not result.rejected, result.rejected
        self.acknowledged |= self.in_flight  # accepted now, or duplicates of earlier acceptances
        self.in_flight = set()

    def run(self) -> None:
        try:
            while True:
                answer = self.client.lease(LeaseRequest(worker_id=self.worker_id, max_groups=2))
                for lease in answer.leases:
                    self.leases[lease.lease_id] = (lease, self.samples(lease, answer.sampling))
                for lease in answer.leases:
                    self.post(self.leases[lease.lease_id][1][: GROUP // 2])
                for lease in answer.leases:
                    self.post(self.leases[lease.lease_id][1][GROUP // 2 :])
        except (ConnectionError, OSError) as exc:
            self.stopped_by = exc


class TrainerThread(threading.Thread):
    """Pulls batches with explicit request ids until the orchestrator goes away."""

    def __init__(self, url: str, token: str) -> None:
        super().__init__(daemon=True)
        self.client = OrchestratorClient(url, token, timeout_s=10, max_wait_s=0.5)
        self.batches: dict[str, TrainBatch] = {}
        self.pending_request: str | None = None
        self.stopped_by: BaseException | None = None

    def fetch(self, request_id: str) -> TrainBatch | None:
        self.pending_request = request_id
        batch = self.client.batch(0, request_id=request_id)
        self.pending_request = None
        if batch is not None:
            assert batch.batch_id is not None
            previous = self.batches.setdefault(batch.batch_id, batch)
            assert previous == batch, "a batch id came back with other contents"
        return batch

    def run(self) -> None:
        try:
            while True:
                self.fetch(uuid.uuid4().hex)
        except (ConnectionError, OSError) as exc:
            self.stopped_by = exc


def test_kill_9_mid_load_loses_nothing_acknowledged_and_serves_nothing_twice(tmp_path: Path) -> None:
    config = tmp_path / "kill9.toml"
    config.write_text(CONFIG)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    tokens_file = str(run_dir / "tokens.json")
    worker_tokens = [add_token(tokens_file, name=f"w{i}", role="worker") for i in range(WORKERS)]
    trainer_token = add_token(tokens_file, name="trainer", role="trainer")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    process = start(config, run_dir, port)
    try:
        publish(run_dir, 0)
        OrchestratorClient(url, trainer_token).announce(0)
        workers = [WorkerThread(url, token, f"w{i}-gpu0") for i, token in enumerate(worker_tokens)]
        trainer = TrainerThread(url, trainer_token)
        for thread in [*workers, trainer]:
            thread.start()
        deadline = time.monotonic() + 60
        while sum(len(w.acknowledged) for w in workers) < 200 or not trainer.batches:
            assert time.monotonic() < deadline, "no load built up"
            assert all(t.is_alive() for t in [*workers, trainer]), [t.stopped_by for t in [*workers, trainer]]
            time.sleep(0.05)
        process.send_signal(signal.SIGKILL)  # mid-load: requests are in flight
        process.wait(timeout=30)
        for thread in [*workers, trainer]:
            thread.join(timeout=30)
            assert not thread.is_alive()
        acknowledged = set().union(*(w.acknowledged for w in workers))
        uncertain = set().union(*(w.in_flight for w in workers))
        partial = {lid for w in workers for lid, (_, rs) in w.leases.items() if not {r.rollout_id for r in rs} <= w.acknowledged}
        assert partial, "no group was partial at the kill; the test would prove less"

        # What the journal holds right after the kill: every acknowledged rollout.
        with sqlite3.connect(run_dir / "journal.sqlite") as db:
            journaled = {row[0] for row in db.execute("SELECT rollout_id FROM rollouts")}
        assert acknowledged <= journaled
        assert journaled <= acknowledged | uncertain

        process = start(config, run_dir, port)
        status = OrchestratorClient(url, trainer_token).status()
        assert status.recoveries == 1
        assert status.policy_version == 0
        assert len(acknowledged) <= status.rollouts_accepted <= len(acknowledged | uncertain)
        served_before = sum(len(b.samples) for b in trainer.batches.values())
        assert status.groups_served * GROUP >= served_before  # batches served (and maybe lost in flight)

        # Partial groups came back with their samples and their original deadlines.
        for worker in workers:
            for lease_id in partial & worker.leases.keys():
                lease, rollouts = worker.leases[lease_id]
                state = worker.client.lease_state(lease_id, worker.worker_id)
                ids = {r.rollout_id for r in rollouts}
                assert state.deadline == lease.deadline
                assert len(ids & worker.acknowledged) <= state.samples <= len(ids & (worker.acknowledged | uncertain))
                # Open, unless the post the kill cut off had completed the group before it.
                assert state.state == "open" or (state.samples == GROUP and ids & uncertain), state

        # The trainer re-asks its lost request first: same request id, same batch if it was served.
        trainer.client.max_wait_s = 30
        if trainer.pending_request is not None:
            trainer.fetch(trainer.pending_request)
        # Workers finish their groups: re-posting everything is safe (idempotent by rollout id).
        for worker in workers:
            worker.client.max_wait_s = 30
            for lease, rollouts in worker.leases.values():
                result = worker.client.post_rollouts(RolloutBatch(rollouts=rollouts))
                assert not result.rejected or {r.reason for r in result.rejected} == {"group_full"}, result
                worker.acknowledged |= {r.rollout_id for r in rollouts}
        while (batch := trainer.fetch(uuid.uuid4().hex)) is not None:
            pass

        served: dict[str, str] = {}
        for batch_id, batch in trainer.batches.items():
            for sample in batch.samples:
                assert sample.rollout_id not in served, f"rollout {sample.rollout_id} served in two batches"
                served[sample.rollout_id] = batch_id
        assert acknowledged <= served.keys(), f"{len(acknowledged - served.keys())} acknowledged rollouts never served"
        everything = set().union(*(w.acknowledged for w in workers))
        assert served.keys() == everything
        final = OrchestratorClient(url, trainer_token).status()
        assert final.rollouts_accepted == len(everything)
        assert final.groups_ready == 0 and final.rollouts_rejected == {}
        # Every lease a worker knew of is complete; the only ones left open are those whose grant
        # was committed but whose answer the kill cut off (they expire after lease_timeout_s).
        for worker in workers:
            for lease_id in worker.leases:
                assert worker.client.lease_state(lease_id, worker.worker_id).state == "served"
        assert final.leases_active <= 2 * WORKERS
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=30)
    log = (run_dir / "orchestrator.log").read_text()
    assert "recovered from" in log
    for token in worker_tokens + [trainer_token]:
        assert token not in log, "a token was logged"
    assert json.loads((run_dir / "tokens.json").read_text())["tokens"]
    assert os.path.getsize(run_dir / "journal.sqlite") > 0
