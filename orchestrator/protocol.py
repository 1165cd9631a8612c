"""The orchestrator's HTTP connections: aiohttp's protocol, with its own parser errors made safe.

Every place that serves the app uses `OrchestratorRunner`: a request aiohttp's parser refuses gets
a JSON 400 naming only the kind of fault, not aiohttp's answer and traceback, which quote the
offending line (maybe `Authorization: Bearer <token>`). Client faults, which anyone can cause, go
to `client_faults`: at most BURST lines per PERIOD_S of each kind, never a header value or bytes.
"""

from __future__ import annotations

import json
import logging
import time

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestHandler

from decentrl.api.encoding import MEDIA_JSON


class ThrottledLog:
    """One WARNING line per client fault, at most BURST a PERIOD_S for each kind."""

    PERIOD_S = 60.0
    BURST = 5

    def __init__(self, logger: logging.Logger) -> None:
        self.logger = logger
        self._windows: dict[str, tuple[float, int, int]] = {}  # kind -> (window start, lines, left out)

    def warning(self, kind: str, message: str, *args: object) -> None:
        """Log `message % args` as one WARNING line, unless `kind` used up its lines this period."""
        now = time.monotonic()
        start, lines, left_out = self._windows.get(kind, (now, 0, 0))
        if now - start >= self.PERIOD_S:
            start, lines = now, 0
        if lines >= self.BURST:
            self._windows[kind] = (start, lines, left_out + 1)
            return
        if left_out:
            message += f" ({left_out} more like it not logged)"
        self._windows[kind] = (start, lines + 1, 0)
        self.logger.warning(message, *args)


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
