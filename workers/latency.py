"""Simulated generation latency, for benchmarks on a machine where generation is cheap.

The toy task generates 5 tokens in milliseconds, while real reasoning traces take seconds to
minutes with a long tail. To measure scheduling (asynchronous vs synchronous, stragglers) with
the real system, a worker can hold each finished group back for an extra delay drawn from a
log-normal distribution - median `median_s`, shape `sigma` (sigma 1.0: p90 = 3.6x median,
p99 = 10x) - and multiply its whole generation time by `slowdown` (a slower GPU). The delay is
a sleep, so it costs no CPU: it stands for work done on the worker's own accelerator.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass


@dataclass(frozen=True)
class LatencyModel:
    median_s: float = 0.0  # 0 = no injected delay
    sigma: float = 1.0
    slowdown: float = 1.0  # >= 1; 10 = a worker ten times slower than the rest

    def extra_delay(self, rng: random.Random, generation_s: float) -> float:
        """Seconds to wait after a real generation that took `generation_s`."""
        tail = self.median_s * math.exp(self.sigma * rng.gauss(0.0, 1.0)) if self.median_s > 0 else 0.0
        return generation_s * (self.slowdown - 1.0) + self.slowdown * tail
