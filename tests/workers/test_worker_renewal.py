"""A rollout worker renews every lease it holds until its samples are posted, so a generation
several times the lease timeout loses nothing; a worker that dies stops renewing and its lease
expires and is leased again; renewals that fail are retried (an unreachable orchestrator) or stop
the worker loudly (anything else); a deterministic run's worker waiting on a failing store lets
its leases run out; and a slow worker asks for fewer groups. Real orchestrator on loopback and a
real file:// store (tests/workers/test_worker.py); generation is slowed by the simulated latency
the benchmarks use."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from decentrl.api.client import OrchestratorClient, OrchestratorError
from decentrl.api.wire import IngestResponse, Lease, LeaseRequest, LeaseResponse, RolloutBatch, RunInfo
from decentrl.config import RunConfig, SimulationConfig, WorkerConfig, parse_config
from decentrl.store.checkpoints import CheckpointStore
from tests.workers.test_worker import TINY, TRAINER, WORKER, Orchestrator, Setup, make_setup
from workers import lease_loop
from workers.backends.hf import HFBackend
from workers.worker import Worker

pytestmark = pytest.mark.integration  # a real server and worker threads on loopback

REPO = Path(__file__).resolve().parents[2]
LEASE_TIMEOUT_S = 1.0  # renewed every 0.5 s (MIN_RENEW_S)


class Client(OrchestratorClient):
    """The real client, recording what the worker asked for, was granted and renewed; `renew_fails`
    (seconds since its first lease was granted -> the error to raise, or None) stands in for a
    failing route. Counted from the grant, not from the client's making: a worker loading its first
    version takes a while (1.2 s in a CI run of 2026-11-29, whose leases then never ran out)."""

    def __init__(self, *args: Any, renew_fails: Callable[[float], Exception | None] = lambda _: None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.first_grant: float | None = None
        self.renew_fails = renew_fails
        self.asked: list[int] = []  # max_groups of each lease request
        self.granted: list[Lease] = []
        self.renewed: list[str] = []
        self.posted = 0

    def lease(self, request: LeaseRequest) -> LeaseResponse:
        self.asked.append(request.max_groups)
        response = super().lease(request)
        if response.leases and self.first_grant is None:
            self.first_grant = time.monotonic()
        self.granted += response.leases
        return response

    def renew_lease(self, lease_id: str, worker_id: str) -> Lease:
        if (error := self.renew_fails(time.monotonic() - (self.first_grant or time.monotonic()))) is not None:
            raise error
        lease = super().renew_lease(lease_id, worker_id)
        self.renewed.append(lease_id)
        return lease

    def post_rollouts(self, batch: RolloutBatch) -> IngestResponse:
        self.posted += len(batch.rollouts)
        return super().post_rollouts(batch)


@pytest.fixture
def short_lease_setup(tmp_path: Any) -> Iterator[Setup]:
    yield from make_setup(tmp_path, orchestrator_options={"lease_timeout_s": LEASE_TIMEOUT_S})


def renewal_config(lease_timeout_s: float = LEASE_TIMEOUT_S, **run: Any) -> RunConfig:
    """test_worker.py's run (2 samples a group, 6 tokens), with `run`'s top-level keys."""
    return parse_config({
        "run_name": "renewal-test", "group_size": 2, "max_staleness": 1, "num_workers": 1, "trainer_ranks": 1,
        "model": TINY, "task": {"type": "sorting", "num_prompts": 64}, "sampling": {"temperature": 1.0, "max_tokens": 6},
        "orchestrator": {"host": "127.0.0.1", "port": 0, "journal": False, "lease_timeout_s": lease_timeout_s,
                         "lease_wait_s": 0.5},
        "trainer": {"groups_per_step": 2, "steps": 3},
        **run,
    })


@contextmanager
def serving(tmp_path: Path, config: RunConfig, port: int = 0) -> Iterator[Setup]:
    """The real app serving `config` (on `port`; 0: any free one), its store, until the block ends."""
    store_dir = str(tmp_path / "store")
    orchestrator = Orchestrator(config, f"file://{store_dir}")
    orchestrator.port = port
    orchestrator.start()
    try:
        yield Setup(orchestrator, CheckpointStore(f"file://{store_dir}"), store_dir, str(tmp_path), {})
    finally:
        orchestrator.stop()
        orchestrator.loop.call_soon_threadsafe(orchestrator.loop.stop)


def worker_of(setup: Setup, client: Client, delay_s: float = 0.0, **settings: Any) -> Worker:
    return Worker(
        WorkerConfig(**{"groups_per_request": 2, **settings}), worker_id="w0", cache_dir=os.path.join(setup.tmp, "cache"),
        client=client, backend=HFBackend(seed=0),
        simulation=SimulationConfig(latency_median_s=delay_s, latency_sigma=0.0) if delay_s else SimulationConfig(),
    )


def client_of(setup: Setup, **kwargs: Any) -> Client:
    return Client(setup.orchestrator.url, WORKER, timeout_s=30.0, max_wait_s=1.0, **kwargs)


@pytest.fixture
def quick_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    """Renewals that fail are tried again after 0.2 s, not a random backoff (the tests' timing)."""
    monkeypatch.setattr(lease_loop, "backoff", lambda failures, base_s=0.5, cap_s=30.0: 0.2)


def test_a_generation_several_lease_timeouts_long_loses_nothing_and_leases_nothing_twice(short_lease_setup: Setup) -> None:
    setup = short_lease_setup
    setup.publish(0, seed=0)
    client = client_of(setup)
    worker = worker_of(setup, client, delay_s=3.5 * LEASE_TIMEOUT_S, concurrency=2)
    assert worker.info.lease_timeout_s == LEASE_TIMEOUT_S  # the orchestrator says it (/v1/info)
    worker.run(max_iterations=1)  # two slots, one request of 2 groups each, 3.5 lease timeouts long
    status = setup.orchestrator.client(WORKER).status()
    assert len(client.granted) == 4 and len({lease.prompt_id for lease in client.granted}) == 4
    assert status.leases_expired == 0 and status.rollouts_rejected == {}
    assert status.rollouts_accepted == worker.rollouts_posted == 4 * 2  # every sample of every group
    assert all(client.renewed.count(lease.lease_id) >= 3 for lease in client.granted), client.renewed
    assert worker.progress.gone == 0 and worker.spool.pending() == []


def test_a_worker_killed_mid_generation_stops_renewing_and_its_prompt_is_leased_again(short_lease_setup: Setup) -> None:
    setup = short_lease_setup
    setup.publish(0, seed=0)
    log = (Path(setup.tmp) / "worker.log").open("wb")
    process = subprocess.Popen(
        [sys.executable, "-m", "tests.workers.hanging_worker", setup.orchestrator.url, WORKER, str(Path(setup.tmp) / "cache")],
        env={**os.environ, "PYTHONPATH": str(REPO)}, cwd=REPO, stdout=log, stderr=log,
    )
    state = setup.orchestrator.state
    try:
        deadline = time.monotonic() + 60
        # Held past two lease timeouts: renewed (the worker generates for an hour).
        while not any(state.lease_book.clock() - held.granted_at > 2 * LEASE_TIMEOUT_S for held in state.leases.values()):
            assert time.monotonic() < deadline and process.poll() is None, (Path(setup.tmp) / "worker.log").read_text()
            time.sleep(0.05)
        (held,) = state.leases.values()
        process.kill()  # SIGKILL: no hand-back, no last renewal
        process.wait(30)
    finally:
        if process.poll() is None:
            process.kill()
    killed = time.monotonic()
    other = setup.orchestrator.client(WORKER)
    while other.status().leases_expired == 0:
        assert time.monotonic() < killed + 10, "the dead worker's lease never expired"
        time.sleep(0.05)
    assert time.monotonic() - killed < 2 * LEASE_TIMEOUT_S + 0.5  # its timeout after the last renewal (+ the check period)
    (again,) = other.lease(LeaseRequest(worker_id="w1", max_groups=1)).leases
    assert again.prompt_id == held.lease.prompt_id and again.lease_id != held.lease.lease_id  # leased again first


@pytest.mark.usefixtures("quick_backoff")
def test_renewals_that_cannot_reach_the_orchestrator_are_retried_and_a_lease_run_out_is_abandoned(
    short_lease_setup: Setup, caplog: pytest.LogCaptureFixture
) -> None:
    setup = short_lease_setup
    setup.publish(0, seed=0)
    unreachable = ConnectionError("orchestrator at http://127.0.0.1 unreachable for 1s")
    client = client_of(setup, renew_fails=lambda s: unreachable if s < 2.0 else None)
    worker = worker_of(setup, client, delay_s=3.0)
    caplog.set_level(logging.INFO)
    worker.run(max_iterations=1)  # the leases run out at 1 s; renewals get through from 2 s: found gone
    status = setup.orchestrator.client(WORKER).status()
    assert status.leases_expired == 2 and worker.progress.gone == 2
    assert client.posted == 0 and status.rollouts_rejected == {}  # nothing of a lease gone is sent
    messages = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("renewing leases failed" in m and "unreachable" in m for m in messages), messages
    assert sum("was closed while this worker held it" in m for m in messages) == 2, messages
    assert "leases gone 2" in worker.progress.line(time.monotonic())


@pytest.mark.usefixtures("quick_backoff")
def test_leases_that_ran_out_unnoticed_come_back_lease_expired_and_the_worker_names_the_setting_once(
    short_lease_setup: Setup, caplog: pytest.LogCaptureFixture
) -> None:
    setup = short_lease_setup
    setup.publish(0, seed=0)
    client = client_of(setup, renew_fails=lambda _: ConnectionError("a proxy that drops the renew route"))
    worker = worker_of(setup, client, delay_s=2.0)
    caplog.set_level(logging.INFO)
    worker.run(max_iterations=2)  # two requests, each posted after its leases ran out: the worker goes on
    rejected = setup.orchestrator.client(WORKER).status().rollouts_rejected
    assert worker.rollouts_posted == 0 and rejected == {"lease_expired": 8}, rejected
    warnings = [r.getMessage() for r in caplog.records if r.name == "decentrl.worker" and r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "[orchestrator] lease_timeout_s" in warnings[0], warnings
    assert WORKER not in caplog.text and TRAINER not in caplog.text


def test_a_renewal_refused_for_another_reason_stops_the_worker_and_run_raises_it(
    short_lease_setup: Setup, caplog: pytest.LogCaptureFixture
) -> None:
    setup = short_lease_setup
    setup.publish(0, seed=0)
    client = client_of(setup, renew_fails=lambda _: OrchestratorError(401, "unknown or revoked token"))
    worker = worker_of(setup, client, delay_s=1.5)
    started = time.monotonic()
    with pytest.raises(OrchestratorError, match="revoked token"):
        worker.run()  # no iteration limit: only the failure ends it
    assert time.monotonic() - started < 15
    assert client.asked == [2]  # stopped: no lease asked for after the failure
    assert client.posted == 4  # the generation in flight was finished and sent (its leases ran out)
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert any("renewing leases failed" in m and "the worker stops" in m for m in errors), errors


def test_a_slot_that_fails_stops_the_worker_and_run_raises_it(short_lease_setup: Setup) -> None:
    setup = short_lease_setup
    setup.publish(0, seed=0)

    class Refusing(Client):
        def post_rollouts(self, batch: RolloutBatch) -> IngestResponse:
            raise OrchestratorError(413, "body too large")

    worker = worker_of(setup, Refusing(setup.orchestrator.url, WORKER, timeout_s=30.0, max_wait_s=1.0))
    with pytest.raises(OrchestratorError, match="body too large"):
        worker.run()  # before: the slot's thread died, and run returned as if all went well
    assert len(worker.spool.pending()) == 1  # kept for the next start


def test_a_deterministic_worker_waiting_on_a_failing_store_lets_its_lease_run_out(tmp_path: Path) -> None:
    with serving(tmp_path, renewal_config(deterministic=True, max_staleness=0, num_workers=2)) as setup:
        setup.publish(0, seed=0)
        shutil.move(setup.store_dir, setup.store_dir + ".away")  # announced, but no worker can pull it
        client = client_of(setup)
        worker = worker_of(setup, client, groups_per_request=1)
        thread = threading.Thread(target=worker.run, daemon=True)
        thread.start()
        deadline = time.monotonic() + 30
        while not client.granted:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        (held,) = client.granted
        other = setup.orchestrator.client(WORKER)
        while other.status().leases_expired == 0:
            assert time.monotonic() < deadline, "the lease of a worker that cannot load its version was renewed"
            time.sleep(0.05)
        again = other.lease(LeaseRequest(worker_id="w1", max_groups=2)).leases
        assert held.index in {lease.index for lease in again} and client.renewed == []  # its place, leased again
        worker.request_stop()
        thread.join(30)
        assert not thread.is_alive()


def test_a_slow_worker_asks_for_what_it_generates_in_half_the_lease_timeout(tmp_path: Path) -> None:
    # Each group adds 2 samples x 6 tokens x 1/30 s = 0.4 s to a request: two fit the 1 s target
    # (half of 2 s leases), four do not.
    with serving(tmp_path, renewal_config(lease_timeout_s=2.0, max_staleness=7)) as setup:  # 16 groups: none waits
        setup.publish(0, seed=0, eos=False)  # every completion runs to max_tokens
        client = client_of(setup)
        worker = Worker(
            WorkerConfig(groups_per_request=4), worker_id="w0", cache_dir=os.path.join(setup.tmp, "cache"),
            client=client, backend=HFBackend(seed=0), simulation=SimulationConfig(latency_per_token_s=1 / 30),
        )
        worker.run(max_iterations=3)
        # The first request (cold) is not counted; the second measures 0.4 s a group as if nothing
        # were fixed (plus the real generation, 0.05-0.3 s here), and the request halves; the third
        # gives the slope, from which the next size follows (2 at 0.4 s; the real generation's
        # jitter on a loaded machine moves the slope by up to 0.1 s: test_lease_loop.py checks the
        # rule's arithmetic exactly).
        assert client.asked == [4, 4, 2] and len(client.granted) == 10, client.asked
        size = worker.request_size
        per_group = size.per_group_s()
        assert per_group == pytest.approx(0.4, abs=0.15) and size.groups() == min(max(int(1.0 / per_group), 1), 4)
        assert setup.orchestrator.client(WORKER).status().rollouts_rejected == {}


def test_the_lease_timeout_in_run_info_is_typed_and_bounded() -> None:
    base = {"run_name": "r", "store_url": "file:///s", "policy_version": 0, "max_staleness": 1, "group_size": 2}
    assert RunInfo.model_validate(base).lease_timeout_s is None  # an older orchestrator: not said
    assert RunInfo.model_validate({**base, "lease_timeout_s": 30}).lease_timeout_s == 30.0
    assert RunInfo.model_validate_json(json.dumps({**base, "lease_timeout_s": 1.5})).lease_timeout_s == 1.5
    for bad, problem in [
        (0, "greater than 0"), (-1.0, "greater than 0"), (float("inf"), "finite"), (float("nan"), "finite"),
        ("30", "valid number"), (True, "valid number"), ([30], "valid number"),
    ]:
        with pytest.raises(ValidationError, match=problem):
            RunInfo.model_validate({**base, "lease_timeout_s": bad})
