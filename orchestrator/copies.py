"""A place's copies at ingest (deterministic runs): the first to complete fills the place, the
others lose, and every sample of a losing copy is compared with the winner's.

RunState (orchestrator/state.py) calls `filled` when a group of a numbered place completes (the
`score` stage of ingest) and `lost` at the dedupe stage, for a sample of a copy already closed as
superseded. Which places get a copy, and when, is hedges.py; the copies are leases like any other,
closed and remembered by LeaseBook (`supersede`, `winners`, `lost_copy`: orchestrator/leases.py).
Both honest copies of a place are bit for bit the same on one machine type; a difference is
counted (`hedge_mismatches`) and logged, not a strike: other hardware rounds differently
(docs/reproducibility.md).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from decentrl.api.wire import Rollout
from orchestrator.counters import Counters
from orchestrator.hedges import Hedges
from orchestrator.integrity import content_hash
from orchestrator.leases import LeaseBook, OpenLease

log = logging.getLogger("decentrl.orchestrator.hedges")


class Copies:
    def __init__(
        self, *, lease_book: LeaseBook, hedges: Hedges | None, counters: Counters, clock: Callable[[], float]
    ) -> None:
        self.lease_book = lease_book
        self.hedges = hedges  # None when hedging is off: places still fill, there are no copies
        self.counters = counters
        self.clock = clock

    def filled(self, index: int, winner: OpenLease) -> None:
        """Place `index` is complete; its other copies lose, their samples so far compared with
        the winner's."""
        if self.hedges is not None:
            self.hedges.completed(self.clock() - winner.granted_at)
        copies = self.lease_book.places.get(index)
        if not copies:
            return
        hashes = [content_hash(sample) for sample in sorted(winner.samples, key=lambda sample: sample.sample_index or 0)]
        for lease_id in copies:
            for sample in self.lease_book.open[lease_id].samples:
                self._compare(sample, hashes)
        self.lease_book.supersede(index, hashes)

    def lost(self, rollout: Rollout, holder: str) -> bool:
        """Whether `rollout` belongs to `holder`'s copy that lost its place: a duplicate, counted
        and compared with the winner."""
        if not self.lease_book.lost_copy(rollout.lease_id, holder):
            return False
        self.counters.hedge_duplicates += 1
        self._compare(rollout, self.lease_book.winners.get(rollout.lease_id))
        return True

    def _compare(self, sample: Rollout, winner: list[bytes] | None) -> None:
        """A sample of a losing copy against the winner's sample of the same index."""
        if winner is None or sample.sample_index is None or sample.sample_index >= len(winner):
            return  # the winner is forgotten (a restart), or the sample names no valid index
        if content_hash(sample) != winner[sample.sample_index]:
            self.counters.hedge_mismatches += 1
            log.warning(
                "hedge: sample %d of lease %s (%s) differs from the copy that filled its place",
                sample.sample_index, sample.lease_id, sample.worker_id,
            )
