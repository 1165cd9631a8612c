"""One log line per kind of client fault, at most a few a minute: never a traceback, never a header.

Used by the middlewares (a client gone mid-request) and orchestrator/protocol.py (requests
aiohttp's parser refused). Anyone who can open a connection can cause such faults, so they must
not flood the log: each kind writes at most `burst` lines per `period_s`, and the next line that
gets through says how many were left out. Callers name the kind, the peer and the route, never a
header value (a token) or the offending bytes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable


class ThrottledLog:
    def __init__(
        self, logger: logging.Logger, *, period_s: float = 60.0, burst: int = 5,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.logger = logger
        self.period_s = period_s
        self.burst = burst
        self.clock = clock
        self._windows: dict[str, tuple[float, int, int]] = {}  # kind -> (window start, lines, left out)

    def warning(self, kind: str, message: str, *args: object) -> None:
        """Log `message % args` as one WARNING line, unless `kind` used up its lines this period."""
        now = self.clock()
        start, lines, left_out = self._windows.get(kind, (now, 0, 0))
        if now - start >= self.period_s:
            start, lines = now, 0
        if lines >= self.burst:
            self._windows[kind] = (start, lines, left_out + 1)
            return
        if left_out:
            message += f" ({left_out} more like it not logged)"
        self._windows[kind] = (start, lines + 1, 0)
        self.logger.warning(message, *args)
