"""Request limits of the orchestrator: a rate per token, and bounds on rollout posts in flight.

Created by create_app from [orchestrator]; used by the auth middleware (RateLimiter) and the
rollouts handler (InFlight).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager


class RateLimiter:
    """A token bucket per token name: at most `burst` requests, refilled at `rate_per_s`; a request
    that finds it empty is answered 429 with Retry-After saying when the next would pass."""

    def __init__(self, rate_per_s: float, burst: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate_per_s = rate_per_s
        self.burst = float(burst)
        self.clock = clock
        self._buckets: dict[str, list[float]] = {}  # name -> [tokens left, last refill time]

    def check(self, key: str) -> float:
        """0.0 if a request by `key` may pass now (and count it); else the seconds to wait."""
        if self.rate_per_s <= 0:
            return 0.0
        now = self.clock()
        bucket = self._buckets.setdefault(key, [self.burst, now])
        tokens = min(self.burst, bucket[0] + (now - bucket[1]) * self.rate_per_s)
        bucket[1] = now
        if tokens >= 1.0:
            bucket[0] = tokens - 1.0
            return 0.0
        bucket[0] = tokens
        return (1.0 - tokens) / self.rate_per_s


def retry_after_header(seconds: float) -> str:
    """The Retry-After value (delta-seconds, an integer >= 1) for a wait of `seconds`."""
    return str(max(1, math.ceil(seconds)))


class InFlight:
    """Rollout posts being processed now, in all and per token. At `limit` in all, or `per_key` for
    the caller's token, a new post is refused at once (503) rather than queued, so a client's retry,
    not the orchestrator's memory, absorbs a burst, and one token fills only its own places."""

    def __init__(self, limit: int, per_key: int) -> None:
        self.limit = limit
        self.per_key = per_key
        self.count = 0
        self._by_key: dict[str, int] = {}  # keys with posts in flight only: bounded by `limit`

    def full(self, key: str) -> str | None:
        """Why a post by `key` may not start now ("all", "token"), or None if it may."""
        if self.count >= self.limit:
            return "all"
        if self._by_key.get(key, 0) >= self.per_key:
            return "token"
        return None

    @contextmanager
    def held(self, key: str) -> Iterator[None]:
        self.count += 1
        self._by_key[key] = self._by_key.get(key, 0) + 1
        try:
            yield
        finally:
            self.count -= 1
            left = self._by_key.pop(key) - 1
            if left:
                self._by_key[key] = left
