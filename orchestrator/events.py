"""What the run's parts hand to the journal: one event per durable change, and the one lookup
they make of what was committed (a closed lease).

RunState (orchestrator/state.py) gives each part the run's journal as a `Journaling`; a part
records an event where it changes what a restart must find and knows nothing else of the
journal. orchestrator/journal.py turns each event into its statements and commits them, in the
order recorded, before the HTTP answer that follows.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple, Protocol

from decentrl.api.wire import Lease, Rollout


class LeaseGranted(NamedTuple):
    lease: Lease
    holder: str


class RolloutAccepted(NamedTuple):
    rollout: Rollout


class GroupCompleted(NamedTuple):
    lease_id: str
    ready_seq: int  # its place in line
    rewards: list[float]
    oldest_version: int
    at: float


class LeaseClosedAs(NamedTuple):
    lease_id: str
    status: str
    at: float
    drop_samples: bool  # its samples' bodies can go (it will never be trained on)


class LeaseRenewed(NamedTuple):
    lease_id: str
    deadline: float


class BatchServed(NamedTuple):
    request_id: str
    at: float
    body: dict[str, Any]


class BatchForgotten(NamedTuple):
    """An old batch can no longer be asked for again: its samples' bodies may go."""

    request_id: str
    lease_ids: list[str]


class LeaseForgotten(NamedTuple):
    lease_id: str


class ScoreTaken(NamedTuple):
    rollout_id: str
    lease_id: str
    result: str  # the ScoreResult as JSON


class StepTaken(NamedTuple):
    """A partial step of a sample still being generated (POST /v1/steps)."""

    lease_id: str
    rollout_id: str
    step: int
    data: bytes  # the PartialStep as msgpack


class VerdictTaken(NamedTuple):
    rollout_id: str
    step: int
    score: float
    seq: int


Event = (
    LeaseGranted | RolloutAccepted | GroupCompleted | LeaseClosedAs | LeaseRenewed | BatchServed | BatchForgotten
    | LeaseForgotten | ScoreTaken | StepTaken | VerdictTaken
)


# filled, node_closed: sub-leases of units of roles (orchestrator/roles.py), full, or closed with their unit.
ClosedStatus = Literal[
    "complete", "served", "expired", "released", "dropped", "superseded", "skipped", "filled", "node_closed"
]


@dataclass
class ClosedLease:
    """A closed lease, as the lease book (orchestrator/leases.py) remembers it and the journal returns it."""

    lease: Lease
    holder: str
    status: ClosedStatus
    closed_at: float
    samples: int  # samples it took
    # Their ids, where memory holds them (a lease recovered as complete leaves them on disk).
    rollout_ids: list[str] = field(default_factory=list)


class IntegrityChanges(NamedTuple):
    """What orchestrator/integrity.py changed since the last commit, written with it."""

    forgotten: list[str]  # leases whose content hashes go (first, so a digest may be kept again)
    kept: list[tuple[bytes, str, int]]  # (digest, lease_id, version) first kept
    workers: list[tuple[str, str]]  # (token name, record as JSON)


class Journaling(Protocol):
    """The journal as a part sees it (orchestrator/journal.py `Journal` or `NullJournal`)."""

    def record(self, event: Event) -> None: ...

    def closed_lease(self, lease_id: str) -> ClosedLease | None: ...
