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

Two policies (`policies = "per_role"`): each role is its own model, trainer and stream of versions.
A unit's proposer node is leased only to a proposer worker and its solver node's sub-leases only to
solver workers (`serves`); a complete unit stays in the ready queue until each policy's trainer has
taken its part (`part`: that policy's samples, with their rewards), and is served (closed) when
the last one does (`take`). Which policies took a unit is not journaled: after a restart a unit one
trainer took and the other did not is served to both again.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from decentrl.api.wire import Lease, Rollout
from decentrl.config import RolesConfig
from orchestrator.buffer import Group
from orchestrator.lease_policy import FreeRunning
from orchestrator.leases import ClosedLease, Derived, OpenLease, PromptQueue, Requeue


def policy_of(rollout: Rollout) -> str | None:
    """The policy that sampled `rollout` (None: a run of one policy)."""
    return rollout.node.policy if rollout.node is not None else None


def part(group: Group, policy: str) -> Group:
    """A unit's samples of one policy, with their rewards: what that policy's trainer trains."""
    keep = [i for i, rollout in enumerate(group.rollouts) if policy_of(rollout) == policy]
    return Group.of(group.lease_id, group.prompt_id, [group.rollouts[i] for i in keep], [group.rewards[i] for i in keep], group.seq)


def oldest_by_policy(rollouts: list[Rollout]) -> dict[str | None, int]:
    """Each policy's oldest version among `rollouts`: a unit is fresh when each is, for its own stream."""
    oldest: dict[str | None, int] = {}
    for rollout in rollouts:
        policy = policy_of(rollout)
        oldest[policy] = min(oldest.get(policy, rollout.policy_version), rollout.policy_version)
    return oldest


@dataclass
class Node:
    """A unit's solver node while it is filled."""

    unit: Lease
    holder: str  # the unit's holder: offered the sub-leases first
    derived: Derived
    size: int
    made_at: float
    subs: set[str] = field(default_factory=set)  # its open sub-leases


class Roles(FreeRunning):
    """Prompts in the prompt queue's order, one unit each; solver nodes as sub-leases."""

    def __init__(
        self, *, prompts: PromptQueue, config: RolesConfig, clock: Callable[[], float],
        derive: Callable[[Rollout], Derived | None],
    ) -> None:
        """`derive`: the reward stage's (`RolesRewards.derive`), a proposer's sample -> its solver node."""
        super().__init__(prompts=prompts)
        self.config = config
        self.clock = clock
        self.derive = derive
        self.policies = config.policy_names  # () with one shared policy
        self.taken: dict[str, set[str]] = {}  # two policies: a ready unit's id -> the policies whose trainers took it
        self.finished: set[str] = set()  # two policies: those whose trainers ran their last step (they take no more)
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
            self.nodes[lease.unit_id].subs.add(lease.lease_id)

    def closed(self, closed: ClosedLease, requeue: Requeue | None) -> None:
        """A unit: its node goes, its prompt back in line if it is to go again. A sub-lease: its
        unfilled samples are the node's to lease again (never its prompt)."""
        lease = closed.lease
        unit_id = self.sub_of.pop(lease.lease_id, None)
        if unit_id is None:
            self.nodes.pop(lease.lease_id, None)
            if closed.status != "complete":  # served, or dropped: no trainer takes it any more
                self.taken.pop(lease.lease_id, None)
            super().closed(closed, requeue)
        elif unit_id in self.nodes:
            self.nodes[unit_id].subs.discard(lease.lease_id)

    def subs_of(self, closed: ClosedLease) -> list[str]:
        """The open sub-leases of a unit that just closed (none for a sub-lease)."""
        return [sub for sub, unit_id in self.sub_of.items() if unit_id == closed.lease.lease_id]

    # -- the owner's questions -------------------------------------------------------------------

    def serves(self, policy: str | None) -> tuple[bool, bool]:
        """Which leases a worker of `policy` gets: (new units, solver sub-leases). With one policy,
        both; with two, a proposer worker new units and a solver worker sub-leases. The handler
        refused a request that names no policy of the run."""
        if not self.policies:
            return True, True
        return policy == self.policies[0], policy == self.policies[1]

    def waiting(self, ready: list[Group], policy: str) -> int:
        """Ready units with samples of `policy` its trainer has not taken yet (its lease budget's "waiting")."""
        return sum(self._owes(group, policy) for group in ready)

    def _owes(self, group: Group, policy: str) -> bool:
        return policy not in self.taken.get(group.lease_id, ()) and any(policy_of(r) == policy for r in group.rollouts)

    def owing(self, group: Group) -> set[str | None]:
        """The policies with samples in `group` whose trainers have not taken it and will (not finished)."""
        return {policy_of(rollout) for rollout in group.rollouts} - self.taken.get(group.lease_id, set()) - self.finished

    def served(self, group: Group) -> bool:
        """Whether every policy with samples in `group` has taken it, or will take no more (finished)."""
        return not self.owing(group)

    def untaken(self, ready: list[Group], policy: str, count: int) -> list[Group]:
        """The first `count` ready units `policy`'s trainer has not taken, in queue order ([] if fewer)."""
        # An invalid proposal's unit has no solver samples: the proposer's trainer alone takes it.
        units = [group for group in ready if self._owes(group, policy)][:count]
        return units if len(units) == count else []

    def take(self, units: list[Group], policy: str) -> list[Group]:
        """`policy`'s trainer takes `units`; returns those every policy with samples in them has now taken (to serve)."""
        for group in units:
            self.taken.setdefault(group.lease_id, set()).add(policy)
        return [group for group in units if self.served(group)]

    def make_nodes(self, open_leases: Mapping[str, OpenLease]) -> list[str]:
        """Make the solver node of every open unit whose proposer's sample is in (asked before
        leases are granted, so a node is ready for the next worker; after a restart, less the
        solver samples already in). Returns the units whose proposal is invalid: the owner
        completes each, its proposer rewarded for validity alone."""
        invalid = []
        for unit_id, unit in open_leases.items():
            if unit.lease.unit_id is not None or unit_id in self.nodes or not unit.samples or unit.lease.unit is None:
                continue
            derived = self.derive(unit.samples[0])
            if derived is None:
                invalid.append(unit_id)
            else:
                self.nodes[unit_id] = Node(unit.lease, unit.holder, derived, self.config.solvers, self.clock())
        return invalid

    def sub_leases(self, holder: str, count: int, open_leases: Mapping[str, OpenLease]) -> list[Lease]:
        """Up to `count` sub-leases for `holder`, oldest node first (its own units' at once, others'
        after `holder_first_s`), each of the samples its node still lacks beyond its open
        sub-leases. The lease book grants them (`grant_subs`)."""
        now, leases = self.clock(), []
        for unit_id, node in self.nodes.items():
            if len(leases) >= count or (node.holder != holder and now < node.made_at + self.config.holder_first_s):
                continue
            in_flight = sum(open_leases[sub].lease.group_size - open_leases[sub].posted for sub in node.subs)
            need = node.size - (len(open_leases[unit_id].samples) - 1) - in_flight
            while len(leases) < count and need > 0:
                size = min(self.config.sub_lease_size, need)
                need -= size
                leases.append(Lease(
                    lease_id=uuid.uuid4().hex, prompt_id=node.unit.prompt_id,
                    prompt_token_ids=node.derived.prompt_token_ids, group_size=size, deadline=0.0,
                    unit=node.unit.unit, node=node.derived.node, unit_id=unit_id,
                ))
        return leases

    def short(self, open_leases: Mapping[str, OpenLease]) -> list[str]:
        """Units whose solver node closes short now: at least `min_fill` samples in, and made
        `close_after_s` ago. The owner completes them; their open sub-leases close `node_closed`."""
        now = self.clock()
        due = [
            unit_id for unit_id, node in self.nodes.items()
            if self.config.min_fill <= len(open_leases[unit_id].samples) - 1 < node.size
            and now >= node.made_at + self.config.close_after_s
        ]
        self.closed_short += len(due)
        return due
