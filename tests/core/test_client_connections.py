"""The orchestrator client's kept-alive connections (decentrl/api/client.py): one connection per
client and thread, so a request is one round trip, not a new TCP (and TLS) handshake each; a
connection the server closed while idle (its keep-alive timeout) is replaced without a retry's
wait; a redirect or a URL that is not http(s) is an error that says what to give instead."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Iterator

import pytest
from aiohttp import web

from decentrl.api.client import OrchestratorClient, OrchestratorError


class Server:
    """An aiohttp app on loopback that records the client port of every request."""

    def __init__(self, keepalive_s: float) -> None:
        self.peers: list[int] = []
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        app = web.Application()
        app.router.add_get("/v1/version", self.version)
        app.router.add_get("/v1/moved", self.moved)
        self.runner = web.AppRunner(app, keepalive_timeout=keepalive_s)

        async def up() -> int:
            await self.runner.setup()
            await web.TCPSite(self.runner, "127.0.0.1", 0).start()
            return self.runner.addresses[0][1]

        self.url = f"http://127.0.0.1:{asyncio.run_coroutine_threadsafe(up(), self.loop).result(10)}"

    async def version(self, request: web.Request) -> web.Response:
        assert request.transport is not None
        self.peers.append(request.transport.get_extra_info("peername")[1])
        return web.json_response({"policy_version": 3})

    async def moved(self, request: web.Request) -> web.Response:
        raise web.HTTPFound("https://elsewhere.example/v1/moved")

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)


@pytest.fixture
def server() -> Iterator[Server]:
    made = Server(keepalive_s=0.3)
    yield made
    made.close()


def versions(client: OrchestratorClient, n: int) -> None:
    for _ in range(n):
        assert client.newer_version(None, 0.0).policy_version == 3


def test_one_connection_per_thread_is_kept_alive(server: Server) -> None:
    client = OrchestratorClient(server.url, "secret-token", timeout_s=5, max_wait_s=0.5)
    versions(client, 5)
    assert len(server.peers) == 5 and len(set(server.peers)) == 1  # urllib opened 5
    threads = [threading.Thread(target=versions, args=(client, 3)) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(server.peers)) == 3  # each thread its own


def test_a_connection_the_server_closed_is_replaced_without_a_wait(
    server: Server, caplog: pytest.LogCaptureFixture
) -> None:
    client = OrchestratorClient(server.url, "secret-token", timeout_s=5, max_wait_s=0.5)
    versions(client, 1)
    time.sleep(1.0)  # past the server's keep-alive timeout: it closed the idle connection
    with caplog.at_level(logging.WARNING, logger="decentrl.api.client"):
        started = time.monotonic()
        versions(client, 1)
    assert time.monotonic() - started < 0.15  # no retry's back-off (0.1-0.3 s)
    assert "unreachable" not in caplog.text and "secret-token" not in caplog.text
    assert len(set(server.peers)) == 2


def test_a_redirect_says_which_url_to_give(server: Server) -> None:
    client = OrchestratorClient(server.url, "t", timeout_s=5, max_wait_s=0.5)
    with pytest.raises(OrchestratorError, match="302.*redirected to https://elsewhere.example/v1/moved"):
        client._request("GET", "/v1/moved")


@pytest.mark.parametrize("url", ["ftp://host/", "localhost:8740", "http://"])
def test_a_url_that_is_not_http_is_refused_at_once(url: str) -> None:
    with pytest.raises(ValueError, match="http\\(s\\)://host"):
        OrchestratorClient(url, "t")


def test_an_orchestrator_gone_is_still_retried_then_reported() -> None:
    gone = Server(keepalive_s=0.3)
    client = OrchestratorClient(gone.url, "t", timeout_s=1, max_wait_s=0.3)
    versions(client, 1)  # a kept connection, then the server goes
    gone.close()
    with pytest.raises(ConnectionError, match="unreachable for"):
        client.info()


def test_an_unreachable_orchestrator_is_given_up_on_within_max_wait_s(monkeypatch: pytest.MonkeyPatch) -> None:
    # The backoff's last wait is cut to what is left of max_wait_s: the client's waits add up to it
    # (plus the 0.05 s floor), not to a whole backoff step past it (until 2026-11-29 up to ~1 s over).
    gone = Server(keepalive_s=0.3)
    url = gone.url
    gone.close()
    client = OrchestratorClient(url, "t", timeout_s=1, max_wait_s=2.0)
    waits: list[float] = []
    monkeypatch.setattr(client._stopped, "wait", lambda seconds: waits.append(seconds) or False)
    with pytest.raises(ConnectionError, match="unreachable for 2s"):
        client.info()
    assert 2.0 <= sum(waits) <= 2.0 + 0.05 and len(waits) >= 4
