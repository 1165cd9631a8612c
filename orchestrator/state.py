"""The orchestrator's core: prompt leases, rollout ingest, scoring, group assembly, batches.

Plain synchronous code with no HTTP in it; `orchestrator.routes` calls it from the event loop
(one thread, so no locks). Invariants:
- a group is one lease: `group_size` samples of one prompt, all answered by the lease holder;
- a rollout is scored here with the task's verifier, never with the worker's claimed reward;
- a group is served to the trainer at most once, and only if every sample is fresh for the
  trainer's version;
- no more groups are leased than can be consumed without going stale (`lease_budget`).
"""

from __future__ import annotations

import random
import time
import uuid
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerBase

from decentrl.advantages import group_advantages
from decentrl.config import RunConfig
from decentrl.staleness import is_fresh, lease_budget, staleness
from decentrl.tasks import Task
from decentrl.wire import (
    IngestResponse,
    Lease,
    Rejection,
    Rollout,
    SamplingParams,
    StatusResponse,
    TrainBatch,
    TrainSample,
)


@dataclass
class OpenLease:
    lease: Lease
    holder: str  # token name + worker id: only the holder may answer
    samples: list[tuple[Rollout, float]] = field(default_factory=list)


@dataclass
class Group:
    prompt_id: int
    samples: list[tuple[Rollout, float]]  # (rollout, reward)

    def oldest_version(self) -> int:
        return min(rollout.policy_version for rollout, _ in self.samples)


class RunState:
    def __init__(
        self,
        *,
        config: RunConfig,
        task: Task,
        tokenizer: PreTrainedTokenizerBase,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        self.task = task
        self.tokenizer = tokenizer
        self.clock = clock
        self.started_at = clock()
        self.sampling = SamplingParams(**config.sampling.model_dump())
        self.published_version: int | None = None
        self.trainer_version = 0
        self.leases: dict[str, OpenLease] = {}
        self.ready: deque[Group] = deque()
        self.seen_rollout_ids: set[str] = set()
        self.completed_leases: set[str] = set()  # a complete group's lease is closed, not unknown
        self._prompt_order = list(range(task.num_prompts))
        random.Random(config.task.seed).shuffle(self._prompt_order)
        self._prompt_cursor = 0
        self._requeued: deque[int] = deque()  # prompts of expired leases go out first
        self.rollouts_accepted = 0
        self.rejected: Counter[str] = Counter()
        self.stale_dropped = 0
        self.groups_served = 0
        self.leases_expired = 0
        self.recent_rewards: deque[float] = deque(maxlen=512)

    # -- leases ---------------------------------------------------------------------------

    def _next_prompt_id(self) -> int:
        if self._requeued:
            return self._requeued.popleft()
        prompt_id = self._prompt_order[self._prompt_cursor % len(self._prompt_order)]
        self._prompt_cursor += 1
        return prompt_id

    def lease_capacity(self) -> int:
        if self.published_version is None:
            return 0
        committed = self.groups_served + len(self.ready) + len(self.leases)
        return lease_budget(
            self.published_version,
            self.config.max_staleness,
            self.config.trainer.groups_per_step,
            committed,
        )

    def grant_leases(self, holder: str, max_groups: int) -> list[Lease]:
        self.expire_leases()
        granted = []
        for _ in range(min(max_groups, self.lease_capacity())):
            prompt_id = self._next_prompt_id()
            prompt = self.task.prompt(prompt_id)
            lease = Lease(
                lease_id=uuid.uuid4().hex,
                prompt_id=prompt_id,
                prompt_token_ids=self.tokenizer(prompt.text).input_ids,
                group_size=self.config.group_size,
                deadline=self.clock() + self.config.orchestrator.lease_timeout_s,
            )
            self.leases[lease.lease_id] = OpenLease(lease=lease, holder=holder)
            granted.append(lease)
        return granted

    def expire_leases(self) -> None:
        """Drop overdue leases and lease their prompts again; a late answer is rejected."""
        now = self.clock()
        for lease_id in [k for k, v in self.leases.items() if v.lease.deadline < now]:
            self._requeued.append(self.leases.pop(lease_id).lease.prompt_id)
            self.leases_expired += 1

    # -- ingest ---------------------------------------------------------------------------

    def _check(self, rollout: Rollout, holder: str) -> str | None:
        """The reason to reject a rollout, or None to accept it."""
        if rollout.run_name != self.config.run_name:
            return "wrong_run"
        open_lease = self.leases.get(rollout.lease_id)
        if open_lease is None:
            return "group_full" if rollout.lease_id in self.completed_leases else "unknown_or_expired_lease"
        lease = open_lease.lease
        if open_lease.holder != holder:
            return "not_lease_holder"
        if rollout.prompt_id != lease.prompt_id or rollout.prompt_token_ids != lease.prompt_token_ids:
            return "prompt_mismatch"
        if rollout.sampling != self.sampling:
            return "sampling_mismatch"
        if self.published_version is None or rollout.policy_version > self.published_version:
            return "future_version"
        if not is_fresh(self.trainer_version, rollout.policy_version, self.config.max_staleness):
            return "stale"
        vocab = len(self.tokenizer)
        if any(not 0 <= t < vocab for t in rollout.completion_token_ids):
            return "token_out_of_vocabulary"
        if len(rollout.completion_token_ids) > self.sampling.max_tokens:
            return "too_many_tokens"
        return None

    def ingest(self, rollouts: list[Rollout], holder: str) -> IngestResponse:
        self.expire_leases()
        accepted, duplicates, rejected = 0, 0, []
        for rollout in rollouts:
            if rollout.rollout_id in self.seen_rollout_ids:
                duplicates += 1
                continue
            reason = self._check(rollout, holder)
            if reason is not None:
                self.rejected[reason] += 1
                if reason == "stale":
                    # The group can no longer train as a whole: free its slot at once
                    # rather than hold it until the lease expires.
                    dropped = self.leases.pop(rollout.lease_id)
                    self.stale_dropped += 1 + len(dropped.samples)
                    self._requeued.append(dropped.lease.prompt_id)
                rejected.append(Rejection(rollout_id=rollout.rollout_id, reason=reason))
                continue
            self.seen_rollout_ids.add(rollout.rollout_id)
            open_lease = self.leases[rollout.lease_id]
            open_lease.samples.append((rollout, self._score(rollout)))
            accepted += 1
            if len(open_lease.samples) == open_lease.lease.group_size:
                del self.leases[rollout.lease_id]
                self.completed_leases.add(rollout.lease_id)
                self.ready.append(Group(prompt_id=open_lease.lease.prompt_id, samples=open_lease.samples))
        self.rollouts_accepted += accepted
        return IngestResponse(accepted=accepted, duplicates=duplicates, rejected=rejected)

    def _score(self, rollout: Rollout) -> float:
        text = self.tokenizer.decode(rollout.completion_token_ids, skip_special_tokens=True)
        return self.task.reward(self.task.prompt(rollout.prompt_id), text)

    # -- trainer side ---------------------------------------------------------------------

    def advance(self, trainer_version: int) -> None:
        """The trainer now holds `trainer_version`: evict groups that can no longer train."""
        self.trainer_version = max(self.trainer_version, trainer_version)
        fresh = deque()
        for group in self.ready:
            if is_fresh(self.trainer_version, group.oldest_version(), self.config.max_staleness):
                fresh.append(group)
            else:
                self.stale_dropped += len(group.samples)
        self.ready = fresh

    def announce(self, version: int) -> None:
        """Version `version` is complete in the store; workers may pull it."""
        self.published_version = max(version, self.published_version or 0)
        self.advance(version)

    def take_batch(self, trainer_version: int) -> TrainBatch | None:
        """The next `groups_per_step` fresh groups, oldest first, or None if not enough yet."""
        self.advance(trainer_version)
        wanted = self.config.trainer.groups_per_step
        if len(self.ready) < wanted:
            return None
        groups = [self.ready.popleft() for _ in range(wanted)]
        self.groups_served += wanted
        samples, histogram = [], Counter()
        for group in groups:
            rewards = [reward for _, reward in group.samples]
            advantages = group_advantages(rewards, normalize_std=self.config.trainer.advantages.normalize_std)
            for (rollout, reward), advantage in zip(group.samples, advantages):
                samples.append(
                    TrainSample(
                        prompt_token_ids=rollout.prompt_token_ids,
                        completion_token_ids=rollout.completion_token_ids,
                        logprobs=rollout.logprobs,
                        advantage=advantage,
                        reward=reward,
                        policy_version=rollout.policy_version,
                        group_id=rollout.lease_id,
                    )
                )
                histogram[str(staleness(self.trainer_version, rollout.policy_version))] += 1
                self.recent_rewards.append(reward)
        return TrainBatch(
            trainer_version=self.trainer_version,
            samples=samples,
            staleness_histogram=dict(sorted(histogram.items())),
            rollouts_accepted=self.rollouts_accepted,
            stale_dropped=self.stale_dropped,
        )

    def status(self) -> StatusResponse:
        rewards = list(self.recent_rewards)
        return StatusResponse(
            run_name=self.config.run_name,
            policy_version=self.published_version,
            trainer_version=self.trainer_version,
            rollouts_accepted=self.rollouts_accepted,
            rollouts_rejected=dict(self.rejected),
            stale_dropped=self.stale_dropped,
            groups_ready=len(self.ready),
            groups_served=self.groups_served,
            leases_active=len(self.leases),
            leases_expired=self.leases_expired,
            reward_mean_recent=sum(rewards) / len(rewards) if rewards else None,
            uptime_s=self.clock() - self.started_at,
        )
