"""Fixtures every test directory shares: no model hub, GPU and vLLM skips, and a real
orchestrator served on loopback (`serve_orchestrator`)."""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from typing import Any

# Set before anything imports transformers, which reads them once. No model hub: tiny models are
# built from a config and tokenizers made locally.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import aiohttp  # noqa: E402
import pytest  # noqa: E402
from aiohttp import web  # noqa: E402

from decentrl.client import OrchestratorClient  # noqa: E402
from decentrl.encoding import MEDIA_JSON, MEDIA_MSGPACK, unpack_msgpack  # noqa: E402
from orchestrator.app import create_app  # noqa: E402
from orchestrator.appstate import STATE, TOKENS  # noqa: E402
from orchestrator.auth import TokenRegistry  # noqa: E402
from orchestrator.protocol import OrchestratorRunner  # noqa: E402
from orchestrator.state import RunState  # noqa: E402


def pytest_collection_modifyitems(config, items):  # noqa: ANN001 - pytest hook signature
    """`gpu` tests need CUDA; `vllm` tests need the vllm package (its own virtualenv)."""
    import importlib.util

    import torch

    skips = {
        "gpu": None if torch.cuda.is_available() else pytest.mark.skip(reason="needs a CUDA GPU"),
        "vllm": None if importlib.util.find_spec("vllm") else pytest.mark.skip(reason="needs vllm installed"),
    }
    for item in items:
        for marker, skip in skips.items():
            if skip is not None and marker in item.keywords:
                item.add_marker(skip)


# -- a real orchestrator on loopback ------------------------------------------------------


@dataclass
class LiveOrchestrator:
    """A running orchestrator app on 127.0.0.1 and an aiohttp session to call it with."""

    url: str
    app: web.Application
    http: aiohttp.ClientSession

    @property
    def state(self) -> RunState:
        return self.app[STATE]

    @property
    def tokens(self) -> TokenRegistry:
        return self.app[TOKENS]

    def client(self, token: str, **options: Any) -> OrchestratorClient:
        """The real (synchronous) client; call it with `asyncio.to_thread` so the server's loop
        keeps serving."""
        return OrchestratorClient(self.url, token, timeout_s=10.0, max_wait_s=options.pop("max_wait_s", 1.0), **options)

    async def call(self, method: str, path: str, token: str | None = None, **kwargs: Any) -> tuple[int, Any, Any]:
        """(status, body decoded by its Content-Type, headers) of one raw request."""
        headers = {**({"Authorization": f"Bearer {token}"} if token else {}), **kwargs.pop("headers", {})}
        async with self.http.request(method, self.url + path, headers=headers, **kwargs) as response:
            body = await response.read()
            if response.content_type == MEDIA_MSGPACK:
                data = unpack_msgpack(body)
            elif response.content_type == MEDIA_JSON:
                data = json.loads(body)
            else:
                data = body.decode()
            return response.status, data, response.headers


ServeOrchestrator = Callable[..., AbstractAsyncContextManager[LiveOrchestrator]]


@pytest.fixture
def serve_orchestrator() -> ServeOrchestrator:
    """`async with serve_orchestrator(state, tokens, **create_app_options) as server:` the real app
    (orchestrator/app.py) over `state`, served on 127.0.0.1 at a free port by the test's own
    event loop (run the scenario with asyncio.run), its background tasks running; stopped, and its
    background tasks torn down, when the block ends."""

    @asynccontextmanager
    async def running(
        state: RunState, tokens: TokenRegistry, *, store_url: str = "memory://test", **options: Any
    ) -> AsyncIterator[LiveOrchestrator]:
        app = create_app(state=state, tokens=tokens, store_url=store_url, **options)
        runner = OrchestratorRunner(app)
        await runner.setup()
        try:
            await web.TCPSite(runner, "127.0.0.1", 0).start()
            url = f"http://127.0.0.1:{runner.addresses[0][1]}"
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=15)) as http:
                yield LiveOrchestrator(url, app, http)
        finally:
            await runner.cleanup()

    return running
