"""GET /v1/version, the workers' version long-poll, on real loopback HTTP: it answers at once with
a newer version, wakes when one is announced, ends unchanged at its wait or when the app stops,
and refuses malformed parameters with a 400 naming what to fix (never a 5xx)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from typing import TYPE_CHECKING

import pytest

from decentrl.api.client import OrchestratorError
from decentrl.api.encoding import MEDIA_MSGPACK
from tests.orchestrator.conftest import ADMIN, SCORER, TRAINER, WORKER, ServeFn

if TYPE_CHECKING:
    pass


def run(coro: Awaitable[None]) -> None:
    asyncio.run(asyncio.wait_for(coro, timeout=30))  # type: ignore[arg-type]


def test_a_newer_version_is_answered_at_once_and_any_role_may_ask(serve: ServeFn) -> None:
    async def scenario() -> None:
        async with serve() as server:
            await asyncio.to_thread(server.client(TRAINER).announce, 3)
            for token in (WORKER, TRAINER, SCORER, ADMIN):
                started = time.monotonic()
                status, body, _ = await server.call("GET", "/v1/version?after=2&wait_s=20", token)
                assert (status, body) == (200, {"policy_version": 3})
                assert time.monotonic() - started < 1.0
            assert (await server.call("GET", "/v1/version", WORKER))[1] == {"policy_version": 3}  # no after: any version
            status, body, _ = await server.call("GET", "/v1/version?wait_s=0&after=3", WORKER, headers={"Accept": MEDIA_MSGPACK})
            assert (status, body) == (200, {"policy_version": 3})  # wait_s 0: at once, unchanged
            assert (await server.call("GET", "/v1/version?after=2"))[0] == 401  # a token, as for /v1/info

    run(scenario())


def test_the_long_poll_wakes_on_the_announcement(serve: ServeFn) -> None:
    """Woken by the announcement itself, well before its 20 s wait, over the real client; before
    v0 exists, a long-poll without `after` waits for v0."""

    async def scenario() -> None:
        async with serve() as server:
            worker, trainer = server.client(WORKER), server.client(TRAINER)
            first = asyncio.create_task(asyncio.to_thread(worker.newer_version, None, 20.0))
            await asyncio.sleep(0.3)
            assert not first.done()  # nothing published yet: held
            await asyncio.to_thread(trainer.announce, 0)
            assert (await first).policy_version == 0
            for version in (1, 2, 5):
                waiting = asyncio.create_task(asyncio.to_thread(worker.newer_version, version - 1 if version < 5 else 2, 20.0))
                await asyncio.sleep(0.2)
                assert not waiting.done()
                sent = time.monotonic()
                await asyncio.to_thread(trainer.announce, version)
                assert (await waiting).policy_version == version
                assert time.monotonic() - sent < 0.5

    run(scenario())


def test_the_long_poll_ends_unchanged_at_its_wait(serve: ServeFn) -> None:
    async def scenario() -> None:
        async with serve() as server:
            worker = server.client(WORKER)
            started = time.monotonic()
            assert (await asyncio.to_thread(worker.newer_version, None, 0.4)).policy_version is None  # none yet
            await asyncio.to_thread(server.client(TRAINER).announce, 1)
            assert (await asyncio.to_thread(worker.newer_version, 1, 0.4)).policy_version == 1
            assert (await asyncio.to_thread(worker.newer_version, 7, 0.4)).policy_version == 1  # ahead of the run: waits too
            assert 1.2 <= time.monotonic() - started < 5.0

    run(scenario())


def test_a_waiting_long_poll_answers_at_once_when_the_app_stops(serve: ServeFn) -> None:
    """Shutdown (SIGTERM's path: on_shutdown `stop_waiting`) answers a 60 s long-poll at once with the
    unchanged version, as it does the lease and batch long-polls; tests/orchestrator/
    test_orchestrator_hostile.py does it with a real SIGTERM."""

    async def scenario() -> None:
        async with serve() as server:
            await asyncio.to_thread(server.client(TRAINER).announce, 4)
            waiting = asyncio.create_task(asyncio.to_thread(server.client(WORKER).newer_version, 4, 60.0))
            await asyncio.sleep(0.3)
            assert not waiting.done()
            stopping = time.monotonic()
        assert (await waiting).policy_version == 4
        assert time.monotonic() - stopping < 2.0

    run(scenario())


@pytest.mark.parametrize(
    ("query", "named"),
    [
        ("after=-1", "after"), ("after=x", "after"), ("after=1.5", "after"), ("after=%201", "after"), ("after=%2B1", "after"),
        ("after=true", "after"), ("after=", "after"), ("after=1_0", "after"), ("after=%D9%A3", "after"),
        (f"after={2**31}", "between 0 and"), ("after=" + "9" * 32, "between 0 and"), ("after=" + "9" * 5000, "after"),
        ("after=1&after=2", "given 2 times"),
        ("wait_s=-1", "wait_s"), ("wait_s=60.5", "between 0 and 60"), ("wait_s=1e999", "between 0 and 60"),
        ("wait_s=nan", "wait_s"), ("wait_s=inf", "wait_s"), ("wait_s=", "wait_s"), ("wait_s=1_0", "wait_s"),
        ("wait_s=.5", "wait_s"), ("wait_s=0x10", "wait_s"), ("wait_s=1&wait_s=1", "given 2 times"),
        ("wait=5", "unknown query parameter 'wait'"), ("after=1&wait_s=1&since=0", "unknown query parameter 'since'"),
    ],
)
def test_malformed_parameters_are_a_400_naming_them(serve: ServeFn, query: str, named: str) -> None:
    async def scenario() -> None:
        async with serve() as server:
            await asyncio.to_thread(server.client(TRAINER).announce, 0)
            started = time.monotonic()
            status, body, _ = await server.call("GET", f"/v1/version?{query}", WORKER)
            assert status == 400, body
            assert named in body["error"]
            assert time.monotonic() - started < 1.0  # refused before any wait
            assert (await server.call("GET", "/v1/version?after=0&wait_s=0", WORKER))[0] == 200  # still serving

    run(scenario())


def test_the_client_raises_the_400_with_its_message(serve: ServeFn) -> None:
    async def scenario() -> None:
        async with serve() as server:
            with pytest.raises(OrchestratorError, match="wait_s must be between 0 and 60"):
                await asyncio.to_thread(server.client(WORKER).newer_version, 0, 61.0)

    run(scenario())


def test_the_route_is_described(serve: ServeFn) -> None:
    async def scenario() -> None:
        async with serve() as server:
            status, spec, _ = await server.call("GET", "/openapi.json")
            assert status == 200
            get, post = spec["paths"]["/v1/version"]["get"], spec["paths"]["/v1/version"]["post"]
            assert {p["name"]: p["required"] for p in get["parameters"]} == {"after": False, "wait_s": False}
            assert get["parameters"][1]["schema"]["maximum"] == 60
            assert "400" in get["responses"] and "worker" in get["description"] and "worker" not in post["description"]

    run(scenario())
