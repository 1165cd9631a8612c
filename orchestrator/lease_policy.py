"""The lease policy, chosen once at start-up: free-running, or deterministic.

RunState (orchestrator/state.py) asks its policy at four points and reads as if there were one
kind of run: `copies(holder, count)` when a worker asks for leases (hedges of lagging places,
before any new place); `due_in(holder)` from the lease long-poll (how long an idle worker may
sleep before a copy falls due for it); `lost(rollout, holder)` at the dedupe stage of ingest (a
sample of a copy that lost its place: a duplicate, compared with the winner's); `filled(winner)`
when a group completes (its other copies close as superseded).

A free-running run has none of this. A deterministic run (docs/reproducibility.md) leases numbered
places, each with a fixed prompt, version and per-sample seeds, so every copy of a place is the
same group bit for bit on one machine type; a difference is counted (`hedge_mismatches`) and
logged, not a strike: other hardware rounds differently. The copies are leases like any other
(orchestrator/leases.py `copy`, `supersede`, `tell`).

Hedging (`[orchestrator.hedging]`, decentrl/config/orchestrator.py):
- only places of the next `batches` batches the trainer takes (from groups_consumed);
- a place is due once its newest open lease has been out `wait` (`hedge_wait`, from the last
  RECENT complete groups; none before MIN_RECENT of them, nor while lease times have no heavy
  tail), or at once when it is the last place of the next batch not yet complete;
- at most `max_copies` open leases per place, each held by a different worker id.
"""

from __future__ import annotations

import logging
import statistics
from collections import deque
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass

from decentrl.api.wire import Lease, Rollout
from decentrl.config import HedgingConfig, RunConfig
from orchestrator.codec import content_hash
from orchestrator.counters import Counters
from orchestrator.leases import LeaseBook, OpenLease

log = logging.getLogger("decentrl.orchestrator.hedges")

RECENT = 256  # complete groups whose lease times make the wait
MIN_RECENT = 8  # fewer complete groups than this: no wait yet, only the last place is hedged


@dataclass(frozen=True)
class Places:
    """Where the run's places stand, as hedging reads them."""

    open: Mapping[int, list[str]]  # place -> its open leases (LeaseBook.places)
    leases: Mapping[str, OpenLease]  # lease id -> open lease (LeaseBook.open)
    head: int  # the next place the trainer takes (groups consumed)
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
        last = (  # one place of the next batch is still out, and none waits to be leased again
            sum(index < end for index in hedged) == 1 and places.cursor >= end
            and not any(head <= index < end for index in places.requeued)
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

    The mean residual life: a heavy tail grows it with the time out, so a lease out that long is
    likely a straggler and a fresh copy is expected to finish first; a light tail shrinks it, and
    copies would only take slots from new places (docs/benchmarks.md, "What the scheduling rules allow")."""
    threshold = after * statistics.median(times)
    found, longer, total = None, 0, 0.0
    for time_out in reversed(times):
        if longer and total / longer - time_out >= threshold:
            found = time_out
        longer, total = longer + 1, total + time_out
    return found


class FreeRunning:
    """Prompts leased in any order, one lease each: nothing to copy, nothing lost."""

    hedges = None

    def copies(self, holder: str, count: int) -> list[Lease]:
        return []

    def due_in(self, holder: str | None) -> float | None:
        return None

    def lost(self, rollout: Rollout, holder: str) -> bool:
        return False

    def filled(self, winner: OpenLease) -> None:
        pass


class Deterministic:
    """Numbered places, each filled by the first of its copies to complete; hedged when enabled."""

    def __init__(self, *, config: RunConfig, lease_book: LeaseBook, counters: Counters, clock: Callable[[], float]) -> None:
        self.lease_book = lease_book
        self.counters = counters
        self.clock = clock
        hedging = config.orchestrator.hedging
        self.hedges = (
            Hedges(config=hedging, groups_per_step=config.places_per_step, clock=clock) if hedging.enabled else None
        )

    def copies(self, holder: str, count: int) -> list[Lease]:
        if self.hedges is None:
            return []
        copies = [self.lease_book.copy(index, holder) for index in self.hedges.pick(holder, count, self._places())]
        self.counters.hedged_leases += len(copies)
        return copies

    def due_in(self, holder: str | None) -> float | None:
        return self.hedges.due_in(holder, self._places()) if self.hedges is not None else None

    def _places(self) -> Places:
        book = self.lease_book
        return Places(
            open=book.places, leases=book.open, head=self.counters.groups_consumed, cursor=book.prompts.cursor,
            requeued=book.prompts.requeued,
        )

    def filled(self, winner: OpenLease) -> None:
        """The winner's place is complete; its other copies lose, their samples compared with the winner's."""
        if self.hedges is not None:
            self.hedges.completed(self.clock() - winner.granted_at)
        index = winner.lease.index
        assert index is not None, "a deterministic run's leases are numbered places"
        copies = self.lease_book.places.get(index)
        if not copies:
            return
        hashes = [content_hash(sample) for sample in sorted(winner.samples, key=lambda sample: sample.sample_index or 0)]
        for lease_id in copies:
            for sample in self.lease_book.open[lease_id].samples:
                self._compare(sample, hashes)
        self.lease_book.supersede(index, hashes)

    def lost(self, rollout: Rollout, holder: str) -> bool:
        """Whether `rollout` belongs to `holder`'s copy that lost its place (a duplicate, counted)."""
        if not self.lease_book.lost_copy(rollout.lease_id, holder):
            return False
        self.counters.hedge_duplicates += 1
        self._compare(rollout, self.lease_book.winners.get(rollout.lease_id))
        return True

    def _compare(self, sample: Rollout, winner: list[bytes] | None) -> None:
        """A sample of a losing copy against the winner's sample of the same index (the winner is
        forgotten after a restart)."""
        if winner is None or sample.sample_index is None or sample.sample_index >= len(winner):
            return
        if content_hash(sample) != winner[sample.sample_index]:
            self.counters.hedge_mismatches += 1
            log.warning(
                "hedge: sample %d of lease %s (%s) differs from the copy that filled its place",
                sample.sample_index, sample.lease_id, sample.worker_id,
            )
