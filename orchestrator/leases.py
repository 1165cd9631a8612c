"""Prompt leases: the open leases, the one way a lease closes, and the closed leases remembered
for late samples and resends.

RunState owns one `LeaseBook`; the lease policy (orchestrator/lease_policy.py, `LeasePolicy`)
decides which prompt a lease is of. Invariants:
- a lease is one unit (docs/architecture.md): a group of `group_size` samples of one prompt, or
  a tree (`[orchestrator.tree]`: the root's samples and branches from pivots), all answered by
  its holder, complete at `unit_size(lease)` samples;
- no more leases are open than can be consumed without going stale, nor than the buffer allows;
- every status change goes through `LeaseBook.close` (journal, policy, `on_dropped`, `on_closed`);
- a closed lease and its rollout ids are remembered for `dedupe_window_s` (after a recovery, in
  the journal), so a late sample gets a precise reason and a resend is a duplicate.
"""

from __future__ import annotations

import functools
import random
import uuid
from collections import deque
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Literal, Protocol

from decentrl.api.wire import ROOT_NODE, Lease, LeaseState, RolesUnit, Rollout, RolloutNode, StepBoundary, TreeUnit
from decentrl.config import RolesConfig, RunConfig, TreeConfig
from decentrl.rl.staleness import lease_budget
from decentrl.tasks import Task
from decentrl.tasks.episodes import EpisodeTask
from decentrl.tasks.prompts import PromptEncoder
from orchestrator.events import ClosedLease, ClosedStatus, Journaling, LeaseClosedAs, LeaseForgotten, LeaseGranted, LeaseRenewed
from orchestrator.lease_table import LeaseClosed, LeaseTable
from orchestrator.lease_table import LeaseError as LeaseError  # re-exported: handlers answer it

Requeue = Literal["back", "front"]

# A lease closed with one of these did not train: its samples are dropped.
UNTRAINED: frozenset[str] = frozenset({"expired", "released", "dropped", "superseded", "skipped", "node_closed"})
PROMPT_CACHE = 4096  # prompts whose token ids are kept (prompts come back each epoch)


def unit_size(lease: Lease) -> int:
    """The samples a lease's unit holds when complete: `group_size` for a plain group, the root's
    plus `pivots * k` branch samples for a tree, every role's for a roles unit."""
    unit = lease.unit
    if unit is None:
        return lease.group_size
    if isinstance(unit, TreeUnit):
        return lease.group_size + unit.pivots * unit.k
    return sum(unit.sizes)


def tree_unit(config: TreeConfig | None) -> TreeUnit | None:
    """The unit of a run's leases with `[orchestrator.tree]` (None without one)."""
    if config is None:
        return None
    boundary = StepBoundary(type=config.boundary, marker=config.marker, tokens=config.step_tokens)
    return TreeUnit(
        kind="tree", k=config.k, pivots=config.pivots, boundary=boundary, stop_below=config.stop_below, rule=config.rule,
        gamma=config.gamma,
    )


PROPOSER, SOLVER = "proposer", "solver"
ROOT = RolloutNode(node_id=ROOT_NODE, role=PROPOSER)  # the root node of a unit of roles, on its lease


def root_node(config: RolesConfig) -> RolloutNode:
    """A unit of roles' root node, on its lease: the proposer's, naming its policy in a run of two."""
    return RolloutNode(node_id=ROOT_NODE, role=PROPOSER, policy=PROPOSER) if config.policy_names else ROOT


def roles_unit(config: RolesConfig) -> RolesUnit:
    """The unit every lease of a roles run is of: a proposer node of one sample, a solver node of
    `solvers` (orchestrator/roles.py fills it)."""
    return RolesUnit(kind="roles", roles=[PROPOSER, SOLVER], sizes=[1, config.solvers], min_fill=config.min_fill)



@dataclass(frozen=True)
class Derived:
    """A derived node the reward stage made from a proposer's sample."""

    node: RolloutNode  # its id, parent {rollout_id, derived}, role
    prompt_token_ids: list[int]  # rendered by the orchestrator


@dataclass
class OpenLease:
    lease: Lease
    holder: str  # token name + worker id: only the holder may answer
    granted_at: float = 0.0  # when granted (a recovered lease: when recovered), for the lease policy
    samples: list[Rollout] = field(default_factory=list)
    check: list[int] = field(default_factory=list)  # samples whose logprobs are to be recomputed
    posted: int = 0  # samples taken through this lease since it was held (a sub-lease's join its unit's `samples`)

    @property
    def deadline(self) -> float:
        return self.lease.deadline

    @property
    def size(self) -> int:
        """The samples that complete it."""
        return unit_size(self.lease)

    @deadline.setter
    def deadline(self, deadline: float) -> None:
        self.lease = self.lease.model_copy(update={"deadline": deadline})


class PromptQueue:
    """The order prompts are leased in (a seeded shuffle of the task's pool, cycled; the lease
    policy takes `requeued` first) and each prompt's token ids. In a deterministic run `requeued`
    holds places."""

    def __init__(self, *, task: Task | EpisodeTask, render: PromptEncoder, seed: int) -> None:
        self.order = list(range(task.num_prompts))
        random.Random(seed).shuffle(self.order)
        self.cursor = 0
        self.requeued: deque[int] = deque()  # prompt ids to lease again first
        self.token_ids: Callable[[int], list[int]] = functools.lru_cache(maxsize=PROMPT_CACHE)(
            lambda prompt_id: render(task.prompt(prompt_id))
        )

    def next_index(self) -> int:
        self.cursor += 1
        return self.cursor - 1

    def prompt_at(self, index: int) -> int:
        return self.order[index % len(self.order)]


class LeasePolicy(Protocol):
    """The lease policy as the book sees it (orchestrator/lease_policy.py)."""

    def next(self) -> tuple[int, int | None, int | None]: ...
    def leased(self, open_leases: int) -> int: ...
    def held(self, open_lease: OpenLease) -> None: ...
    def closed(self, closed: ClosedLease, requeue: Requeue | None) -> None: ...
    def forgotten(self, closed: ClosedLease) -> None: ...
    def subs_of(self, closed: ClosedLease) -> list[str]: ...


class LeaseBook:
    def __init__(
        self,
        *,
        config: RunConfig,
        prompts: PromptQueue,
        journal: Journaling,
        clock: Callable[[], float],
        on_dropped: Callable[[ClosedLease, str, int], None],
        policy: LeasePolicy,
        on_closed: Callable[[str], None] = lambda lease_id: None,
    ) -> None:
        """`on_dropped(closed, reason, samples)`: a lease closed without training, `samples` of its
        samples to count as dropped for `reason`; `on_closed(lease_id)`: an open lease closed, however
        (its partial steps go with it)."""
        self.config = config
        self.prompts = prompts
        self.journal = journal
        self.clock = clock
        self.on_dropped = on_dropped
        self.on_closed = on_closed
        self.policy = policy
        options = config.orchestrator
        # What every lease of the run is a unit of (None: a plain group).
        self.unit = roles_unit(options.roles) if options.roles is not None else tree_unit(options.tree)
        self.open: LeaseTable[OpenLease] = LeaseTable(
            timeout_s=options.lease_timeout_s, clock=clock, what="lease", others="worker",
            missing=f"never granted, or closed more than {options.dedupe_window_s:.0f}s ago",
        )
        self.closed: dict[str, ClosedLease] = {}
        self.closed_order: deque[tuple[float, str]] = deque()  # (closed_at, lease_id), oldest first, for forgetting
        self.seen_rollout_ids: dict[str, str] = {}  # rollout id -> lease id, while its lease is remembered
        # After a recovery (orchestrator/recovery.py): the journal holds rollout ids that memory
        # does not, and closed leases only `remembered` as (closed_at, lease_id), oldest first.
        self.journaled = False
        self.remembered: deque[tuple[float, str]] = deque()

    # -- granting -------------------------------------------------------------------------

    def capacity(self, *, published: int | None, groups_consumed: int, waiting: int) -> int:
        """How many leases may be granted now. `published`: the newest version workers may pull;
        `groups_consumed`: groups the steps so far took; `waiting`: complete groups not yet taken."""
        if published is None:
            return 0
        leased = self.policy.leased(len(self.open))
        committed = groups_consumed + waiting + leased
        budget = lease_budget(published, self.config.max_staleness, self.config.places_per_step, committed)
        room = self.config.orchestrator.max_buffer_groups - waiting - leased
        return max(0, min(budget, room))

    def grant(self, holder: str, count: int) -> list[Lease]:
        """`count` new leases (the caller checked `capacity`)."""
        granted = []
        roles = self.config.orchestrator.roles
        for _ in range(count):
            prompt_id, index, version = self.policy.next()
            lease = Lease(
                lease_id=uuid.uuid4().hex,
                prompt_id=prompt_id,
                prompt_token_ids=self.prompts.token_ids(prompt_id),
                group_size=self.config.group_size if roles is None else 1,  # a unit of roles: its proposer's one sample
                deadline=self.open.deadline(),
                index=index,
                policy_version=version,
                unit=self.unit,
                node=root_node(roles) if roles is not None else None,
            )
            granted.append(self._grant(lease, holder))
        return granted

    def grant_copies(self, holder: str, leases: list[Lease]) -> list[Lease]:
        """New leases for `holder`, each of the same group as one of `leases` (the policy's copies)."""
        return [
            self._grant(lease.model_copy(update={"lease_id": uuid.uuid4().hex, "deadline": self.open.deadline()}), holder)
            for lease in leases
        ]

    def grant_subs(self, holder: str, leases: list[Lease]) -> list[Lease]:
        """Sub-leases (the policy's, orchestrator/roles.py) for `holder`: held, not journaled (after a
        restart their nodes' missing samples are leased again); each keeps its unit open."""
        granted = []
        for lease in leases:
            lease = lease.model_copy(update={"deadline": self.open.deadline()})
            self.hold(OpenLease(lease=lease, holder=holder))
            self.keep(lease.unit_id or "")
            granted.append(lease)
        return granted

    def keep(self, lease_id: str) -> None:
        """Renew an open unit whose node is being filled by sub-leases (its holder no longer renews it)."""
        if lease_id in self.open:
            self.open.renew(lease_id)
            self.journal.record(LeaseRenewed(lease_id, self.open[lease_id].deadline))

    def _grant(self, lease: Lease, holder: str) -> Lease:
        self.hold(OpenLease(lease=lease, holder=holder))
        self.journal.record(LeaseGranted(lease, holder))
        return lease

    def hold(self, open_lease: OpenLease) -> None:
        """Hold an open lease, granted now or recovered; either way its grant time is now."""
        open_lease.granted_at = self.clock()
        self.open.add(open_lease.lease.lease_id, open_lease)
        self.policy.held(open_lease)

    def expire(self) -> int:
        """Close overdue leases and lease their prompts again; how many expired."""
        overdue = self.open.overdue()
        for lease_id in overdue:
            if lease_id in self.open:  # else closed with its unit, earlier in this loop
                self.close(lease_id, "expired", requeue="back", reason="lease_expired")
        return len(overdue)

    # -- the one close path -----------------------------------------------------------------

    def close(
        self,
        lease_id: str,
        status: ClosedStatus,
        *,
        reason: str | None = None,
        counted: int | None = None,
        requeue: Requeue | None = None,
    ) -> ClosedLease:
        """Close an open lease, or move a closed one on (complete -> served, skipped or dropped). A
        lease closed untrained needs the `reason` its samples are dropped for (`counted` of them, by
        default all, go to `on_dropped`); `requeue` sends an open lease's prompt back in line."""
        now = self.clock()
        open_lease = self.open.pop(lease_id, None)
        if open_lease is None:
            closed = self.closed[lease_id]
            closed.status, closed.closed_at = status, now
        else:
            ids = [r.rollout_id for r in open_lease.samples]
            closed = self.closed[lease_id] = ClosedLease(open_lease.lease, open_lease.holder, status, now, len(ids), ids)
            self.on_closed(lease_id)
        self.policy.closed(closed, requeue if open_lease is not None else None)
        self.closed_order.append((now, lease_id))
        for sub in self.policy.subs_of(closed):  # a unit's open sub-leases close with it
            trained = status in ("complete", "served")
            self.close(sub, "node_closed" if trained else "dropped", reason="node_closed" if trained else "unit_dropped", counted=0)
        if status in UNTRAINED:
            assert reason is not None, f"a lease closed as {status} needs the reason its samples are dropped"
            self.on_dropped(closed, reason, (closed.samples if counted is None else counted) if closed.samples else 0)
        if status in UNTRAINED or status == "served":
            self.journal.record(LeaseClosedAs(lease_id, status, now, drop_samples=status != "served" and closed.samples > 0))
        return closed

    # -- a holder's requests ----------------------------------------------------------------

    def closed_lease(self, lease_id: str) -> ClosedLease | None:
        """A closed lease still remembered: in memory, or (recovered) in the journal."""
        closed = self.closed.get(lease_id)
        if closed is not None or not self.journaled or lease_id in self.open:
            return closed
        return self.journal.closed_lease(lease_id)

    def state_of(self, lease_id: str, holder: str) -> LeaseState:
        found = self.open.owned(lease_id, holder, self.closed_lease(lease_id))
        if isinstance(found, OpenLease):
            state, samples = "open", len(found.samples)
        else:
            state, samples = found.status, found.samples
        lease = found.lease
        return LeaseState(
            lease_id=lease_id, prompt_id=lease.prompt_id, state=state, samples=samples,  # type: ignore[arg-type]
            group_size=lease.group_size, deadline=lease.deadline,
        )

    def renew(self, lease_id: str, holder: str) -> Lease:
        found = self.open.owned(lease_id, holder, self.closed_lease(lease_id))
        if not isinstance(found, OpenLease):
            raise LeaseClosed(f"lease {lease_id!r} is {found.status}; it can no longer be renewed")
        self.open.renew(lease_id)
        self.journal.record(LeaseRenewed(lease_id, found.deadline))
        return found.lease

    def release(self, lease_id: str, holder: str) -> LeaseState:
        """The holder gives an open lease back: its prompt goes out again next, its samples are dropped."""
        found = self.open.owned(lease_id, holder, self.closed_lease(lease_id))
        if not isinstance(found, OpenLease):
            raise LeaseClosed(f"lease {lease_id!r} is {found.status}; there is nothing to release")
        self.close(lease_id, "released", requeue="front", reason="lease_released")
        return self.state_of(lease_id, holder)

    # -- forgetting -----------------------------------------------------------------------

    def forget_closed(self, *, in_batches: Collection[str], limit: int) -> int:
        """Forget leases closed more than `dedupe_window_s` ago (and their rollout ids), except
        those still in the buffer or in a batch that may be asked for again (`in_batches`)."""
        horizon = self.clock() - self.config.orchestrator.dedupe_window_s
        forgotten = 0
        while self.closed_order and self.closed_order[0][0] < horizon and forgotten < limit:
            closed_at, lease_id = self.closed_order.popleft()
            closed = self.closed.get(lease_id)
            if closed is None or closed.closed_at != closed_at:
                continue  # its status changed later; a later entry stands for it
            if closed.status == "complete" or lease_id in in_batches:
                closed.closed_at = self.clock()  # still wanted: look again later
                self.closed_order.append((closed.closed_at, lease_id))
                continue
            del self.closed[lease_id]
            self.policy.forgotten(closed)
            for rollout_id in closed.rollout_ids:
                self.seen_rollout_ids.pop(rollout_id, None)
            self.journal.record(LeaseForgotten(lease_id))
            forgotten += 1
        while self.remembered and self.remembered[0][0] < horizon and forgotten < limit:
            lease_id = self.remembered.popleft()[1]
            if lease_id not in self.closed:  # else recovered into memory (a batch kept): forgotten from there
                self.journal.record(LeaseForgotten(lease_id))
                forgotten += 1
        return forgotten
