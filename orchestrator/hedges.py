"""Hedging (deterministic runs): which lagging places of the next batch get a second lease, and when.

RunState (orchestrator/state.py) asks `pick` which places to copy when a worker asks for leases
(before any new place: the next batch is the one the trainer waits for), tells `completed` how
long each complete group's lease was out, and hands `due_in` to the lease long-poll
(orchestrator/handlers.py) so that an idle worker wakes when a hedge falls due. The copies are
leases like any other (LeaseBook.copy, orchestrator/leases.py); the first copy of a place to
complete fills it and the others are closed as `superseded` (LeaseBook.supersede), their holders
told in their next lease answer so that they stop generating them (LeaseBook.tell). Why this is
sound: in a deterministic run a place's prompt, version and per-sample seeds are fixed, so every
copy is the same group bit for bit (docs/reproducibility.md).

Policy (`[orchestrator.hedging]`, decentrl/config/orchestrator.py):
- only places of the next batch the trainer takes (places groups_served .. + groups_per_step),
  or of the next `batches` batches;
- a place is due once its newest open lease has been out `wait` (`hedge_wait`): the shortest
  time out after which the last RECENT complete groups that took at least that long went on, on
  average, for `after` times their median lease time or more - a copy is then expected to gain
  (no time rule before MIN_RECENT of them, nor while lease times have no such tail: a light tail
  gains nothing from copies); or at once when it is the last place of that batch not yet complete;
- at most `max_copies` open leases per place, each held by a different worker id: the copy is
  meant for another machine, and a worker never gets a second copy of a place it holds.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass

from decentrl.config import HedgingConfig
from orchestrator.leases import OpenLease

RECENT = 256  # complete groups whose lease times make the wait
MIN_RECENT = 8  # fewer complete groups than this: no wait yet, only the last place is hedged


@dataclass(frozen=True)
class Places:
    """Where the run's places stand (from LeaseBook and the counters), as hedging reads them."""

    open: Mapping[int, list[str]]  # place -> its open leases (LeaseBook.places)
    leases: Mapping[str, OpenLease]  # lease id -> open lease (LeaseBook.open)
    head: int  # the next place the trainer takes (groups served)
    cursor: int  # places below it have been leased at least once
    requeued: Collection[int]  # places waiting to be leased again


class Hedges:
    def __init__(self, *, config: HedgingConfig, groups_per_step: int, clock: Callable[[], float]) -> None:
        self.config = config
        self.groups_per_step = groups_per_step
        self.clock = clock
        self.recent: deque[float] = deque(maxlen=RECENT)
        self.wait: float | None = None  # time out after which a place is due a copy; None: no time rule

    def completed(self, lease_s: float) -> None:
        """A group completed `lease_s` seconds after its lease was granted."""
        self.recent.append(lease_s)
        if len(self.recent) >= MIN_RECENT:
            self.wait = hedge_wait(sorted(self.recent), self.config.after)

    def _due(self, holder: str | None, places: Places) -> list[tuple[float, int]]:
        """(when it falls due, place) of each place of the next batch that `holder` (None: any
        worker holding none of its copies) could copy."""
        head, end = places.head, places.head + self.groups_per_step
        hedged = [index for index in places.open if head <= index < head + self.config.batches * self.groups_per_step]
        head_open = [index for index in hedged if index < end]
        last = (
            len(head_open) == 1 and places.cursor >= end and not any(head <= index < end for index in places.requeued)
        )
        due = []
        for index in hedged:
            copies = [places.leases[lease_id] for lease_id in places.open[index]]
            if len(copies) >= self.config.max_copies or any(copy.holder == holder for copy in copies):
                continue
            if last and index < end:
                due.append((0.0, index))
            elif self.wait is not None:
                due.append((max(copy.granted_at for copy in copies) + self.wait, index))
        return due

    def pick(self, holder: str, count: int, places: Places) -> list[int]:
        """Up to `count` places due a copy now, for `holder`, lowest first."""
        now = self.clock()
        return sorted(index for at, index in self._due(holder, places) if at <= now)[:count]

    def due_in(self, holder: str | None, places: Places) -> float | None:
        """Seconds until the next place `holder` (None: any worker) could copy falls due; None if none will."""
        due = self._due(holder, places)
        return max(0.0, min(at for at, _ in due) - self.clock()) if due else None


def hedge_wait(times: list[float], after: float) -> float | None:
    """The shortest of `times` (recent lease times, sorted) after which the leases that took longer
    still had, on average, at least `after` x the median of `times` to go; None when none had.

    The mean residual life: a heavy tail (a log-normal's) grows it with the time out, so a lease
    out that long is likely a straggler and a fresh copy is expected to finish first; a light
    tail shrinks it, and copies would only take slots from new places. docs/benchmarks.md ("What the
    scheduling rules allow") compares it with fixed multiples of the median over tails."""
    threshold = after * statistics.median(times)
    found, longer, total = None, 0, 0.0
    for time_out in reversed(times):
        if longer and total / longer - time_out >= threshold:
            found = time_out
        longer, total = longer + 1, total + time_out
    return found
