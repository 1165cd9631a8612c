"""Simulated generation latency and router noise ([simulation], benchmarks only; docs/workers.md).

`SimulatedLatency.around` wraps the worker's generation step with an extra wait (no CPU, so slots
overlap their delays as real requests would) that ends early once every lease of the step lost to
another copy. `noisy_routers` perturbs an MoE model's router logits in the hf backend, as a real
engine's numerics do (docs/routing.md). Nothing else in the worker knows about simulation.
"""

from __future__ import annotations

import math
import random
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, ParamSpec

from decentrl.config import SimulationConfig

if TYPE_CHECKING:
    import torch

    from workers.sample import Sample

P = ParamSpec("P")


class SimulatedLatency:
    def __init__(self, *, median_s: float, sigma: float, slowdown: float, seed: str, per_token_s: float = 0.0) -> None:
        self.median_s = median_s  # 0 = no log-normal part
        self.sigma = sigma
        self.per_token_s = per_token_s  # 0 = the delay does not depend on the request's length
        self.slowdown = slowdown  # >= 1; 10 = a worker ten times slower than the rest
        self._rng = random.Random(seed)  # slots draw from one generator, under `woken` (`around`)

    @classmethod
    def of(cls, config: SimulationConfig, worker_id: str) -> SimulatedLatency | None:
        """The latency `config` gives this worker; None when it adds nothing."""
        if not config.active_for(worker_id):
            return None
        return cls(
            median_s=config.latency_median_s, sigma=config.latency_sigma, per_token_s=config.latency_per_token_s,
            slowdown=config.slowdowns.get(worker_id, 1.0), seed=f"{config.seed}/{worker_id}",
        )

    def extra_delay(self, generation_s: float, tokens: int = 0) -> float:
        tail = self.median_s * math.exp(self.sigma * self._rng.gauss(0.0, 1.0)) if self.median_s > 0 else 0.0
        return generation_s * (self.slowdown - 1.0) + self.slowdown * (tail + self.per_token_s * tokens)

    def around(
        self, generate: Callable[P, list[Sample]], *, abandoned: Callable[P, bool], woken: threading.Condition
    ) -> Callable[P, list[Sample]]:
        """`generate`, followed by its extra delay, which ends early once `abandoned` (called with
        the same arguments) holds, checked whenever `woken` is notified."""

        def slowed(*args: P.args, **kwargs: P.kwargs) -> list[Sample]:
            started = time.perf_counter()
            samples = generate(*args, **kwargs)
            tokens = sum(len(sample.token_ids) for sample in samples)
            with woken:
                delay = self.extra_delay(time.perf_counter() - started, tokens)
                woken.wait_for(lambda: abandoned(*args, **kwargs), timeout=delay)
            return samples

        return slowed


@contextmanager
def noisy_routers(model: torch.nn.Module, std: float, generator: torch.Generator) -> Iterator[None]:
    """Within the block, every router of `model` picks its top-k experts by its logits plus N(0, std)
    noise, with gate weights from the clean logits (renormalized where the architecture does).
    Hooked before a RouteRecorder, the recorder sees the noisy choice. std 0: no hooks."""
    from decentrl.model.routers import routers

    def noisy(renormalize: bool) -> Callable[..., tuple[torch.Tensor, ...]]:
        def hook(module: torch.nn.Module, args: object, output: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
            import torch

            logits, weights, own = output  # (N, E), (N, K), (N, K)
            noise = torch.randn(logits.shape, generator=generator, device=generator.device)
            chosen = (logits.float() + std * noise).topk(own.shape[-1], dim=-1).indices  # (N, K)
            gates = logits.float().softmax(dim=-1).gather(-1, chosen)  # (N, K)
            if renormalize:
                gates = gates / gates.sum(dim=-1, keepdim=True)
            return logits, gates.to(weights.dtype), chosen

        return hook

    handles = [router.register_forward_hook(noisy(renorm)) for router, renorm in routers(model)] if std > 0 else []
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
