"""What a deterministic run's fixed pipeline costs, from the scheduling rules alone: an event simulation.

`benchmarks/async_vs_sync.py --deterministic` measures the real system on this machine, where
the workers, the trainer and the orchestrator share 2 cores. This asks what the rules allow
before any overhead: the same pool and latency, the trainer computing `--step-s` a step, and
nothing else costing time. The rules are the real ones, imported: the lease budget
(decentrl/rl/staleness.py `lease_budget`), the version a place is sampled under
(decentrl/rl/determinism.py `required_version`) and the hedging policy (orchestrator/lease_policy.py
`Hedges`, `[orchestrator.hedging]`).

- Pool: `--workers` x `--slots` slots; a slot asks for one lease whenever it is free. A lease
  takes `--overhead-s` plus a log-normal delay (median `--latency-median-s`, shape
  `--latency-sigma`), drawn afresh for every lease, a hedge's copy included (as
  workers/simulation.py draws it per request).
- Free-running: a lease is sampled under the newest version; the trainer takes the first
  `groups_per_step` complete groups not stale, drops stale ones.
- Deterministic: place k is sampled under `required_version(k)`, batch s is exactly places
  s*G .. s*G+G-1; hedges as `Hedges.pick` chooses them (copies first, then new places, as
  RunState.grant_leases asks). Losers either keep their slot to the end of their own delay
  (a worker that learns only when it posts) or free it when the place is filled (`abandon`).
- The trainer: step s starts once its batch is there, computes `--step-s`, publishes version s+1
  at once. Busy fraction = steps x step_s / wall time, as the real trainer reports it.

Modes, per latency sigma (`--sigmas`) and staleness (`--staleness`): free-running;
deterministic unhedged; hedged at the config's defaults (losers abandoned, as workers do when
the lease answer tells them); wide hedging (`max_copies` 4, `batches` 2), with losers abandoned
and with losers keeping their slots. `--stream-groups N` adds free-running, hedged and wide
again with a trainer that does not wait for the whole batch: each N groups' forward and
backward start as soon as those groups are there, in batch order (a deterministic run's
gradients must add up in a fixed order), and only the optimizer's share of the step
(`--optimizer-fraction`) waits for the last group. The real trainer does not do this; it asks
whether it would pay.

    PYTHONPATH=. .venv/bin/python benchmarks/schedule_bound.py --seeds 4

Prints, as its last line, one JSON object: {"settings", "cases": [{"sigma", "max_staleness",
"busy": {mode: fraction}, "wall_s": {mode: s}, "slot_s_per_group": {mode: slot seconds spent per group
trained, copies and stale groups included: the generation work}, "leases_per_group": {mode: leases
granted per group trained, copies included: where every lease's generation costs CPU whether
or not its copy loses, as in async_vs_sync.py's workers, the CPU work}, "busy_gap": {mode: free - mode, a streamed mode against
free_running_streamed}}], "busy_gap_hedged", "busy_gap_wide"} (the last two for the first sigma and staleness given).
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import math
import random
import statistics
from dataclasses import dataclass, field

from decentrl.api.wire import Lease
from decentrl.config import HedgingConfig
from decentrl.rl.determinism import required_version
from decentrl.rl.staleness import lease_budget
from orchestrator.lease_policy import Hedges, Places
from orchestrator.leases import OpenLease

MODES: dict[str, dict] = {
    "free_running": {"deterministic": False},
    "deterministic_unhedged": {"deterministic": True, "hedging": None},
    "deterministic_hedged": {"deterministic": True, "hedging": HedgingConfig(), "abandon": True},
    "deterministic_wide": {"deterministic": True, "hedging": HedgingConfig(max_copies=4, batches=2), "abandon": True},
    "deterministic_wide_keep": {"deterministic": True, "hedging": HedgingConfig(max_copies=4, batches=2)},
}


@dataclass(frozen=True)
class Setting:
    workers: int
    slots: int
    groups_per_step: int
    steps: int
    step_s: float
    overhead_s: float
    latency_median_s: float
    latency_sigma: float
    max_staleness: int


@dataclass
class Copy:
    """A lease in flight: which slot holds it, for which place (deterministic) or version (free)."""

    slot: int
    holder: str
    place: int | None
    version: int
    granted_at: float
    lease_id: str = ""


@dataclass
class Simulation:
    setting: Setting
    seed: int
    deterministic: bool
    hedging: HedgingConfig | None = None
    abandon: bool = False
    stream: int = 0  # > 0: the trainer computes a step's groups `stream` at a time as they arrive (below)
    optimizer_fraction: float = 0.1  # of step_s, the part that needs the whole batch (clip, step, publish)
    now: float = 0.0
    events: list[tuple[float, int, str, object]] = field(default_factory=list)
    published: int = 0
    step: int = 0  # steps finished (the version published)
    served: int = 0  # groups handed to the trainer
    training: bool = False
    chunks_done: int = 0  # streaming: groups of the current step computed
    next_tick: float = math.inf
    slot_s: float = 0.0  # slot time spent on leases (a loser that stops: until told)
    leases: int = 0  # leases granted, copies included
    free_slots: list[int] = field(default_factory=list)
    flight: dict[str, Copy] = field(default_factory=dict)  # lease id -> copy
    buffer: list[int] = field(default_factory=list)  # free-running: versions of complete groups, in order
    cursor: int = 0  # deterministic: places leased at least once
    filled: set[int] = field(default_factory=set)  # complete places not yet trained on
    open_places: dict[int, dict[str, OpenLease]] = field(default_factory=dict)  # place -> its leases in flight (for Hedges)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self.ids = itertools.count()
        self.free_slots = list(range(self.setting.workers * self.setting.slots))
        self.hedges = (
            Hedges(config=self.hedging, groups_per_step=self.setting.groups_per_step, clock=lambda: self.now)
            if self.hedging is not None else None
        )

    def push(self, at: float, kind: str, payload: object = None) -> None:
        heapq.heappush(self.events, (at, next(self.ids), kind, payload))

    def lease_time(self) -> float:
        s = self.setting
        return s.overhead_s + s.latency_median_s * math.exp(s.latency_sigma * self.rng.gauss(0.0, 1.0))

    def holder(self, slot: int) -> str:
        return f"worker-{slot // self.setting.slots}"

    def committed(self) -> int:
        """Groups served, complete and waiting, or leased (a place once, whatever its copies)."""
        if self.deterministic:
            return self.served + len(self.filled) + len(self.open_places)
        return self.served + len(self.buffer) + len(self.flight)

    def budget(self) -> int:
        s = self.setting
        return lease_budget(self.published, s.max_staleness, s.groups_per_step, self.committed())

    def places(self) -> Places:
        return Places(open=self.open_places, head=self.served, cursor=self.cursor, requeued=())

    def start(self, slot: int, place: int | None, version: int) -> None:
        lease_id = f"l{next(self.ids)}"
        self.leases += 1
        copy = Copy(slot, self.holder(slot), place, version, self.now, lease_id)
        self.flight[lease_id] = copy
        if place is not None:
            lease = Lease(lease_id=lease_id, prompt_id=place, prompt_token_ids=[0], group_size=1, deadline=0.0)
            self.open_places.setdefault(place, {})[lease_id] = OpenLease(lease=lease, holder=copy.holder, granted_at=self.now)
        self.push(self.now + self.lease_time(), "done", lease_id)

    def dispatch(self) -> None:
        """Every free slot asks for one lease, workers in turn: a copy first, then a new place."""
        s = self.setting
        waiting = sorted(self.free_slots, key=lambda slot: (slot % s.slots, slot))  # interleave workers
        self.free_slots = []
        for slot in waiting:
            if self.hedges is not None and (picked := self.hedges.pick(self.holder(slot), 1, self.places())):
                self.start(slot, picked[0], self.flight[next(iter(self.open_places[picked[0]]))].version)
            elif self.budget() > 0:
                if self.deterministic:
                    place = self.cursor
                    self.cursor += 1
                    self.start(slot, place, required_version(place, groups_per_step=s.groups_per_step, max_staleness=s.max_staleness))
                else:
                    self.start(slot, None, self.published)
            else:
                self.free_slots.append(slot)
        holders = {self.holder(slot) for slot in self.free_slots}
        if self.hedges is not None and holders:  # wake when a copy falls due for an idle worker
            due = [d for h in holders if (d := self.hedges.due_in(h, self.places())) is not None]
            if due and (at := self.now + max(min(due), 1e-4)) < self.next_tick:
                self.next_tick = at
                self.push(at, "tick")

    def finish(self, lease_id: str) -> None:
        copy = self.flight.pop(lease_id, None)
        if copy is None:  # abandoned when its place was filled
            return
        self.free_slots.append(copy.slot)
        self.slot_s += self.now - copy.granted_at
        if copy.place is None:
            self.buffer.append(copy.version)
            return
        if lease_id not in self.open_places.get(copy.place, {}):  # a loser that kept its slot to the end of its delay
            return
        self.filled.add(copy.place)
        if self.hedges is not None:
            self.hedges.completed(self.now - copy.granted_at)
        for other in self.open_places.pop(copy.place):  # this copy and the losers: superseded
            if self.abandon and other != lease_id:
                loser = self.flight.pop(other)
                self.free_slots.append(loser.slot)
                self.slot_s += self.now - loser.granted_at

    def take(self, groups: int) -> bool:
        """The next `groups` groups for the trainer, if they are there: the next places in order
        (deterministic) or the first complete fresh groups (free-running)."""
        s = self.setting
        if self.deterministic:
            places = set(range(self.served, self.served + groups))
            if not places <= self.filled:
                return False
            self.filled -= places
        else:
            self.buffer = [v for v in self.buffer if self.step - v <= s.max_staleness]  # stale groups dropped
            if len(self.buffer) < groups:
                return False
            del self.buffer[:groups]
        self.served += groups
        return True

    def train(self) -> None:
        """Whole batches: step s starts once all of it is there. Streaming (`stream` > 0): the
        forward and backward of each `stream` groups start as soon as they are there, in order
        (a fixed summation order, so a deterministic run's gradient stays the same bits), and the
        optimizer's share of the step once the whole batch is computed."""
        s = self.setting
        if self.training or self.step >= s.steps:
            return
        if not self.stream:
            if self.take(s.groups_per_step):
                self.training = True
                self.push(self.now + s.step_s, "trained")
        elif self.chunks_done == s.groups_per_step:
            self.training = True
            self.push(self.now + s.step_s * self.optimizer_fraction, "trained")
        elif self.take(self.stream):
            self.training = True
            self.push(self.now + s.step_s * (1 - self.optimizer_fraction) * self.stream / s.groups_per_step, "computed")

    def run(self) -> dict[str, float]:
        self.dispatch()
        while self.step < self.setting.steps:
            self.now = self.events[0][0]
            while self.events and self.events[0][0] == self.now:  # everything due now, then decide
                _, _, kind, payload = heapq.heappop(self.events)
                if kind == "done":
                    self.finish(str(payload))
                elif kind == "computed":
                    self.training = False
                    self.chunks_done += self.stream
                elif kind == "trained":
                    self.training = False
                    self.chunks_done = 0
                    self.step += 1
                    self.published = self.step
                elif kind == "tick" and self.now >= self.next_tick:
                    self.next_tick = math.inf
            self.train()
            self.dispatch()
        s = self.setting
        groups = s.steps * s.groups_per_step
        return {
            "busy": s.steps * s.step_s / self.now, "wall_s": self.now,
            "slot_s_per_group": (self.slot_s + sum(self.now - c.granted_at for c in self.flight.values())) / groups,
            "leases_per_group": self.leases / groups,
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--slots", type=int, default=16, help="Lease slots per worker.")
    parser.add_argument("--groups-per-step", type=int, default=32)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--step-s", type=float, default=0.2, help="The trainer's compute per step.")
    parser.add_argument("--overhead-s", type=float, default=0.1, help="Added to every lease's delay (transfers, queueing).")
    parser.add_argument("--latency-median-s", type=float, default=0.2)
    parser.add_argument("--sigmas", default="1.0,0.5,0.25,0.0", help="Latency sigmas, a comma list.")
    parser.add_argument("--staleness", default="2,4", help="max_staleness values, a comma list.")
    parser.add_argument("--seeds", type=int, default=4, help="Runs per case; figures are means.")
    parser.add_argument(
        "--stream-groups", type=int, default=0,
        help="Also simulate a trainer that computes each N groups of a step as soon as they are there, in order "
        "(modes *_streamed, compared with free_running_streamed); 0: not. Must divide --groups-per-step.",
    )
    parser.add_argument(
        "--optimizer-fraction", type=float, default=0.1, help="Streaming: the share of --step-s that needs the whole batch."
    )
    args = parser.parse_args()
    if args.stream_groups < 0 or (args.stream_groups and args.groups_per_step % args.stream_groups):
        raise SystemExit(f"--stream-groups {args.stream_groups} must be 0 or divide --groups-per-step {args.groups_per_step}")
    modes = dict(MODES)
    if args.stream_groups:
        streamed = {"stream": args.stream_groups, "optimizer_fraction": args.optimizer_fraction}
        modes |= {
            f"{mode}_streamed": {**MODES[mode], **streamed} for mode in ("free_running", "deterministic_hedged", "deterministic_wide")
        }

    cases = []
    for sigma, staleness in itertools.product(
        [float(x) for x in args.sigmas.split(",")], [int(x) for x in args.staleness.split(",")]
    ):
        setting = Setting(
            workers=args.workers, slots=args.slots, groups_per_step=args.groups_per_step, steps=args.steps,
            step_s=args.step_s, overhead_s=args.overhead_s, latency_median_s=args.latency_median_s,
            latency_sigma=sigma, max_staleness=staleness,
        )
        busy, wall, work, leases = {}, {}, {}, {}
        for mode, options in modes.items():
            runs = [Simulation(setting, seed, **options).run() for seed in range(args.seeds)]
            busy[mode] = round(statistics.mean(r["busy"] for r in runs), 3)
            wall[mode] = round(statistics.mean(r["wall_s"] for r in runs), 2)
            work[mode] = round(statistics.mean(r["slot_s_per_group"] for r in runs), 3)
            leases[mode] = round(statistics.mean(r["leases_per_group"] for r in runs), 3)
        case = {
            "sigma": sigma, "max_staleness": staleness, "busy": busy, "wall_s": wall, "slot_s_per_group": work, "leases_per_group": leases,
            "busy_gap": {
                mode: round(busy["free_running_streamed" if mode.endswith("_streamed") else "free_running"] - b, 3)
                for mode, b in busy.items() if not mode.startswith("free_running")
            },
        }
        print(json.dumps(case), flush=True)
        cases.append(case)
    print(json.dumps({
        "settings": vars(args), "cases": cases,
        "busy_gap_hedged": cases[0]["busy_gap"]["deterministic_hedged"],
        "busy_gap_wide": cases[0]["busy_gap"]["deterministic_wide"],
    }))


if __name__ == "__main__":
    main()
