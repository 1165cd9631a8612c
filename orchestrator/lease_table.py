"""The one lease table: open leases by id, their deadlines, renewal, expiry and the owner check.

Prompt leases (LeaseBook.open) and score leases (ScoreQueue.leases) are each one `LeaseTable`;
what a lease holds and what closing it means stay with them. `overdue` hands each lease past its
deadline (`timeout_s` after its grant or last renewal) out once, for its owner to close.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import Protocol, TypeVar


class LeaseError(Exception):
    """A lease operation that cannot be done; `status` is the HTTP status to answer with."""

    status = 409


class LeaseNotFound(LeaseError):
    status = 404


class NotLeaseHolder(LeaseError):
    status = 403


class LeaseClosed(LeaseError):
    status = 409


class Held(Protocol):
    holder: str


class Open(Held, Protocol):
    deadline: float


E = TypeVar("E", bound=Open)
C = TypeVar("C", bound=Held)


class LeaseTable(dict[str, E]):
    """Open leases by id. `what` names one in errors ("lease", "score lease"), `others` who else
    holds such leases ("worker", "scorer"), `missing` why one may be unknown."""

    def __init__(self, *, timeout_s: float, clock: Callable[[], float], what: str, others: str, missing: str) -> None:
        super().__init__()
        self.timeout_s = timeout_s
        self.clock = clock
        self.what, self.others, self.missing = what, others, missing
        # (deadline, lease id); the entries of a lease renewed or closed since are skipped when they come up.
        self._heap: list[tuple[float, str]] = []

    def deadline(self) -> float:
        return self.clock() + self.timeout_s

    def add(self, lease_id: str, entry: E) -> None:
        self[lease_id] = entry
        heapq.heappush(self._heap, (entry.deadline, lease_id))

    def renew(self, lease_id: str) -> None:
        self[lease_id].deadline = self.deadline()
        self.add(lease_id, self[lease_id])

    def overdue(self) -> list[str]:
        """The open leases whose deadline passed, oldest first, each once."""
        now, due = self.clock(), {}
        while self._heap and self._heap[0][0] < now:
            deadline, lease_id = heapq.heappop(self._heap)
            entry = self.get(lease_id)
            if entry is not None and entry.deadline == deadline:
                due[lease_id] = None  # a lease renewed to the same deadline has two entries
        return list(due)

    def owned(self, lease_id: str, holder: str, closed: C | None = None) -> E | C:
        """The open lease `lease_id`, else `closed` (the owner's record of it), if `holder` holds it."""
        found = self.get(lease_id) or closed
        if found is None:
            raise LeaseNotFound(f"no {self.what} {lease_id!r}: {self.missing}")
        if found.holder != holder:
            raise NotLeaseHolder(f"{self.what} {lease_id!r} is held by another {self.others}")
        return found
