"""`[simulation]`: benchmarks only - make the toy task's millisecond generations look like real ones,
and a CPU worker's routers drift like a real inference engine's.

A production run leaves this section out. benchmarks/async_vs_sync.py sets the delays to measure
scheduling (asynchronous vs synchronous, a straggler) with the real system; workers/simulation.py
applies them around a worker's generation step. `router_noise` (configs/moe.toml,
benchmarks/routing_replay.py) is applied by the hf backend's generation (workers/simulation.py
`noisy_routers`).
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from decentrl.config.base import Section


class SimulationConfig(Section):
    """Hold each finished lease request back by an injected delay - a log-normal tail, plus a time
    per completion token when `latency_per_token_s` asks for one - and scale some workers'
    generation time; the delay is a sleep, standing for work on the worker's own GPU."""

    latency_median_s: float = Field(
        0.0, ge=0, description="Median of the delay added to every lease request's generation (0 = none)."
    )
    latency_sigma: float = Field(
        1.0, ge=0, le=4, description="Shape of the log-normal delay (1.0: p90 = 3.6x median, p99 = 10x)."
    )
    latency_per_token_s: float = Field(
        0.0, ge=0, le=10,
        description="Seconds added to a lease request's delay per completion token it produced (summed over its "
        "samples), so a request that writes more finishes later, as a real reasoning trace does; the toy task's own "
        "generation time hardly grows with length. 0 = the delay does not depend on length.",
    )
    slowdowns: dict[str, Annotated[float, Field(ge=1)]] = Field(
        default_factory=dict,
        description="Per worker id, a factor >= 1 on its generation time and delay (others: 1), "
        "e.g. { worker-0 = 10.0 } for one straggler among `decentrl run`'s workers.",
    )
    seed: int = Field(0, ge=0, description="Seed of the delays; each worker mixes in its id.")
    router_noise: float = Field(
        0.0, ge=0, le=10,
        description="Std of Gaussian noise on the hf worker's MoE router logits when choosing the top-k experts "
        "(gate weights from the clean logits): an inference engine's flipped routing decisions, reproduced on "
        "CPU (docs/routing.md). 0 = none.",
    )

    def active_for(self, worker_id: str) -> bool:
        return self.latency_median_s > 0 or self.latency_per_token_s > 0 or self.slowdowns.get(worker_id, 1.0) > 1.0
