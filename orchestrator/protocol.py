"""The orchestrator's HTTP connections: aiohttp's protocol, with its own parser errors made safe.

Every place that serves the app (`serve`, the tests' loopback fixture, the benchmarks) uses
`OrchestratorRunner` instead of `web.AppRunner`. A request aiohttp's parser refuses (a control
character in a header, a line past 8190 bytes, a bad request line) never reaches the middlewares:
aiohttp answers it itself, quoting the offending line, and logs it at ERROR with a traceback that
quotes it again, and that line may be `Authorization: Bearer <token>`. Here such a request gets a
JSON 400 naming only the kind of fault, and one throttled WARNING line without the bytes
(orchestrator/loglines.py); tests/orchestrator/test_orchestrator_hostile.py checks both.
"""

from __future__ import annotations

import json
import logging

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestHandler

from decentrl.api.encoding import MEDIA_JSON
from orchestrator.loglines import ThrottledLog

log = logging.getLogger("decentrl.orchestrator.http")
client_faults = ThrottledLog(log)


class _Connection(RequestHandler):
    """One client connection; aiohttp calls `handle_error` for what its parser refused."""

    def handle_error(
        self, request: web.BaseRequest, status: int = 500, exc: BaseException | None = None, message: str | None = None
    ) -> web.StreamResponse:
        if not isinstance(exc, HttpProcessingError):  # the app's own failures: aiohttp's handling
            return super().handle_error(request, status, exc, message)
        kind = type(exc).__name__
        client_faults.warning("protocol", "malformed HTTP request from %s refused (%s)", request.remote, kind)
        answer = {
            "error": f"malformed HTTP request ({kind}); check the request line and headers "
            "(header lines at most 8190 bytes, no control characters)"
        }
        response = web.Response(status=exc.code or 400, text=json.dumps(answer), content_type=MEDIA_JSON)
        response.force_close()
        return response


class _Server(web.Server):
    def __call__(self) -> RequestHandler:
        # aiohttp builds each connection's protocol here; `_kwargs` are the handler arguments it
        # was given (aiohttp has no public hook for the protocol class: a test fails if this breaks).
        return _Connection(self, loop=self._loop, **self._kwargs)


class OrchestratorRunner(web.AppRunner):
    """`web.AppRunner` whose connections answer parser errors as above."""

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = _Server  # the same object, only the protocol factory differs
        return server
