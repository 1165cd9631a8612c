"""A worker told that its copy of a place lost (hedging, deterministic runs): real workers against
a real orchestrator on loopback and a real file:// store. The worker holding the losing copy
posts nothing of it (a slot with another lease posts that one), ends its simulated delay early
when all of a slot's leases lost, counts `copies_abandoned`, and the groups the trainer gets are
bit for bit those of a run without hedging. Bad lease answers: the field is typed and bounded, and
a slot given an answer it cannot read says why and asks again instead of dying."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from pydantic import ValidationError

from decentrl.api.client import InvalidAnswer, OrchestratorClient
from decentrl.api.wire import MAX_SUPERSEDED, IngestResponse, LeaseRequest, LeaseResponse, RolloutBatch, RunInfo, SamplingParams
from decentrl.config import RunConfig, SimulationConfig, WorkerConfig, parse_config
from decentrl.store.checkpoints import CheckpointStore
from orchestrator.lease_policy import MIN_RECENT
from tests.workers.test_worker import TINY, TRAINER, WORKER, Orchestrator, Setup
from workers.backends.hf import HFBackend
from workers.worker import Worker

pytestmark = pytest.mark.integration  # real servers and worker threads on loopback

DELAY_S = 5.0  # worker w0's simulated delay after each generation (w1 has none)


def run_config(*, hedging: bool) -> RunConfig:
    """Deterministic; max_staleness 0 and 2 groups a step: the budget is places 0 and 1 (batch 0)."""
    return parse_config(
        {
            "run_name": "hedging-test",
            "group_size": 2,
            "max_staleness": 0,
            "num_workers": 2,
            "trainer_ranks": 1,
            "deterministic": True,
            "model": TINY,
            "task": {"type": "sorting", "num_prompts": 64},
            "sampling": {"temperature": 1.0, "max_tokens": 6},
            "orchestrator": {
                "host": "127.0.0.1", "port": 0, "journal": False, "batch_wait_s": 0.2, "lease_wait_s": 0.5,
                "hedging": {"enabled": hedging},
            },
            "trainer": {"groups_per_step": 2, "steps": 3},
        }
    )


class Recording(OrchestratorClient):
    """The real client, recording the lease ids of every rollout it posts."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.posted: list[str] = []

    def post_rollouts(self, batch: RolloutBatch) -> IngestResponse:
        self.posted += [rollout.lease_id for rollout in batch.rollouts]
        return super().post_rollouts(batch)


@dataclass
class Run:
    setup: Setup
    workers: dict[str, Worker]
    threads: dict[str, threading.Thread]

    def start(self, worker_id: str, max_iterations: int | None = None) -> None:
        thread = threading.Thread(target=self.workers[worker_id].run, args=(max_iterations,), daemon=True)
        self.threads[worker_id] = thread
        thread.start()

    def stop(self) -> None:
        for worker in self.workers.values():
            worker.request_stop()
        for thread in self.threads.values():
            thread.join(timeout=30)
        assert not any(thread.is_alive() for thread in self.threads.values())


@contextmanager
def make_run(tmp: Path, *, hedging: bool, **workers: tuple[WorkerConfig, SimulationConfig]) -> Iterator[Run]:
    store_dir = str(tmp / "store")
    orchestrator = Orchestrator(run_config(hedging=hedging), f"file://{store_dir}")
    orchestrator.start()
    setup = Setup(orchestrator, CheckpointStore(f"file://{store_dir}"), store_dir, str(tmp), {})
    try:
        setup.publish(0, seed=1)
        built = {
            worker_id: Worker(
                config, worker_id=worker_id, cache_dir=str(tmp / "cache" / worker_id),
                client=Recording(orchestrator.url, WORKER, timeout_s=30.0, max_wait_s=1.0), backend=HFBackend(seed=0),
                simulation=simulation,
            )
            for worker_id, (config, simulation) in workers.items()
        }
        yield Run(setup, built, {})
    finally:
        orchestrator.stop()
        orchestrator.loop.call_soon_threadsafe(orchestrator.loop.stop)


def batch_bits(run: Run) -> list[tuple[list[int], list[int], list[float]]]:
    batch = run.setup.orchestrator.client(TRAINER).batch(0)
    assert batch is not None
    return [(list(s.prompt_token_ids), list(s.completion_token_ids), list(s.logprobs)) for s in batch.samples]


def wait_for(condition: Any, timeout_s: float) -> float:
    """Seconds until `condition()` held (fails after `timeout_s`)."""
    started = time.perf_counter()
    while not condition():
        assert time.perf_counter() - started < timeout_s, "timed out"
        time.sleep(0.02)
    return time.perf_counter() - started


@pytest.fixture(scope="module")
def unhedged(tmp_path_factory: pytest.TempPathFactory) -> list[tuple[list[int], list[int], list[float]]]:
    """Batch 0 (places 0 and 1) as one worker alone makes it, without hedging."""
    with make_run(tmp_path_factory.mktemp("unhedged"), hedging=False, w0=(WorkerConfig(), SimulationConfig())) as run:
        run.start("w0")
        state = run.setup.orchestrator.state
        wait_for(lambda: len(state.ready) == 2, 60)
        run.stop()
        return batch_bits(run)


@pytest.mark.parametrize("copies", [1, 2])
def test_the_worker_whose_copy_lost_abandons_it_and_the_batch_is_unchanged(
    tmp_path: Path, unhedged: list[tuple[list[int], list[int], list[float]]], copies: int
) -> None:
    """w0 (one slot with places 0 and 1, then a second slot long-polling) generates, then waits
    its DELAY_S; w1 takes `copies` copies (place 0, or both) and fills them first. w0's second
    slot is told; the losing copies are never posted. With both lost, w0's first slot wakes from
    its delay at once; with one, it waits its delay out and posts place 1 only."""
    slow = (WorkerConfig(concurrency=2, groups_per_request=2), SimulationConfig(latency_median_s=DELAY_S, latency_sigma=0.0))
    fast = (WorkerConfig(concurrency=1, groups_per_request=copies), SimulationConfig())
    with make_run(tmp_path, hedging=True, w0=slow, w1=fast) as run:
        state = run.setup.orchestrator.state
        assert state.lease_policy.hedges is not None
        for lease_s in [0.01] * (MIN_RECENT // 2) + [0.03] * (MIN_RECENT // 2):
            state.lease_policy.hedges.completed(lease_s)  # recent lease times with a tail: w0's places are due a copy after 0.01 s
        w0 = run.workers["w0"]
        run.start("w0")
        wait_for(lambda: len(state.leases) == 2, 60)
        leased = time.perf_counter()
        (first, second) = sorted(state.leases.values(), key=lambda lease: lease.lease.index or 0)
        run.start("w1", max_iterations=1)  # one lease answer: its copies, generated and posted
        run.threads["w1"].join(timeout=60)
        assert not run.threads["w1"].is_alive()
        wait_for(lambda: len(state.ready) == 2, 2 * DELAY_S + 30)
        wait_for(lambda: w0.copies_abandoned == copies, 30)
        abandoned_after = time.perf_counter() - leased
        run.stop()

        lost = [first, second][:copies]
        assert {lease.lease.lease_id for lease in lost}.isdisjoint(w0.client.posted)  # type: ignore[attr-defined]
        assert state.counters.hedged_leases == copies and state.counters.hedge_copies_told == copies
        assert state.counters.hedge_duplicates == 0 and "hedge_lost" not in state.counters.dropped
        for lease in lost:
            closed = state.lease_book.closed[lease.lease.lease_id]
            assert (closed.status, closed.samples) == ("superseded", 0)
        if copies == 1:  # the slot's other lease is posted, after the delay
            assert w0.client.posted == [second.lease.lease_id] * 2  # type: ignore[attr-defined]
        else:  # nothing left to wait for: the delay ends when told, not DELAY_S after generating
            assert w0.client.posted == []  # type: ignore[attr-defined]
            assert abandoned_after < DELAY_S - 1.0
        assert not w0._held and not w0._lost  # the slots let go of what they held
        assert os.listdir(w0.spool.directory) == []
        assert batch_bits(run) == unhedged  # the same groups, bit for bit


def test_superseded_in_a_lease_answer_is_typed_and_bounded() -> None:
    base = {"policy_version": 0, "sampling": SamplingParams(temperature=1.0, max_tokens=4).model_dump(), "leases": []}
    assert LeaseResponse.model_validate(base).superseded == []
    assert LeaseResponse.model_validate({**base, "superseded": ["a" * 32]}).superseded == ["a" * 32]
    for bad, problem in [
        ([7], "superseded.0"), ([b"ab"], "superseded.0"), ([""], "at least 1 character"), (["x" * 129], "at most 128"),
        (["l"] * (MAX_SUPERSEDED + 1), f"at most {MAX_SUPERSEDED} items"), ("abc", "valid list"),
    ]:
        with pytest.raises(ValidationError, match=problem):
            LeaseResponse.model_validate({**base, "superseded": bad})


def test_a_lease_answer_the_worker_cannot_read_is_a_clear_error_and_the_slot_asks_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A (stand-in) orchestrator answering a LeaseResponse whose `superseded` holds numbers: the
    client raises InvalidAnswer naming the field, and the worker's slot logs it and asks again."""
    asked: list[int] = []
    info = RunInfo(
        run_name="r", store_url=f"file://{tmp_path / 'store'}", policy_version=0, max_staleness=0, group_size=2,
        deterministic=True,
    )

    async def run_info(_: web.Request) -> web.Response:
        return web.json_response(info.model_dump())

    async def lease(_: web.Request) -> web.Response:
        asked.append(1)
        return web.json_response({
            "policy_version": 0, "sampling": {"temperature": 1.0, "max_tokens": 4}, "leases": [], "superseded": [1, 2],
        })

    app = web.Application()
    app.router.add_get("/v1/info", run_info)
    app.router.add_post("/v1/leases", lease)
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    runner = web.AppRunner(app)
    asyncio.run_coroutine_threadsafe(runner.setup(), loop).result(10)
    asyncio.run_coroutine_threadsafe(web.TCPSite(runner, "127.0.0.1", 0).start(), loop).result(10)
    try:
        url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        client = OrchestratorClient(url, WORKER, timeout_s=10.0, max_wait_s=1.0)
        with pytest.raises(InvalidAnswer, match=r"not a valid LeaseResponse: superseded\.0: Input should be a valid string"):
            client.lease(LeaseRequest(worker_id="w0", max_groups=1))
        worker = Worker(
            WorkerConfig(concurrency=1), worker_id="w0", cache_dir=str(tmp_path / "cache"), client=client,
            backend=HFBackend(seed=0),
        )
        thread = threading.Thread(target=worker.run, daemon=True)
        with caplog.at_level("WARNING", logger="decentrl.worker"):
            thread.start()
            wait_for(lambda: len(asked) >= 3, 30)  # the slot lived through two bad answers
            worker.request_stop()
            thread.join(timeout=30)
        assert not thread.is_alive()
        assert any("lease request failed" in r.getMessage() and "superseded" in r.getMessage() for r in caplog.records)
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)


def test_handing_back_a_lease_closed_meanwhile_goes_on_with_the_next(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A stopping worker hands back a lease the orchestrator closed meanwhile (released here; an
    expiry or a copy that lost but was not told yet is answered the same, 409): the refusal is
    logged and the hand-back goes on, instead of ending the slot's thread."""
    with make_run(tmp_path, hedging=True, w0=(WorkerConfig(), SimulationConfig())) as run:
        worker = run.workers["w0"]
        first, second = worker.client.lease(LeaseRequest(worker_id="w0", max_groups=2)).leases
        worker.client.release_lease(first.lease_id, "w0")
        with caplog.at_level("INFO", logger="decentrl.worker"):
            worker._hand_back([first, second])
        assert worker.client.lease_state(second.lease_id, "w0").state == "released"
        assert f"lease {first.lease_id} needs no handing back" in caplog.text
