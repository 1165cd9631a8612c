"""The lease policy of units of roles (`[orchestrator.roles]`, co-evolution: issue 48).

A unit is one lease (docs/architecture.md, "The unit of work, widened"): its root node is the
proposer's one sample, of the lease's prompt; when that sample is in, the reward stage derives
the solver node from it (`RolesRewards.derive`: the proposal validated, its prompt rendered by the
orchestrator) and this policy holds it (`derived`), to be leased as sub-leases of
`sub_lease_size` samples: the unit's holder first (`holder_first_s`), then any worker, as each
asks (`sub_leases`), so one proposal's fan-out spreads over the workers that are free. A sub-lease
is an ordinary lease (renewed, expired, released; its samples' checks are a lease's) that names its
unit (`Lease.unit_id`) and node (`Lease.node`); its samples join the unit (`join`), and are
journaled under the unit's id. A sub-lease is not journaled: after a restart its holder's post is
refused `unknown_or_expired_lease`, and the node's missing samples are leased again.

Invariants: a unit counts once toward the lease budget (`leased`: sub-leases do not count); a
sub-lease that closes untrained gives its unfilled samples back to its node, never its prompt to
the prompt queue; a unit that closes closes its open sub-leases (`subs_of`, applied by
LeaseBook.close: `node_closed` when the unit trained, `dropped` when it did not); a node closes
short (`short`) once it holds `min_fill` samples and `close_after_s` has passed since it was made,
never waited for without bound.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from decentrl.api.wire import Lease, Rollout, RolloutNode
from decentrl.config import RolesConfig
from orchestrator.lease_policy import FreeRunning
from orchestrator.leases import SOLVER, ClosedLease, OpenLease, PromptQueue, Requeue

__all__ = ["SOLVER", "Derived", "Roles"]


@dataclass(frozen=True)
class Derived:
    """A derived node the reward stage made from a proposer's sample."""

    node: RolloutNode  # its id, parent {rollout_id, derived}, role
    prompt_token_ids: list[int]  # rendered by the orchestrator


@dataclass
class Node:
    """A unit's solver node while it is filled."""

    unit: Lease
    holder: str  # the unit's holder: offered the sub-leases first
    derived: Derived
    size: int
    made_at: float
    unleased: int  # samples in no open sub-lease yet
    posted: int = 0  # samples in
    subs: dict[str, int] = field(default_factory=dict)  # open sub-lease -> samples it may still post


class Roles(FreeRunning):
    """Prompts in the prompt queue's order, one unit each; solver nodes as sub-leases."""

    def __init__(self, *, prompts: PromptQueue, config: RolesConfig, clock: Callable[[], float]) -> None:
        super().__init__(prompts=prompts)
        self.config = config
        self.clock = clock
        self.nodes: dict[str, Node] = {}  # unit id -> its solver node, while the unit is open
        self.sub_of: dict[str, str] = {}  # open sub-lease id -> its unit's id
        self.closed_short = 0

    # -- the lease book's questions ------------------------------------------------------------

    def leased(self, open_leases: int) -> int:
        return open_leases - len(self.sub_of)

    def held(self, open_lease: OpenLease) -> None:
        lease = open_lease.lease
        if lease.unit_id is not None:
            self.sub_of[lease.lease_id] = lease.unit_id

    def closed(self, closed: ClosedLease, requeue: Requeue | None) -> None:
        lease = closed.lease
        unit_id = self.sub_of.pop(lease.lease_id, None)
        if unit_id is None:
            self.nodes.pop(lease.lease_id, None)
            super().closed(closed, requeue)  # a unit: its prompt back in line, if it is to go again
            return
        node = self.nodes.get(unit_id)
        left = node.subs.pop(lease.lease_id, 0) if node is not None else 0
        if node is not None and requeue is not None:
            node.unleased += left  # untrained: its unfilled samples go out again, not its prompt

    def subs_of(self, closed: ClosedLease) -> list[str]:
        """The open sub-leases of a unit that just closed (none for a sub-lease)."""
        return [sub for sub, unit_id in self.sub_of.items() if unit_id == closed.lease.lease_id]

    # -- the owner's questions -------------------------------------------------------------------

    def join(self, open_lease: OpenLease, open_leases: Mapping[str, OpenLease]) -> OpenLease:
        """The open lease a sample of `open_lease` joins: its unit's, for a sub-lease (open while it is)."""
        unit_id = open_lease.lease.unit_id
        if unit_id is None:
            return open_lease
        node = self.nodes[unit_id]
        node.subs[open_lease.lease.lease_id] -= 1
        node.posted += 1
        return open_leases[unit_id]

    def makes_node(self, unit: OpenLease, rollout: Rollout) -> bool:
        """Whether `rollout` completes a unit's root node (its proposer's sample): the solver node is derived next."""
        return unit.lease.unit_id is None and unit.lease.unit is not None and (rollout.node is None or rollout.node.parent is None)

    def derived(self, unit: OpenLease, derived: Derived, posted: int = 0) -> None:
        """The unit's solver node is made (`posted`: of its samples already in, after a restart)."""
        size = self.config.solvers
        self.nodes[unit.lease.lease_id] = Node(unit.lease, unit.holder, derived, size, self.clock(), size - posted, posted)

    def sub_leases(self, holder: str, count: int) -> list[Lease]:
        """Up to `count` sub-leases for `holder`, oldest node first (its own units' at once, others'
        after `holder_first_s`). The lease book grants them (`grant_subs`)."""
        now, leases = self.clock(), []
        for unit_id, node in self.nodes.items():
            while len(leases) < count and node.unleased > 0 and (
                node.holder == holder or now >= node.made_at + self.config.holder_first_s
            ):
                size = min(self.config.sub_lease_size, node.unleased)
                node.unleased -= size
                lease = Lease(
                    lease_id=uuid.uuid4().hex, prompt_id=node.unit.prompt_id,
                    prompt_token_ids=node.derived.prompt_token_ids, group_size=size, deadline=0.0,
                    unit=node.unit.unit, node=node.derived.node, unit_id=unit_id,
                )
                node.subs[lease.lease_id] = size
                leases.append(lease)
        return leases

    def sub_room(self, lease: Lease) -> int:
        """Samples a sub-lease may still post (0 once full)."""
        node = self.nodes.get(lease.unit_id or "")
        return node.subs.get(lease.lease_id, 0) if node is not None else 0

    def short(self) -> list[str]:
        """Units whose solver node closes short now: at least `min_fill` samples in, and made
        `close_after_s` ago. The owner completes them; their open sub-leases close `node_closed`."""
        now = self.clock()
        due = [
            unit_id for unit_id, node in self.nodes.items()
            if self.config.min_fill <= node.posted < node.size and now >= node.made_at + self.config.close_after_s
        ]
        self.closed_short += len(due)
        return due

    def waiting(self, unit_id: str) -> bool:
        """Whether a unit's solver node is still being filled (its deadline is kept while it is)."""
        return unit_id in self.nodes
