"""The buffer: complete, scored groups in the ready queue for the trainer, and pending groups.

RunState puts complete groups here; orchestrator/batches.py takes them from the front. Invariants:
- the ready queue is in completion order (`seq`; in a deterministic run, the lease's place + 1);
  a pending group (`awaiting` its logprob check and/or its model scores) keeps its position and
  joins the ready queue there, so no later group overtakes it towards staleness;
- a group is journaled as complete when it joins the ready queue (one pending at a stop is
  checked again after the restart).
Closing the lease of a group taken out of the buffer is the caller's (LeaseBook.close).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from decentrl.api.wire import Rollout
from orchestrator.events import GroupCompleted, Journaling

Wait = Literal["check", "scores"]


@dataclass
class Group:
    """A complete, scored group: what the buffer orders, evicts and serves. A group recovered from
    the journal reads its samples from it when first needed (`read`), so a restart decodes none."""

    lease_id: str
    prompt_id: int
    rewards: list[float]
    oldest_version: int  # the oldest policy version among its samples: staleness is judged by it
    seq: int = 0  # position in the ready queue (ready_seq in the journal), set on joining it or becoming pending
    held: list[Rollout] | None = None  # its samples, in sample order
    read: Callable[[], list[Rollout]] | None = None  # where `held` is None
    awaiting: set[Wait] = field(default_factory=set)  # what keeps it pending, while it is pending
    verifier_rewards: list[float] | None = None  # while it waits for model scores: the task's rewards, if used
    # Process rewards, per sample: its steps' last token indices and their scores (None: unparsed).
    step_ends: list[list[int]] | None = None
    step_scores: list[list[float] | None] | None = None
    # On-policy distillation, per sample: the teacher's log-prob of each completion token (or None).
    teacher_logprobs: list[list[float] | None] | None = None

    @classmethod
    def of(cls, lease_id: str, prompt_id: int, rollouts: list[Rollout], rewards: list[float], seq: int = 0) -> Group:
        oldest = min(rollout.policy_version for rollout in rollouts)
        return cls(lease_id, prompt_id, rewards, oldest, seq, held=rollouts)

    @property
    def rollouts(self) -> list[Rollout]:
        if self.held is None:
            assert self.read is not None, "a group holds its samples or can read them"
            self.held, self.read = self.read(), None
        return self.held

    @property
    def samples(self) -> list[tuple[Rollout, float]]:
        """(rollout, reward) pairs, in sample order."""
        return list(zip(self.rollouts, self.rewards, strict=True))

    @property
    def size(self) -> int:
        return len(self.rewards)


@dataclass
class VerifyJob:
    """A complete group pending until the logprobs of `rollouts` are recomputed (orchestrator/verify.py)."""

    lease_id: str
    rollouts: list[Rollout]
    holder: str


class Buffer:
    def __init__(self, *, journal: Journaling, clock: Callable[[], float]) -> None:
        self.journal = journal
        self.clock = clock
        self.ready: deque[Group] = deque()  # the ready queue, oldest first
        self.pending: dict[str, Group] = {}  # lease id -> complete group pending (its check, its scores)
        self.verify_queue: deque[VerifyJob] = deque()
        self.ready_seq = 0  # the last position in the ready queue given

    def waiting(self) -> int:
        return len(self.ready) + len(self.pending)

    def to_pending(self, group: Group, *, check: VerifyJob | None = None, scores: bool = False) -> None:
        """The trainer sees the group only once its sampled logprobs check out (`check`) and its
        model scores are in (`scores`); it keeps its position in the ready queue meanwhile."""
        self._place(group)
        group.awaiting = ({"check"} if check is not None else set()) | ({"scores"} if scores else set())
        self.pending[group.lease_id] = group
        if check is not None:
            self.verify_queue.append(check)

    def done_waiting(self, lease_id: str, what: Wait) -> Group | None:
        """`what` is done for a pending group: the group, out of the buffer, once nothing keeps it
        pending (the caller queues or drops it); else None (also if it was dropped meanwhile)."""
        group = self.pending.get(lease_id)
        if group is None:
            return None
        group.awaiting.discard(what)
        if group.awaiting:
            return None
        del self.pending[lease_id]
        return group

    def waits_for(self, lease_id: str, what: Wait) -> bool:
        group = self.pending.get(lease_id)
        return group is not None and what in group.awaiting

    def pending_for(self, what: Wait) -> int:
        return sum(1 for group in self.pending.values() if what in group.awaiting)

    def _place(self, group: Group) -> None:
        """A free-running run's group takes the next position on completion (a deterministic run's has its place's)."""
        if not group.seq:
            self.ready_seq += 1
            group.seq = self.ready_seq

    def to_ready(self, group: Group) -> None:
        """To its position in the ready queue: the end, unless it was pending or is a deterministic run's."""
        self._place(group)
        position = len(self.ready)
        while position and self.ready[position - 1].seq > group.seq:
            position -= 1
        self.ready.insert(position, group)
        self.journal.record(GroupCompleted(group.lease_id, group.seq, group.rewards, group.oldest_version, self.clock()))

    def pending_ahead(self, count: int) -> bool:
        """Whether a group pending for its check is among the first `count` complete groups in
        queue order. A batch taken now would skip it and it would train a batch later than its lease
        was budgeted for (maybe stale by then): the batch waits for the check instead."""
        if not self.pending:
            return False
        first = min(group.seq for group in self.pending.values())
        ahead = 0
        for group in self.ready:
            if group.seq > first or ahead >= count:
                break
            ahead += 1
        return ahead < count

    def take_front(self, count: int) -> list[Group]:
        return [self.ready.popleft() for _ in range(count)]

    def evict(self, leaves: Callable[[Group], bool]) -> list[Group]:
        """Take the groups for which `leaves(group)` is true out of the ready queue, in order."""
        kept: deque[Group] = deque()
        gone: list[Group] = []
        for group in self.ready:
            (gone if leaves(group) else kept).append(group)
        self.ready = kept
        return gone

    def release_pending(self, leaves: Callable[[Group], bool]) -> list[Group]:
        """Take the pending groups for which `leaves(group)` is true (and their checks) out."""
        gone = [group for group in self.pending.values() if leaves(group)]
        for group in gone:
            del self.pending[group.lease_id]
        self.verify_queue = deque(job for job in self.verify_queue if job.lease_id in self.pending)
        return gone
