"""Prompt leases: which prompt goes out next, the open leases, the one way a lease closes, and the
closed leases remembered for late samples and resends.

RunState (orchestrator/state.py) owns one `LeaseBook` and calls it from its public methods; what
a lease closed without training means for the counters and for integrity, it applies (`on_dropped`).
Invariants:
- a lease is one group: `group_size` samples of one prompt, all answered by its holder; an
  overdue lease expires, its prompt is leased again first and a late sample gets `lease_expired`;
- no more leases are open than can be consumed without going stale (`lease_budget`), nor than
  the buffer bound allows (`orchestrator.max_buffer_groups`);
- every status change of a lease goes through `LeaseBook.close`: it journals the change and hands
  a lease closed without training (`UNTRAINED`) to `on_dropped`, whose content may then honestly
  come again;
- a closed lease and its rollout ids are remembered for `dedupe_window_s`, so a late sample gets
  a precise reason and a resend is a duplicate; after a recovery those closed before it are
  looked up in the journal (`closed_lease`; their rollout ids: RunState.ingest), not held in memory;
- deterministic runs (docs/reproducibility.md): a lease is a place in the consumption order
  (`Lease.index`), which fixes its prompt and the version it is sampled under; a place closed
  without training is leased again, lowest first, so no place is ever skipped;
- hedging (orchestrator/lease_policy.py): a place may have up to `hedging.max_copies` open leases
  (`places`), each the same group bit for bit; the budget counts places, not copies; the first
  copy to complete fills the place and the others close as `superseded`; a place goes back in
  line only when its last copy closes without training. A losing copy is remembered for its
  holder (`untold`) until its next lease answer tells it (`tell`): in memory only, at most
  MAX_SUPERSEDED a holder, no longer than the closed lease itself.
"""

from __future__ import annotations

import bisect
import functools
import random
import uuid
from collections import deque
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Literal

from decentrl.api.encoding import Packed
from decentrl.api.wire import MAX_SUPERSEDED, Lease, LeaseState, Rollout
from decentrl.config import RunConfig
from decentrl.rl.determinism import required_version
from decentrl.rl.staleness import lease_budget
from decentrl.tasks import Task
from decentrl.tasks.episodes import EpisodeTask
from decentrl.tasks.prompts import PromptEncoder
from orchestrator.events import ClosedLease, ClosedStatus, Journaling, LeaseClosedAs, LeaseForgotten, LeaseGranted, LeaseRenewed
from orchestrator.lease_table import LeaseClosed, LeaseTable
from orchestrator.lease_table import LeaseError as LeaseError  # re-exported: handlers answer it

Requeue = Literal["back", "front"]

# A lease closed with one of these did not train: its samples are dropped.
UNTRAINED: frozenset[str] = frozenset({"expired", "released", "dropped", "superseded", "skipped"})
# Deterministic runs: a place closed with one of these is leased again (a superseded place was
# filled by another copy; a skipped one was consumed by a step).
REFILLED: frozenset[str] = frozenset({"expired", "released", "dropped"})
PROMPT_CACHE = 4096  # prompts whose token ids are kept (prompts come back each epoch)


@dataclass
class OpenLease:
    lease: Lease
    holder: str  # token name + worker id: only the holder may answer
    granted_at: float = 0.0  # when granted (a recovered lease: when recovered), for hedging
    samples: list[Rollout] = field(default_factory=list)
    packed: list[Packed] = field(default_factory=list)  # per sample: completion ids and logprobs, packed
    check: list[int] = field(default_factory=list)  # samples whose logprobs are to be recomputed

    @property
    def deadline(self) -> float:
        return self.lease.deadline

    @deadline.setter
    def deadline(self, deadline: float) -> None:
        self.lease = self.lease.model_copy(update={"deadline": deadline})


class PromptQueue:
    """The order prompts are leased in: a seeded shuffle of the task's pool, cycled, with the
    prompts of leases that closed unanswered going out first; and each prompt's token ids, as
    `render` makes them (decentrl/tasks/prompts.py). A deterministic run leases places of the
    consumption order instead (`next_index`), and `requeued` holds places, lowest first."""

    def __init__(
        self, *, task: Task | EpisodeTask, render: PromptEncoder, seed: int, deterministic: bool = False
    ) -> None:
        self.deterministic = deterministic
        self.order = list(range(task.num_prompts))
        random.Random(seed).shuffle(self.order)
        self.cursor = 0
        self.requeued: deque[int] = deque()  # prompt ids; deterministic: places, ascending
        self.token_ids: Callable[[int], list[int]] = functools.lru_cache(maxsize=PROMPT_CACHE)(
            lambda prompt_id: render(task.prompt(prompt_id))
        )

    def next_id(self) -> int:
        return self.requeued.popleft() if self.requeued else self.prompt_at(self.next_index())

    def next_index(self) -> int:
        """Deterministic runs: the next place to lease, a requeued one first (the lowest)."""
        if self.requeued:
            return self.requeued.popleft()
        self.cursor += 1
        return self.cursor - 1

    def prompt_at(self, index: int) -> int:
        return self.order[index % len(self.order)]

    def requeue(self, item: int, where: Requeue) -> None:
        """Lease `item` (a prompt id; deterministic: a place, kept in ascending order) again first."""
        if self.deterministic:
            bisect.insort(self.requeued, item)
        elif where == "front":
            self.requeued.appendleft(item)
        else:
            self.requeued.append(item)


class LeaseBook:
    def __init__(
        self,
        *,
        config: RunConfig,
        prompts: PromptQueue,
        journal: Journaling,
        clock: Callable[[], float],
        on_dropped: Callable[[ClosedLease, str, int], None],
    ) -> None:
        """`on_dropped(closed, reason, samples)`: a lease closed without training, `samples` of its
        samples to count as dropped for `reason`."""
        self.config = config
        self.prompts = prompts
        self.journal = journal
        self.clock = clock
        self.on_dropped = on_dropped
        options = config.orchestrator
        self.open: LeaseTable[OpenLease] = LeaseTable(
            timeout_s=options.lease_timeout_s, clock=clock, what="lease", others="worker",
            missing=f"never granted, or closed more than {options.dedupe_window_s:.0f}s ago",
        )
        self.places: dict[int, list[str]] = {}  # deterministic runs: place -> its open leases (copies), oldest first
        # A superseded lease -> the content hashes of the copy that filled its place, by sample
        # index, for `hedge_mismatches` (not journaled).
        self.winners: dict[str, list[bytes]] = {}
        # Holder -> its superseded leases it has not been told of yet, oldest first (an ordered set).
        self.untold: dict[str, dict[str, None]] = {}
        self.superseded = 0  # copies closed as superseded since the start: the lease long-poll wakes on more
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
        leased = len(self.places) if self.prompts.deterministic else len(self.open)  # copies of a place count once
        committed = groups_consumed + waiting + leased
        budget = lease_budget(published, self.config.max_staleness, self.config.places_per_step, committed)
        room = self.config.orchestrator.max_buffer_groups - waiting - leased
        return max(0, min(budget, room))

    def grant(self, holder: str, count: int) -> list[Lease]:
        """`count` leases (the caller checked `capacity`). In a deterministic run each is the next
        place, sampled under the version that place requires; the budget guarantees that version
        is published, so a worker asking early is held back by the budget, not given a lease."""
        granted = []
        for _ in range(count):
            index = version = None
            if self.prompts.deterministic:
                index = self.prompts.next_index()
                prompt_id = self.prompts.prompt_at(index)
                version = required_version(
                    index, groups_per_step=self.config.places_per_step, max_staleness=self.config.max_staleness
                )
            else:
                prompt_id = self.prompts.next_id()
            lease = Lease(
                lease_id=uuid.uuid4().hex,
                prompt_id=prompt_id,
                prompt_token_ids=self.prompts.token_ids(prompt_id),
                group_size=self.config.group_size,
                deadline=self.open.deadline(),
                index=index,
                policy_version=version,
            )
            granted.append(self._grant(lease, holder))
        return granted

    def copy(self, index: int, holder: str) -> Lease:
        """Deterministic runs: another lease of open place `index` for `holder` (a hedge): the
        same prompt and version, so the same group bit for bit."""
        first = self.open[self.places[index][0]].lease
        return self._grant(first.model_copy(update={"lease_id": uuid.uuid4().hex, "deadline": self.open.deadline()}), holder)

    def _grant(self, lease: Lease, holder: str) -> Lease:
        self.hold(OpenLease(lease=lease, holder=holder))
        self.journal.record(LeaseGranted(lease, holder))
        return lease

    def hold(self, open_lease: OpenLease) -> None:
        """Hold an open lease: granted now, or (recovery) one the journal holds; either way its
        grant time, for hedging, is now (the journal keeps only the deadline)."""
        open_lease.granted_at = self.clock()
        self.open.add(open_lease.lease.lease_id, open_lease)
        if open_lease.lease.index is not None:
            self.places.setdefault(open_lease.lease.index, []).append(open_lease.lease.lease_id)

    def expire(self) -> int:
        """Close overdue leases and lease their prompts again. Returns how many expired."""
        overdue = self.open.overdue()
        for lease_id in overdue:
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
        """Close an open lease, or move a closed one on (complete -> served, skipped or dropped).

        A lease closed without training needs the `reason` its samples are dropped for: `counted`
        of them (default: all it holds) go to `on_dropped`. `requeue` puts an open lease's prompt
        back in line; a deterministic run puts a `REFILLED` place back itself, once no other copy
        of it is open. A complete group is journaled by the buffer (with its place and rewards).
        """
        now = self.clock()
        open_lease = self.open.pop(lease_id, None)
        if open_lease is None:
            closed = self.closed[lease_id]
            closed.status, closed.closed_at = status, now
        else:
            ids = [r.rollout_id for r in open_lease.samples]
            closed = self.closed[lease_id] = ClosedLease(open_lease.lease, open_lease.holder, status, now, len(ids), ids)
            if closed.lease.index is not None:
                self.places[closed.lease.index].remove(lease_id)
                if not self.places[closed.lease.index]:
                    del self.places[closed.lease.index]
        index = closed.lease.index  # None unless the run is deterministic
        if index is None:
            if requeue is not None and open_lease is not None:
                self.prompts.requeue(closed.lease.prompt_id, requeue)
        elif status in REFILLED and index not in self.places:
            self.prompts.requeue(index, "back")
        self.closed_order.append((now, lease_id))
        if status in UNTRAINED:
            assert reason is not None, f"a lease closed as {status} needs the reason its samples are dropped"
            self.on_dropped(closed, reason, (closed.samples if counted is None else counted) if closed.samples else 0)
        if status in UNTRAINED or status == "served":
            self.journal.record(LeaseClosedAs(lease_id, status, now, drop_samples=status != "served" and closed.samples > 0))
        return closed

    def supersede(self, index: int, winner: list[bytes]) -> None:
        """Deterministic runs: a copy of place `index` completed; close its other copies (their
        samples duplicate the winner's, `winner`: its content hashes by sample index)."""
        for lease_id in list(self.places.get(index, ())):
            closed = self.close(lease_id, "superseded", reason="hedge_lost")
            self.winners[lease_id] = winner
            self.superseded += 1
            lost = self.untold.setdefault(closed.holder, {})
            lost[lease_id] = None
            if len(lost) > MAX_SUPERSEDED:  # a holder that never asks again: its oldest news goes
                del lost[next(iter(lost))]

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

    def lost_copy(self, lease_id: str, holder: str) -> bool:
        """Whether `lease_id` is `holder`'s copy of a place another copy filled: its samples are
        duplicates (never a strike). Posting it, its holder has finished it: it is not told of it."""
        closed = self.closed_lease(lease_id)
        if closed is None or closed.status != "superseded" or closed.holder != holder:
            return False
        self._told_needless(lease_id, holder)
        return True

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
        """Push an open lease's deadline to `lease_timeout_s` from now (a slow worker's heartbeat)."""
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
            self.winners.pop(lease_id, None)
            self._told_needless(lease_id, closed.holder)
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
