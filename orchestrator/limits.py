"""Per-token rate limits: a token bucket per token name.

A bucket holds at most `burst` requests and refills at `rate_per_s`; a request that finds it
empty is answered 429 with Retry-After (whole seconds, at least 1) saying when the next
request would pass. Buckets are kept per token name, so memory is bounded by the tokens file.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable


class RateLimiter:
    def __init__(self, rate_per_s: float, burst: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate_per_s = rate_per_s
        self.burst = float(burst)
        self.clock = clock
        self._buckets: dict[str, list[float]] = {}  # name -> [tokens left, last refill time]

    @property
    def enabled(self) -> bool:
        return self.rate_per_s > 0

    def check(self, key: str) -> float:
        """0.0 if a request by `key` may pass now (and count it); else the seconds to wait."""
        if not self.enabled:
            return 0.0
        now = self.clock()
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = [self.burst, now]
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
