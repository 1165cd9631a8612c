"""The scoring queue: samples waiting for a model score, leased to scorers, and the scores posted;
beside them, the steps of samples still being generated (tree units, issue 47).

The stage of a model reward (docs/rewards.md): RunState `add`s each complete group's items;
scorers lease them and `post` scores, and `post` names the groups it completed. A posted step
(`add_step`, POST /v1/steps) is an item of its own, keyed (rollout id, step), leased before any
whole sample (a verdict is wanted while its chain is still generated), and its score comes back
from `post` as a verdict for the worker. Invariants:
- an item is leased to one scorer at a time; an overdue score lease expires, its unscored items
  go to the front of the queue, and a post on it is refused (409);
- a post is all or nothing: every score is checked before any is taken (ScoreError);
- a score is taken once per sample and journaled before the answer (score leases are not);
- a dropped group's items stay queued until they come up, and are then skipped (`alive`); the
  steps of a lease that closed leave the queue with it (`forget_steps`), leased or not.
"""

from __future__ import annotations

import uuid
from collections import Counter, OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

from decentrl.api.wire import (
    Lease,
    PartialStep,
    Rollout,
    ScoreAck,
    ScoreItem,
    ScorePost,
    ScoreRenewal,
    ScoreResult,
    StepPost,
    StepVerdict,
    value_range,
)
from decentrl.config import RewardConfig
from orchestrator.events import Journaling, ScoreTaken
from orchestrator.lease_table import LeaseClosed, LeaseTable

# Counted since this orchestrator started (not journaled).
COUNTS = ("scores_posted", "scores_duplicate", "scores_reassigned", "score_leases_expired", "judge_parse_failures",
          "judge_parse_retries", "steps_scored")

Key = str | tuple[str, int]  # a whole sample's rollout id, or a partial step's (rollout id, step)


def key_of(rollout_id: str, step: int | None) -> Key:
    return rollout_id if step is None else (rollout_id, step)


class StepVerdictTaken(NamedTuple):
    """A partial step's verdict, for RunState to journal and hand to the worker."""

    lease_id: str
    rollout_id: str
    step: int
    score: float
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
    rollout_ids: list[Key]
    status: Literal["open", "done", "expired"] = "open"
    unscored: set[Key] = field(default_factory=set)


def _check_score(result: ScoreResult, item: ScoreItem | None, low: float, high: float) -> None:
    """One score against its item (None: its group left): in range, one step score per step, and
    for distillation one teacher log-prob per completion token."""
    rid = result.rollout_id
    if result.score is not None and not low <= result.score <= high:
        raise ScoreError(f"rollout {rid!r}: score {result.score} is outside score_range [{low}, {high}]")
    if result.step is not None:  # a partial step: its score alone
        if result.step_scores is not None or result.token_logprobs is not None:
            raise ScoreError(f"rollout {rid!r} step {result.step}: a step's verdict is its score alone "
                             "(step_scores and token_logprobs null)")
        if result.failure is not None:
            raise ScoreError(f"rollout {rid!r} step {result.step}: a step's verdict needs a score (do not post a "
                             "step the judge could not read; it is leased again)")
        return
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
        self, *, config: RewardConfig, journal: Journaling, clock: Callable[[], float], alive: Callable[[str], bool],
    ) -> None:
        """`alive(group_id)`: whether the group still waits for its scores (the buffer holds it)."""
        self.config = config
        self.journal = journal
        self.alive = alive
        self.samples: dict[Key, Waiting] = {}  # key -> its item, while its group (a step: its lease) waits
        self.groups: dict[str, list[str]] = {}  # group id -> its rollout ids, in sample order
        self.queue: deque[Key] = deque()  # whole samples to lease, front first
        self.step_queue: deque[Key] = deque()  # partial steps to lease, before any whole sample
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

    def add_step(self, lease_id: str, item: ScoreItem) -> None:
        """A posted step (`item.step` set) waits for its verdict."""
        assert item.step is not None
        key = (item.rollout_id, item.step)
        self.samples[key] = Waiting(item, lease_id)
        self.step_queue.append(key)

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

    def forget_steps(self, keys: list[tuple[str, int]]) -> None:
        """Steps of a lease that closed: nobody waits for their verdicts. Queued ones are skipped when
        they come up; a post of a leased one is taken and unused, and its score lease's expiry leases it
        to nobody again."""
        for key in keys:
            self.samples.pop(key, None)

    # -- a scorer's requests ----------------------------------------------------------------

    def lease(self, holder: str, max_items: int) -> ScoreLeaseEntry | None:
        """Up to `max_items` items, oldest (or reassigned) first; None when none waits."""
        self.expire()
        taken: list[Key] = []
        for queue in (self.step_queue, self.queue):
            while queue and len(taken) < max_items:
                key = queue.popleft()
                waiting = self.samples.get(key)
                if waiting is None or waiting.result is not None:
                    continue  # its group (a step: its lease) left, or it was scored on a lease that expired later
                if not isinstance(key, tuple) and not self.alive(waiting.group_id):
                    self.forget(waiting.group_id)
                    continue
                taken.append(key)
        if not taken:
            return None
        entry = ScoreLeaseEntry(uuid.uuid4().hex, holder, self.leases.deadline(), taken, unscored=set(taken))
        self.leases.add(entry.lease_id, entry)
        return entry

    def items(self, entry: ScoreLeaseEntry) -> list[ScoreItem]:
        return [self.samples[key].item for key in entry.rollout_ids]

    def renew(self, lease_id: str, holder: str) -> ScoreRenewal:
        self.expire()
        entry = self._owned(lease_id, holder)
        self.leases.renew(lease_id)
        return ScoreRenewal(lease_id=lease_id, deadline=entry.deadline, unscored=len(entry.unscored))

    def post(self, holder: str, body: ScorePost) -> tuple[ScoreAck, list[str], list[StepVerdictTaken]]:
        """Take a post's scores (all, or none: ScoreError): the answer, the groups it completed,
        and the verdicts on partial steps it holds (each taken once)."""
        self.expire()
        entry = self._owned(body.lease_id, holder, posting=True)
        fresh = self._check(entry, body)
        groups, verdicts = set(), []
        for result in fresh:
            key = key_of(result.rollout_id, result.step)
            entry.unscored.discard(key)
            if isinstance(key, tuple):
                waiting = self.samples.pop(key, None)
                if waiting is not None and result.score is not None:
                    verdicts.append(StepVerdictTaken(waiting.group_id, result.rollout_id, key[1], result.score))
                    self.counts["steps_scored"] += 1
                continue
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
        return ack, [group_id for group_id in sorted(groups) if self.complete(group_id)], verdicts

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
            rid, key = result.rollout_id, key_of(result.rollout_id, result.step)
            what = f"rollout {rid!r}" if result.step is None else f"rollout {rid!r} step {result.step}"
            if key not in in_lease:
                raise ScoreError(f"{what} is not in score lease {entry.lease_id!r}")
            if key in seen:
                raise ScoreError(f"{what} is scored twice in one post")
            seen.add(key)
            waiting = self.samples.get(key)
            _check_score(result, waiting.item if waiting is not None else None, low, high)
            if key in entry.unscored:
                fresh.append(result)
        return fresh

    def expire(self) -> int:
        """Close overdue score leases; their unscored items go to the front of the queue."""
        overdue = self.leases.overdue()
        again = []
        for lease_id in overdue:
            entry = self.leases[lease_id]
            again += [key for key in entry.rollout_ids if key in entry.unscored and key in self.samples]
            self._close(entry, "expired")
        # First, the lease that expired first first; steps to their own queue.
        self.step_queue.extendleft(reversed([key for key in again if isinstance(key, tuple)]))
        self.queue.extendleft(reversed([key for key in again if not isinstance(key, tuple)]))
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
        return sum(1 for key, waiting in self.samples.items() if waiting.result is None and not isinstance(key, tuple))

    def steps_waiting(self) -> int:
        """Posted steps not yet judged (leased or not)."""
        return sum(1 for key in self.samples if isinstance(key, tuple))

    def leased(self) -> int:
        return sum(len(entry.unscored) for entry in self.leases.values())

    def summary(self) -> dict[str, int]:
        """/v1/status `scoring`: the gauges and the counts."""
        counts = {name: self.counts[name] for name in COUNTS}
        return {"waiting": self.waiting(), "leased": self.leased(), "leases_open": len(self.leases),
                "steps_waiting": self.steps_waiting(), **counts}


# -- partial steps: what workers posted of samples still being generated, and the verdicts ------


class StepError(ScoreError):
    """A step post that cannot be taken (400; 409 for a step taken before with other tokens)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class Chain:
    """The posted steps of one sample still being generated."""

    lease_id: str
    holder: str
    prompt_token_ids: list[int]
    steps: list[PartialStep] = field(default_factory=list)
    scores: dict[int, float] = field(default_factory=dict)  # step -> its verdict, as journaled

    @property
    def tokens(self) -> int:
        return sum(len(step.token_ids) for step in self.steps)


class StepBook:
    """Steps posted per sample, while their lease is open, and the verdicts on them that each
    worker has yet to read. A step is taken once (idempotent by rollout id and step), in order,
    all of a post or none; a verdict gets the next `seq` of the run. Both are journaled by RunState
    (StepTaken, VerdictTaken) and recovered with their open lease (orchestrator/recovery.py)."""

    def __init__(self) -> None:
        self.chains: dict[str, Chain] = {}  # rollout id -> its steps
        self.verdicts: dict[str, list[StepVerdict]] = {}  # holder -> verdicts on its open leases, seq order
        self.seq = 0  # the newest verdict's

    def take(
        self, lease: Lease, holder: str, body: StepPost, *, max_tokens: int, vocab_size: int, max_samples: int
    ) -> tuple[list[PartialStep], int]:
        """The post's new steps (checked, all or none: StepError) and how many were duplicates."""
        lengths = {rid: len(chain.steps) for rid, chain in self.chains.items() if chain.lease_id == lease.lease_id}
        tokens = {rid: self.chains[rid].tokens for rid in lengths}
        fresh: list[PartialStep] = []
        duplicates = 0
        for step in body.steps:
            rid, what = step.rollout_id, f"rollout {step.rollout_id!r} step {step.step}"
            chain = self.chains.get(rid)
            if chain is not None and chain.lease_id != lease.lease_id:
                raise StepError(f"rollout {rid!r} already posted steps of another lease; rollout ids are unique")
            posted = lengths.get(rid, 0)
            if step.step < posted:
                before = chain.steps[step.step] if chain is not None and step.step < len(chain.steps) else None
                if before is not None and list(before.token_ids) != list(step.token_ids):
                    raise StepError(f"{what} was taken before with other tokens; a step is never changed", 409)
                duplicates += 1
                continue
            if step.step > posted:
                raise StepError(f"{what} comes before step {posted} of it: post each step after the one before it")
            if step.prompt_token_ids is not None and (
                list(step.prompt_token_ids[: len(lease.prompt_token_ids)]) != list(lease.prompt_token_ids)
            ):
                raise StepError(f"{what}: prompt_token_ids do not start with the lease's prompt")
            low, high = value_range(step.token_ids)
            if low < 0 or high >= vocab_size:
                raise StepError(f"{what}: a token id is outside the vocabulary [0, {vocab_size})")
            tokens[rid] = tokens.get(rid, 0) + len(step.token_ids)
            if tokens[rid] > max_tokens:
                raise StepError(f"{what}: its steps hold {tokens[rid]} tokens; a sample holds at most sampling.max_tokens = {max_tokens}")
            lengths[rid] = posted + 1
            if len(lengths) > max_samples:
                raise StepError(f"steps of {len(lengths)} samples for lease {lease.lease_id!r}; its unit holds {max_samples}")
            fresh.append(step)
        for step in fresh:
            self.add(lease.lease_id, holder, step)
        return fresh, duplicates

    def add(self, lease_id: str, holder: str, step: PartialStep) -> Chain:
        """Take one step (checked, or recovered from the journal)."""
        chain = self.chains.get(step.rollout_id)
        if chain is None:
            assert step.prompt_token_ids is not None
            chain = self.chains[step.rollout_id] = Chain(lease_id, holder, list(step.prompt_token_ids))
        chain.steps.append(step)
        return chain

    def judged(self, verdict: StepVerdictTaken, seq: int | None = None) -> StepVerdict | None:
        """A verdict on a step of a chain still held: numbered, kept for its worker. None: the
        chain is gone (its lease closed meanwhile)."""
        chain = self.chains.get(verdict.rollout_id)
        if chain is None:
            return None
        seq = self.seq + 1 if seq is None else seq
        self.seq = max(self.seq, seq)
        chain.scores[verdict.step] = verdict.score
        told = StepVerdict(lease_id=verdict.lease_id, rollout_id=verdict.rollout_id, step=verdict.step,
                           score=verdict.score, seq=seq)
        self.verdicts.setdefault(chain.holder, []).append(told)
        return told

    def for_holder(self, holder: str, after: int) -> list[StepVerdict]:
        return [verdict for verdict in self.verdicts.get(holder, ()) if verdict.seq > after]

    def verdicts_of(self, rollout: Rollout) -> list[float | None] | None:
        """The journaled verdict of each step a finished sample names (`step_ends`; None where a
        step is not judged yet), or None when its posted steps are not its steps: none posted, fewer
        than it names, another prompt, or other tokens."""
        chain, ends = self.chains.get(rollout.rollout_id), rollout.step_ends
        if chain is None or ends is None or len(chain.steps) < len(ends):
            return None
        if list(chain.prompt_token_ids) != list(rollout.prompt_token_ids):
            return None
        ids, start = rollout.completion_token_ids, 0
        for step, end in zip(chain.steps, ends, strict=False):
            if list(ids[start:end]) != list(step.token_ids):
                return None
            start = end
        return [chain.scores.get(step) for step in range(len(ends))]

    def drop(self, lease_id: str) -> list[tuple[str, int]]:
        """A lease closed: its chains and their verdicts go; the keys of its steps, for the queue."""
        gone = [rid for rid, chain in self.chains.items() if chain.lease_id == lease_id]
        keys = [(rid, step.step) for rid in gone for step in self.chains.pop(rid).steps]
        for holder, verdicts in list(self.verdicts.items()):
            kept = [verdict for verdict in verdicts if verdict.lease_id != lease_id]
            if kept:
                self.verdicts[holder] = kept
            else:
                del self.verdicts[holder]
        return keys
