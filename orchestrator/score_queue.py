"""The scoring queue: samples waiting for a model score, leased to scorers, and the scores posted.

The stage of a model reward (docs/rewards.md): RunState `add`s each complete group's items;
scorers lease them and `post` scores, and `post` names the groups it completed. Invariants:
- an item is leased to one scorer at a time; an overdue score lease expires, its unscored items
  go to the front of the queue, and a post on it is refused (409);
- a post is all or nothing: every score is checked before any is taken (ScoreError);
- a score is taken once per sample and journaled before the answer (score leases are not);
- a dropped group's items stay queued until they come up, and are then skipped (`alive`).
"""

from __future__ import annotations

import uuid
from collections import Counter, OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from decentrl.api.wire import ScoreAck, ScoreItem, ScorePost, ScoreRenewal, ScoreResult
from decentrl.config import RewardConfig
from orchestrator.events import Journaling, ScoreTaken
from orchestrator.lease_table import LeaseClosed, LeaseTable

# Counted since this orchestrator started (not journaled).
COUNTS = ("scores_posted", "scores_duplicate", "scores_reassigned", "score_leases_expired", "judge_parse_failures",
          "judge_parse_retries")
CLOSED_KEPT = 4096  # closed score leases remembered, to answer a late post precisely (409, not 404)


class ScoreError(Exception):
    """A post whose scores cannot be taken (400)."""

    status = 400


@dataclass
class Waiting:
    item: ScoreItem
    group_id: str
    result: ScoreResult | None = None


@dataclass
class ScoreLeaseEntry:
    lease_id: str
    holder: str  # token name + scorer id
    deadline: float
    rollout_ids: list[str]
    status: Literal["open", "done", "expired"] = "open"
    unscored: set[str] = field(default_factory=set)


def _check_score(result: ScoreResult, item: ScoreItem | None, low: float, high: float) -> None:
    """One score against its item (None: its group left): in range, one step score per step, and
    for distillation one teacher log-prob per completion token."""
    rid = result.rollout_id
    if result.score is not None and not low <= result.score <= high:
        raise ScoreError(f"rollout {rid!r}: score {result.score} is outside score_range [{low}, {high}]")
    steps = item.steps if item is not None else None
    if result.step_scores is not None:
        if steps is None:
            raise ScoreError(f"rollout {rid!r}: step_scores given, but the item has no steps (post null)")
        if len(result.step_scores) != len(steps):
            raise ScoreError(f"rollout {rid!r}: {len(result.step_scores)} step scores for {len(steps)} steps (one per step)")
        bad = next((s for s in result.step_scores if not low <= s <= high), None)
        if bad is not None:
            raise ScoreError(f"rollout {rid!r}: step score {bad} is outside score_range [{low}, {high}]")
    elif steps is not None and result.failure is None:
        raise ScoreError(f"rollout {rid!r}: the item has {len(steps)} steps; post one step score for each")
    if item is None:
        return
    ids = item.completion_token_ids
    if result.token_logprobs is not None:
        if ids is None:
            raise ScoreError(f"rollout {rid!r}: token_logprobs given, but the item has no token ids (post null)")
        if len(result.token_logprobs) != len(ids):
            raise ScoreError(
                f"rollout {rid!r}: {len(result.token_logprobs)} token log-probs for {len(ids)} completion tokens (one per token)"
            )
    elif ids is not None and result.failure is None:
        raise ScoreError(
            f"rollout {rid!r}: the item has {len(ids)} completion tokens; post the teacher's log-prob of each (token_logprobs)"
        )


class ScoreQueue:
    def __init__(
        self, *, config: RewardConfig, journal: Journaling, clock: Callable[[], float], alive: Callable[[str], bool]
    ) -> None:
        """`alive(group_id)`: whether the group still waits for its scores (the buffer holds it)."""
        self.config = config
        self.journal = journal
        self.alive = alive
        self.samples: dict[str, Waiting] = {}  # rollout id -> its item, while its group waits
        self.groups: dict[str, list[str]] = {}  # group id -> its rollout ids, in sample order
        self.queue: deque[str] = deque()  # rollout ids to lease, front first
        self.leases: LeaseTable[ScoreLeaseEntry] = LeaseTable(
            timeout_s=config.lease_timeout_s, clock=clock, what="score lease", others="scorer",
            missing="never granted, or forgotten (lease again)",
        )
        self.closed: OrderedDict[str, ScoreLeaseEntry] = OrderedDict()  # the last CLOSED_KEPT closed ones
        self.counts: Counter[str] = Counter()

    # -- groups in ------------------------------------------------------------------------

    def add(self, group_id: str, items: list[ScoreItem], taken: dict[str, ScoreResult]) -> None:
        """A complete group waits for its scores; `taken`: scores already journaled for its samples."""
        self.groups[group_id] = [item.rollout_id for item in items]
        for item in items:
            waiting = self.samples[item.rollout_id] = Waiting(item, group_id, taken.get(item.rollout_id))
            if waiting.result is None:
                self.queue.append(item.rollout_id)

    def complete(self, group_id: str) -> bool:
        return all(self.samples[rollout_id].result is not None for rollout_id in self.groups[group_id])

    def take(self, group_id: str) -> list[ScoreResult]:
        """A complete group's scores, in sample order; the group leaves the queue."""
        results = [self.samples.pop(rollout_id).result for rollout_id in self.groups.pop(group_id)]
        assert all(result is not None for result in results)
        return results  # type: ignore[return-value]

    def forget(self, group_id: str) -> None:
        """The group left without its scores (dropped): its items go (queued ones are skipped later)."""
        for rollout_id in self.groups.pop(group_id, []):
            self.samples.pop(rollout_id, None)

    # -- a scorer's requests ----------------------------------------------------------------

    def lease(self, holder: str, max_items: int) -> ScoreLeaseEntry | None:
        """Up to `max_items` items, oldest (or reassigned) first; None when none waits."""
        self.expire()
        taken: list[str] = []
        while self.queue and len(taken) < max_items:
            rollout_id = self.queue.popleft()
            waiting = self.samples.get(rollout_id)
            if waiting is None or waiting.result is not None:
                continue  # its group left, or it was scored on a lease that expired later
            if not self.alive(waiting.group_id):
                self.forget(waiting.group_id)
                continue
            taken.append(rollout_id)
        if not taken:
            return None
        entry = ScoreLeaseEntry(uuid.uuid4().hex, holder, self.leases.deadline(), taken, unscored=set(taken))
        self.leases.add(entry.lease_id, entry)
        return entry

    def items(self, entry: ScoreLeaseEntry) -> list[ScoreItem]:
        return [self.samples[rollout_id].item for rollout_id in entry.rollout_ids]

    def renew(self, lease_id: str, holder: str) -> ScoreRenewal:
        self.expire()
        entry = self._owned(lease_id, holder)
        self.leases.renew(lease_id)
        return ScoreRenewal(lease_id=lease_id, deadline=entry.deadline, unscored=len(entry.unscored))

    def post(self, holder: str, body: ScorePost) -> tuple[ScoreAck, list[str]]:
        """Take a post's scores (all, or none: ScoreError): the answer, the groups it completed."""
        self.expire()
        entry = self._owned(body.lease_id, holder, posting=True)
        fresh = self._check(entry, body)
        groups = set()
        for result in fresh:
            entry.unscored.discard(result.rollout_id)
            waiting = self.samples.get(result.rollout_id)
            if waiting is None or not self.alive(waiting.group_id):
                if waiting is not None:
                    self.forget(waiting.group_id)
                continue  # its group was dropped meanwhile: nothing waits for this score
            waiting.result = result
            groups.add(waiting.group_id)
            self.journal.record(ScoreTaken(result.rollout_id, waiting.group_id, result.model_dump_json()))
            if result.failure == "parse":
                self.counts["judge_parse_failures"] += 1
        duplicates = len(body.scores) - len(fresh)
        self.counts["scores_posted"] += len(fresh)
        self.counts["scores_duplicate"] += duplicates
        self.counts["judge_parse_retries"] += body.parse_retries
        if not entry.unscored and entry.status == "open":
            self._close(entry, "done")
        ack = ScoreAck(accepted=len(fresh), duplicates=duplicates, unscored=len(entry.unscored))
        return ack, [group_id for group_id in sorted(groups) if self.complete(group_id)]

    def _owned(self, lease_id: str, holder: str, *, posting: bool = False) -> ScoreLeaseEntry:
        entry = self.leases.owned(lease_id, holder, self.closed.get(lease_id))
        if entry.status == "expired":
            raise LeaseClosed(
                f"score lease {lease_id!r} expired (no full answer within {self.config.lease_timeout_s:.0f}s); its "
                "unscored items were leased again: lease again, and renew long leases"
            )
        if entry.status == "done" and not posting:
            raise LeaseClosed(f"score lease {lease_id!r} is done: every item is scored")
        return entry

    def _check(self, entry: ScoreLeaseEntry, body: ScorePost) -> list[ScoreResult]:
        """The post's new scores, or a ScoreError naming the first bad one."""
        low, high = self.config.score_range
        in_lease, seen, fresh = set(entry.rollout_ids), set(), []
        for result in body.scores:
            rid = result.rollout_id
            if rid not in in_lease:
                raise ScoreError(f"rollout {rid!r} is not in score lease {entry.lease_id!r}")
            if rid in seen:
                raise ScoreError(f"rollout {rid!r} is scored twice in one post")
            seen.add(rid)
            waiting = self.samples.get(rid)
            _check_score(result, waiting.item if waiting is not None else None, low, high)
            if rid in entry.unscored:
                fresh.append(result)
        return fresh

    def expire(self) -> int:
        """Close overdue score leases; their unscored items go to the front of the queue."""
        overdue = self.leases.overdue()
        again = []
        for lease_id in overdue:
            entry = self.leases[lease_id]
            again += [rid for rid in entry.rollout_ids if rid in entry.unscored and rid in self.samples]
            self._close(entry, "expired")
        self.queue.extendleft(reversed(again))  # first, the lease that expired first first
        self.counts["score_leases_expired"] += len(overdue)
        self.counts["scores_reassigned"] += len(again)
        return len(overdue)

    def _close(self, entry: ScoreLeaseEntry, status: Literal["done", "expired"]) -> None:
        entry.status = status
        self.leases.pop(entry.lease_id, None)
        self.closed[entry.lease_id] = entry
        if len(self.closed) > CLOSED_KEPT:
            self.closed.popitem(last=False)

    # -- for /metrics and /v1/status ----------------------------------------------------------

    def waiting(self) -> int:
        """Samples of waiting groups not yet scored (leased or not)."""
        return sum(1 for waiting in self.samples.values() if waiting.result is None)

    def leased(self) -> int:
        return sum(len(entry.unscored) for entry in self.leases.values())

    def summary(self) -> dict[str, int]:
        """/v1/status `scoring`: the gauges and the counts."""
        counts = {name: self.counts[name] for name in COUNTS}
        return {"waiting": self.waiting(), "leased": self.leased(), "leases_open": len(self.leases), **counts}
