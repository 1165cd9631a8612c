"""Simulated generation latency ([simulation], benchmarks only), applied around one step.

The toy task generates 5 tokens in milliseconds, while real reasoning traces take seconds to
minutes with a long tail. To measure scheduling (asynchronous vs synchronous, stragglers) with
the real system, a worker holds each lease request's finished samples back for an extra delay
drawn from a log-normal distribution - median `latency_median_s`, shape `latency_sigma` (sigma
1.0: p90 = 3.6x median, p99 = 10x) - and multiplies its whole generation time by its slowdown
(a slower GPU). The delay is a sleep, so it costs no CPU: it stands for work done on the
worker's own accelerator, and slots overlap their delays as they would overlap real requests.

`Worker` wraps its generation step with `SimulatedLatency.around` when the config asks for it;
nothing else in the worker knows about simulation.
"""

from __future__ import annotations

import math
import random
import threading
import time
from collections.abc import Callable
from typing import ParamSpec, TypeVar

from decentrl.config import SimulationConfig

P = ParamSpec("P")
R = TypeVar("R")


class SimulatedLatency:
    def __init__(self, *, median_s: float, sigma: float, slowdown: float, seed: str) -> None:
        self.median_s = median_s  # 0 = no injected delay
        self.sigma = sigma
        self.slowdown = slowdown  # >= 1; 10 = a worker ten times slower than the rest
        self._rng = random.Random(seed)
        self._rng_lock = threading.Lock()  # slots draw from one generator

    @classmethod
    def of(cls, config: SimulationConfig, worker_id: str) -> SimulatedLatency | None:
        """The latency `config` gives this worker; None when it adds nothing."""
        if not config.active_for(worker_id):
            return None
        return cls(
            median_s=config.latency_median_s, sigma=config.latency_sigma,
            slowdown=config.slowdowns.get(worker_id, 1.0), seed=f"{config.seed}/{worker_id}",
        )

    def extra_delay(self, generation_s: float) -> float:
        """Seconds to wait after a real generation that took `generation_s`."""
        with self._rng_lock:
            noise = self._rng.gauss(0.0, 1.0)
        tail = self.median_s * math.exp(self.sigma * noise) if self.median_s > 0 else 0.0
        return generation_s * (self.slowdown - 1.0) + self.slowdown * tail

    def around(self, generate: Callable[P, R]) -> Callable[P, R]:
        """`generate`, followed by the extra delay its own duration calls for."""

        def slowed(*args: P.args, **kwargs: P.kwargs) -> R:
            started = time.perf_counter()
            result = generate(*args, **kwargs)
            time.sleep(self.extra_delay(time.perf_counter() - started))
            return result

        return slowed
