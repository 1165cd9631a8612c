"""The jittered exponential back-off every retry loop shares: the lease loop and its renewals
(workers/lease_loop.py), the worker's pulls (workers/worker.py), a store's range reads
(decentrl/store/ranges.py)."""

from __future__ import annotations

import random


def backoff(failures: int, base_s: float = 0.5, cap_s: float = 30.0) -> float:
    """Seconds before retry number `failures` (1, 2, ...): exponential with full jitter, so that many
    clients cut by the same outage do not come back in step."""
    return random.uniform(0.0, min(cap_s, base_s * 2.0 ** min(failures, 16)))
