"""Bounded history of a run for the dashboard: time series, trainer steps, versions, samples.

RunState holds only the counters' current values; `History` keeps each series in a ring buffer of
fixed length, and `workers` is keyed by token name, never by a worker id a client picks, so memory
stays bounded however long the run. Not journaled: after a restart the curves start again.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from decentrl.api.wire import IngestResponse, RolloutBatch, StatusResponse, TrainBatch, TrainSample, WorkerMachine

POINTS_KEPT = 3600  # one an hour at one a second
STEPS_KEPT = 5000
VERSIONS_KEPT = 1000
SAMPLES_KEPT = 16
SAMPLE_INTERVAL_S = 1.0
RATE_WINDOW = 60  # samples: tokens/s per worker is measured over the last minute


@dataclass
class WorkerActivity:
    """What the orchestrator saw of one token's posts (the integrity record holds the rest)."""

    accepted: int = 0
    rejections: Counter[str] = field(default_factory=Counter)
    completion_tokens: int = 0
    newest_version: int = -1
    last_seen: float = 0.0
    # (time, completion_tokens) at each of the last RATE_WINDOW samples.
    marks: deque[tuple[float, int]] = field(default_factory=lambda: deque(maxlen=RATE_WINDOW + 1))


@dataclass(frozen=True)
class ShownSample:
    """One completion served to the trainer; decoded only when a page asks."""

    time: float
    policy_version: int
    trainer_version: int
    reward: float
    advantage: float
    prompt_token_ids: list[int]
    completion_token_ids: list[int]


@dataclass
class VersionEvent:
    version: int
    announced: float
    first_rollout: float | None = None


@dataclass
class History:
    clock: Callable[[], float] = time.time  # a field so that tests can pass a fake
    # The run's counters, one point a second (rates are differences of consecutive points, taken by the page).
    points: deque[dict[str, float]] = field(default_factory=lambda: deque(maxlen=POINTS_KEPT))
    steps: deque[dict[str, float]] = field(default_factory=lambda: deque(maxlen=STEPS_KEPT))  # as the trainer posts them
    # When each version was announced and when its first rollout came back.
    versions: deque[VersionEvent] = field(default_factory=lambda: deque(maxlen=VERSIONS_KEPT))
    samples: deque[ShownSample] = field(default_factory=lambda: deque(maxlen=SAMPLES_KEPT))  # a few served recently
    workers: dict[str, WorkerActivity] = field(default_factory=dict)
    machines: dict[str, WorkerMachine] = field(default_factory=dict)  # token name -> its worker's last account
    staleness: Counter[int] = field(default_factory=Counter)  # samples served, by staleness

    # -- fed by the handlers --------------------------------------------------------------

    def sample(self, status: StatusResponse, inflight: int) -> None:
        """Record the run's counters now (rates and fractions are computed by the reader)."""
        self.points.append({
            "t": self.clock(),
            "rollouts_accepted": status.rollouts_accepted,
            "rejected": sum(status.rollouts_rejected.values()),
            "stale_dropped": status.stale_dropped,
            "signal_dropped": status.dropped.get("zero_signal", 0) + status.dropped.get("surplus", 0),
            "groups_served": status.groups_served,
            "groups_ready": status.groups_ready,
            "leases_active": status.leases_active,
            "policy_version": -1 if status.policy_version is None else status.policy_version,
            "trainer_version": status.trainer_version,
            "reward_mean_recent": status.reward_mean_recent if status.reward_mean_recent is not None else float("nan"),
            "inflight": inflight,
        })
        for activity in self.workers.values():
            activity.marks.append((self.points[-1]["t"], activity.completion_tokens))

    def posted(self, token_name: str, batch: RolloutBatch, result: IngestResponse) -> None:
        """A worker's post was answered: what it got accepted, and rejected by reason."""
        now = self.clock()
        if (activity := self.workers.get(token_name)) is None:
            activity = self.workers[token_name] = WorkerActivity()
            activity.marks.append((now, 0))  # its rate counts from its first post
        activity.last_seen = now
        activity.accepted += result.accepted
        activity.rejections.update(rejection.reason for rejection in result.rejected)
        rejected_ids = {rejection.rollout_id for rejection in result.rejected}
        activity.completion_tokens += sum(len(r.completion_token_ids) for r in batch.rollouts if r.rollout_id not in rejected_ids)
        newest = max((rollout.policy_version for rollout in batch.rollouts), default=-1)
        activity.newest_version = max(activity.newest_version, newest)
        # The first rollout of a version newer than any seen: the workers have it.
        for event in reversed(self.versions):
            if event.version <= newest:
                if event.first_rollout is not None:
                    break
                event.first_rollout = now

    def asked(self, token_name: str, machine: WorkerMachine | None) -> None:
        """A worker's lease request said what it computes on (/v1/status shows it per token)."""
        if machine is not None:
            self.machines[token_name] = machine

    def served(self, batch: TrainBatch) -> None:
        """A batch went to the trainer: its staleness, and one completion of each of its first groups."""
        self.staleness.update({int(lag): count for lag, count in batch.staleness_histogram.items()})
        firsts: dict[str | None, TrainSample] = {}  # each group's first sample, in the batch's order
        for sample in batch.samples:
            firsts.setdefault(sample.group_id, sample)
        now = self.clock()
        for sample in list(firsts.values())[:4]:  # a few per batch: the newest batches' samples are what a reader wants
            self.samples.append(ShownSample(
                now, sample.policy_version, batch.trainer_version, sample.reward, sample.advantage,
                list(sample.prompt_token_ids), list(sample.completion_token_ids),
            ))

    def announced(self, version: int) -> None:
        if self.versions and self.versions[-1].version >= version:
            return  # announced again (a trainer restart re-announces its newest version)
        self.versions.append(VersionEvent(version, self.clock()))

    def trainer_step(self, step: int, metrics: dict[str, float]) -> None:
        while self.steps and self.steps[-1]["step"] >= step:  # a resumed trainer trains steps again: keep the new ones
            self.steps.pop()
        self.steps.append({"step": step, "t": self.clock(), **metrics})

    # -- read by the dashboard ------------------------------------------------------------

    def token_rate(self, token_name: str) -> float | None:
        """Completion tokens a second accepted from `token_name`'s posts over the last minute."""
        activity = self.workers.get(token_name)
        if activity is None or len(activity.marks) < 2:
            return None
        (t0, n0), (t1, n1) = activity.marks[0], activity.marks[-1]
        return (n1 - n0) / (t1 - t0) if t1 > t0 else None
