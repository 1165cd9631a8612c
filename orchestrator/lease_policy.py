"""The lease policy, chosen once at start-up: free-running, or deterministic.

The lease book asks it what a new lease is of and tells it of every lease held, closed and
forgotten (`LeasePolicy`); RunState asks it for hedged `copies`, `due_in`, `lost`, `filled` and
`tell`. Invariants: a place goes back in line, lowest first, only once its last copy closes without
training; the lease budget counts places, not copies; `untold` is in memory only, at most
MAX_SUPERSEDED a holder. Places, copies and hedging: docs/reproducibility.md.
"""

from __future__ import annotations

import bisect
import logging
import statistics
from collections import deque
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass

from decentrl.api.wire import MAX_SUPERSEDED, Lease, Rollout
from decentrl.config import HedgingConfig, RunConfig
from decentrl.rl.determinism import required_version
from orchestrator.leases import ClosedLease, OpenLease, PromptQueue, Requeue

log = logging.getLogger("decentrl.orchestrator.hedges")

RECENT = 256  # complete groups whose lease times make the wait
MIN_RECENT = 8  # fewer complete groups than this: no wait yet, only the last place is hedged
# Closed with one of these, a place is leased again (superseded: filled; skipped: consumed).
REFILLED: frozenset[str] = frozenset({"expired", "released", "dropped"})


@dataclass(frozen=True)
class Places:
    """Where the run's places stand, as hedging reads them."""

    open: Mapping[int, Mapping[str, OpenLease]]  # place -> its open leases (copies) by id
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
            copies = places.open[index].values()
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
    still had, on average, at least `after` x the median of `times` to go; None when none had: the
    mean residual life, growing with the time out only under a heavy tail (docs/benchmarks.md)."""
    threshold = after * statistics.median(times)
    found, longer, total = None, 0, 0.0
    for time_out in reversed(times):
        if longer and total / longer - time_out >= threshold:
            found = time_out
        longer, total = longer + 1, total + time_out
    return found


class OneNode:
    """A policy whose units are one node each (a plain group, a tree of branches its holder
    generates): no node to derive, no sub-lease to grant, close with its unit or close short
    (orchestrator/roles.py's policy has them)."""

    def subs_of(self, closed: ClosedLease) -> list[str]:
        return []

    def make_nodes(self, open_leases: Mapping[str, OpenLease]) -> list[str]:
        return []

    def sub_leases(self, holder: str, count: int, open_leases: Mapping[str, OpenLease]) -> list[Lease]:
        return []

    def short(self, open_leases: Mapping[str, OpenLease]) -> list[str]:
        return []


class FreeRunning(OneNode):
    """Prompts leased in the prompt queue's order, one lease each: nothing to copy, nothing lost."""

    hedges = None

    def __init__(self, *, prompts: PromptQueue) -> None:
        self.prompts = prompts
        self.untold: dict[str, dict[str, None]] = {}  # never told anything

    def next(self) -> tuple[int, None, None]:
        queue = self.prompts
        prompt_id = queue.requeued.popleft() if queue.requeued else queue.prompt_at(queue.next_index())
        return prompt_id, None, None

    def leased(self, open_leases: int) -> int:
        return open_leases

    def held(self, open_lease: OpenLease) -> None:
        pass

    def closed(self, closed: ClosedLease, requeue: Requeue | None) -> None:
        if requeue == "front":
            self.prompts.requeued.appendleft(closed.lease.prompt_id)
        elif requeue == "back":
            self.prompts.requeued.append(closed.lease.prompt_id)

    def forgotten(self, closed: ClosedLease) -> None:
        pass

    def copies(self, holder: str, count: int, head: int) -> list[Lease]:
        return []

    def due_in(self, holder: str | None, head: int) -> float | None:
        return None

    def lost(self, rollout: Rollout, holder: str, closed_lease: Callable[[str], ClosedLease | None]) -> int | None:
        return None

    def filled(self, winner: OpenLease) -> tuple[list[str], int]:
        return [], 0

    def tell(self, holder: str) -> list[str]:
        return []


class Deterministic(OneNode):
    """Numbered places, each filled by the first of its copies to complete; hedged when enabled."""

    def __init__(
        self, *, config: RunConfig, prompts: PromptQueue, clock: Callable[[], float], digest: Callable[[Rollout], bytes]
    ) -> None:
        """`digest`: a sample's content hash (orchestrator/integrity.py `content_hash`)."""
        self.config = config
        self.digest = digest
        self.prompts = prompts  # its order numbers the places; `requeued` holds places, lowest first
        self.clock = clock
        hedging = config.orchestrator.hedging
        self.hedges = (
            Hedges(config=hedging, groups_per_step=config.places_per_step, clock=clock) if hedging.enabled else None
        )
        self.places: dict[int, dict[str, OpenLease]] = {}  # place -> its open leases (copies) by id, oldest first
        # A superseded lease -> the filling copy's content hashes by sample index (not journaled).
        self.winners: dict[str, list[bytes]] = {}
        # Holder -> its superseded leases it has not been told of yet, oldest first (an ordered set).
        self.untold: dict[str, dict[str, None]] = {}

    # -- the lease book's seam (orchestrator/leases.py `LeasePolicy`) ----------------------------

    def next(self) -> tuple[int, int, int]:
        """The next place (the lowest to lease again first), its prompt and its version (published:
        the budget holds back a worker asking early)."""
        queue = self.prompts
        index = queue.requeued.popleft() if queue.requeued else queue.next_index()
        version = required_version(index, groups_per_step=self.config.places_per_step, max_staleness=self.config.max_staleness)
        return queue.prompt_at(index), index, version

    def leased(self, open_leases: int) -> int:
        return len(self.places)  # copies of a place count once

    def held(self, open_lease: OpenLease) -> None:
        self.places.setdefault(self._place(open_lease.lease), {})[open_lease.lease.lease_id] = open_lease

    def closed(self, closed: ClosedLease, requeue: Requeue | None) -> None:
        """Its place goes back in line once its last copy closes untrained (whatever `requeue`)."""
        index = self._place(closed.lease)
        copies = self.places.get(index, {})
        copies.pop(closed.lease.lease_id, None)
        if copies:
            return
        self.places.pop(index, None)
        if closed.status in REFILLED:
            bisect.insort(self.prompts.requeued, index)

    def forgotten(self, closed: ClosedLease) -> None:
        self.winners.pop(closed.lease.lease_id, None)
        self._told_needless(closed.lease.lease_id, closed.holder)

    @staticmethod
    def _place(lease: Lease) -> int:
        assert lease.index is not None, "a deterministic run's leases are numbered places"
        return lease.index

    # -- what RunState asks -------------------------------------------------------------------

    def copies(self, holder: str, count: int, head: int) -> list[Lease]:
        """Up to `count` places due a copy for `holder` (`head`: the groups consumed): the lease of
        each to grant it again, the same group bit for bit."""
        if self.hedges is None:
            return []
        return [next(iter(self.places[index].values())).lease for index in self.hedges.pick(holder, count, self._view(head))]

    def due_in(self, holder: str | None, head: int) -> float | None:
        return self.hedges.due_in(holder, self._view(head)) if self.hedges is not None else None

    def _view(self, head: int) -> Places:
        return Places(open=self.places, head=head, cursor=self.prompts.cursor, requeued=self.prompts.requeued)

    def filled(self, winner: OpenLease) -> tuple[list[str], int]:
        """The winner's place is complete: the ids of its other open copies (for RunState to close
        as superseded), and how many of their samples differ from the winner's."""
        if self.hedges is not None:
            self.hedges.completed(self.clock() - winner.granted_at)
        losers = list(self.places.get(self._place(winner.lease), {}).values())
        if not losers:
            return [], 0
        hashes = [self.digest(sample) for sample in sorted(winner.samples, key=lambda sample: sample.sample_index or 0)]
        mismatches = sum(self._differs(sample, hashes) for loser in losers for sample in loser.samples)
        for loser in losers:
            lease_id = loser.lease.lease_id
            self.winners[lease_id] = hashes
            lost = self.untold.setdefault(loser.holder, {})
            lost[lease_id] = None
            if len(lost) > MAX_SUPERSEDED:  # a holder that never asks again: its oldest news goes
                del lost[next(iter(lost))]
        return [loser.lease.lease_id for loser in losers], mismatches

    def lost(self, rollout: Rollout, holder: str, closed_lease: Callable[[str], ClosedLease | None]) -> int | None:
        """None unless `rollout` is of `holder`'s copy that lost its place (a duplicate, never a
        strike; `closed_lease` looks its lease up); else 1 if it differs from the winner's sample of
        its index, 0 if not. Posting it, its holder has finished it: it is not told of it."""
        closed = closed_lease(rollout.lease_id)
        if closed is None or closed.status != "superseded" or closed.holder != holder:
            return None
        self._told_needless(rollout.lease_id, holder)
        return self._differs(rollout, self.winners.get(rollout.lease_id))

    def tell(self, holder: str) -> list[str]:
        """The superseded leases of `holder` not told yet, for its lease answer (told once)."""
        return list(self.untold.pop(holder, None) or ())

    def _told_needless(self, lease_id: str, holder: str) -> None:
        """`holder` no longer holds `lease_id` (it posted it, or the lease is forgotten)."""
        lost = self.untold.get(holder)
        if lost is not None:
            lost.pop(lease_id, None)
            if not lost:
                del self.untold[holder]

    def _differs(self, sample: Rollout, winner: list[bytes] | None) -> bool:
        """Whether a losing copy's sample differs from the winner's (unknown after a restart)."""
        if winner is None or sample.sample_index is None or sample.sample_index >= len(winner):
            return False
        if self.digest(sample) == winner[sample.sample_index]:
            return False
        log.warning(
            "hedge: sample %d of lease %s (%s) differs from the copy that filled its place",
            sample.sample_index, sample.lease_id, sample.worker_id,
        )
        return True
