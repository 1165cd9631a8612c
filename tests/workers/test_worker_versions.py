"""How a worker hears of new versions (workers/versions.py): one GET /v1/version long-poll
outstanding against a real orchestrator on loopback, timed from the trainer's announcement over
many announcements (benchmarks/announce_latency.py's measurement); an unreachable orchestrator is
asked again and the watch lives on; one without the route is polled at /v1/info; a revoked token
ends the watch with its error (the worker then stops, as for any thread's error)."""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from transformers import PreTrainedTokenizerBase

from decentrl.api.client import OrchestratorClient, OrchestratorError
from decentrl.api.wire import RunInfo
from decentrl.cli.launch import free_port
from decentrl.config import WorkerConfig
from decentrl.tasks import build_task
from orchestrator.app import create_app
from orchestrator.auth import TokenRegistry
from orchestrator.state import RunState
from workers.backends.hf import HFBackend
from workers.versions import watch_versions
from workers.worker import Worker

ROOT = Path(__file__).resolve().parents[2]
WORKER, TRAINER = "worker-secret", "trainer-secret"
TOKENS = [{"name": "alice", "role": "worker", "token": WORKER}, {"name": "trainer", "role": "trainer", "token": TRAINER}]
OLD_PERIOD_S = 2.0  # WorkerConfig.version_poll_s: how often the worker asked /v1/info before the long-poll


def bench() -> Any:
    spec = importlib.util.spec_from_file_location("announce_latency", ROOT / "benchmarks" / "announce_latency.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Served:
    """An aiohttp app on 127.0.0.1:`port` in a background event loop, until close()."""

    def __init__(self, app: web.Application, port: int = 0) -> None:
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.runner = web.AppRunner(app)

        async def up() -> int:
            await self.runner.setup()
            await web.TCPSite(self.runner, "127.0.0.1", port).start()
            return self.runner.addresses[0][1]

        self.url = f"http://127.0.0.1:{asyncio.run_coroutine_threadsafe(up(), self.loop).result(timeout=60)}"

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(timeout=60)
        self.loop.call_soon_threadsafe(self.loop.stop)


@pytest.fixture
def run_state(make_config: Any, tokenizer: PreTrainedTokenizerBase) -> RunState:
    config = make_config(trainer={"steps": 1000})
    return RunState(config=config, task=build_task(config.task), tokenizer=tokenizer)


@pytest.fixture
def orchestrator(run_state: RunState) -> Iterator[Served]:
    """The real app (no store: an announcement is taken on the trainer's word), v0 announced."""
    run_state.announce(0)
    served = Served(create_app(state=run_state, tokens=TokenRegistry(TOKENS), store_url="memory://versions"))
    yield served
    served.close()


def client(url: str, token: str = WORKER) -> OrchestratorClient:
    return OrchestratorClient(url, token, timeout_s=10.0, max_wait_s=0.5)


def test_each_announcement_is_heard_within_milliseconds(orchestrator: Served) -> None:
    """50 announcements: the worker's watch hears each well within the old 2 s poll period (on
    loopback, in milliseconds: the long-poll is answered as the announcement commits)."""
    trainer = client(orchestrator.url, TRAINER)
    latencies = bench().announce_latencies(client(orchestrator.url), trainer.announce, range(1, 51), gap_s=0.03)
    figures = bench().summary(latencies)
    assert figures["n"] == 50
    # The median is the claim; a loaded CI host may stall one or two answers past a poll's quarter
    # (CI saw one at 1.28 s with the p50 at 3 ms), the old poll would have made most of them late.
    late = [s for s in latencies if s >= OLD_PERIOD_S / 4]
    assert figures["p50_s"] < 0.1 and len(late) <= 2, figures


def test_the_worker_hears_a_version_no_lease_answer_told(orchestrator: Served, tmp_path: Path) -> None:
    """The worker's `versions` thread (no slot runs, so no lease answer tells it) hears of v3 at
    once and records when (the swap's `seen_at`); a stop ends the thread within one wait."""
    worker = Worker(
        WorkerConfig(version_wait_s=1.0), worker_id="w0", cache_dir=str(tmp_path / "cache"), client=client(orchestrator.url),
        backend=HFBackend(seed=0),
    )
    assert worker.announced == 0
    thread = threading.Thread(target=worker._watch, daemon=True)
    thread.start()
    time.sleep(0.3)
    sent = time.time()
    client(orchestrator.url, TRAINER).announce(3)
    with worker._changed:
        assert worker._changed.wait_for(lambda: worker.announced == 3, timeout=5)
    assert 0 <= worker._seen_at[3] - sent < 0.5
    worker.request_stop()
    thread.join(timeout=5)
    assert not thread.is_alive()


def test_an_unreachable_orchestrator_is_asked_again_and_the_watch_lives(
    run_state: RunState, caplog: pytest.LogCaptureFixture
) -> None:
    """Nothing listens at first: each failed ask is logged and repeated `retry_s` later, and once
    the orchestrator serves, the watch hears its versions."""
    port = free_port()
    heard: list[int | None] = []
    stop = threading.Event()
    thread = threading.Thread(
        target=watch_versions, daemon=True,
        kwargs={"client": client(f"http://127.0.0.1:{port}"), "known": lambda: max((v for v in heard if v is not None), default=None),
                "heard": heard.append, "stop": stop, "wait_s": 2.0, "retry_s": 0.2},
    )
    with caplog.at_level(logging.WARNING, logger="decentrl.worker"):
        thread.start()
        time.sleep(2.0)
        assert heard == [] and thread.is_alive()
        served = Served(create_app(state=run_state, tokens=TokenRegistry(TOKENS), store_url="memory://versions"), port)
        try:
            client(served.url, TRAINER).announce(5)
            deadline = time.monotonic() + 10
            while 5 not in heard and time.monotonic() < deadline:
                time.sleep(0.05)
            assert 5 in heard
        finally:
            stop.set()
            served.close()  # answers the waiting long-poll: the thread sees `stop`
    thread.join(timeout=10)
    assert not thread.is_alive()
    assert any("asking for new versions failed" in r.getMessage() for r in caplog.records)


def test_without_the_route_the_watch_polls_info(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """An orchestrator older than GET /v1/version (it answers 405: POST /v1/version exists) is
    polled at /v1/info every `retry_s`, as workers did before."""
    published: list[int] = [1]
    asked: list[float] = []

    async def info(_: web.Request) -> web.Response:
        asked.append(time.monotonic())
        info = RunInfo(run_name="r", store_url="memory://x", policy_version=published[0], max_staleness=1, group_size=2)
        return web.json_response(info.model_dump())

    async def announce(_: web.Request) -> web.Response:
        return web.json_response({})

    app = web.Application()
    app.router.add_get("/v1/info", info)
    app.router.add_post("/v1/version", announce)
    served = Served(app)
    heard: list[int | None] = []
    stop = threading.Event()
    thread = threading.Thread(
        target=watch_versions, daemon=True,
        kwargs={"client": client(served.url), "known": lambda: 1, "heard": heard.append, "stop": stop, "wait_s": 30.0, "retry_s": 0.2},
    )
    try:
        with caplog.at_level(logging.WARNING, logger="decentrl.worker"):
            thread.start()
            time.sleep(0.5)
            published[0] = 2
            deadline = time.monotonic() + 5
            while 2 not in heard and time.monotonic() < deadline:
                time.sleep(0.05)
            assert 2 in heard and set(heard) <= {1, 2}
        assert len([r for r in caplog.records if "has no GET /v1/version" in r.getMessage()]) == 1
        gaps = [b - a for a, b in zip(asked, asked[1:], strict=False)]
        assert gaps and min(gaps) >= 0.15  # a poll period, not a hot loop
    finally:
        stop.set()
        thread.join(timeout=5)
        served.close()
    assert not thread.is_alive()


def test_a_revoked_token_ends_the_watch_with_its_error(orchestrator: Served) -> None:
    with pytest.raises(OrchestratorError) as raised:
        watch_versions(client(orchestrator.url, "revoked"), known=lambda: 0, heard=lambda _: None, stop=threading.Event(),
                       wait_s=1.0, retry_s=0.1)
    assert raised.value.status == 401
