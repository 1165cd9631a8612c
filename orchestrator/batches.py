"""The trainer's side: batches built with advantages, and batches kept for re-asks.

RunState takes the `places_per_step` groups at the front of the ready queue, picks those it trains
(`pick_signal`), builds the batch (`build_batch`) and keeps it (`KeptBatches`). Invariants:
- a served batch is journaled before it is sent, and the last `batches_kept` are kept by request
  id, so a re-ask with the same request id gets the same batch, never a second one;
- advantages are computed here, when the batch is built: the one place that reads their setting;
- a batch is encoded with its samples' arrays as they came (orchestrator/codec.py), not packed again.
"""

from __future__ import annotations

import functools
from collections import Counter, OrderedDict, defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from decentrl.api.encoding import pack_ints
from decentrl.api.wire import ROOT_NODE, BranchParent, Rollout, StaleReport, TrainBatch, TrainSample
from decentrl.config import AdvantageConfig
from decentrl.rl.advantages import (
    ESTIMATORS,
    distill_advantages,
    distill_baseline,
    overlong_penalty,
    process_advantages,
    roles_advantages,
    tree_advantages,
)
from decentrl.rl.staleness import staleness
from orchestrator.buffer import Group
from orchestrator.codec import train_batch_msgpack
from orchestrator.events import BatchForgotten, BatchServed, Journaling


@dataclass
class ServedBatch:
    """A batch kept for re-asks; one recovered from the journal is built only when asked again."""

    batch_id: str
    groups: list[Group]
    build: Callable[[], TrainBatch]

    @functools.cached_property
    def batch(self) -> TrainBatch:
        return self.build()

    @property
    def lease_ids(self) -> list[str]:
        return [group.lease_id for group in self.groups]

    def msgpack(self) -> bytes:
        prompts = {group.lease_id: pack_ints(group.rollouts[0].prompt_token_ids) for group in self.groups if group.size}
        lengths = {group.lease_id: len(group.rollouts[0].prompt_token_ids) for group in self.groups if group.size}
        return train_batch_msgpack(self.batch, prompts, lengths)


def has_signal(group: Group) -> bool:
    """Whether a group teaches anything under a group baseline: its rewards differ within a node
    (a tree's roots, or one pivot's branches: each node is centred on its own mean, so a tree whose
    roots agree and whose every pivot's branches agree among themselves has none), (process
    rewards) its step scores differ, or (on-policy distillation) a teacher graded its tokens."""
    if group.teacher_logprobs is not None:
        return True
    nodes: dict[tuple[str, int] | None, list[float]] = defaultdict(list)
    for rollout, reward in zip(group.rollouts, group.rewards, strict=True):
        nodes[_pivot_of(rollout)].append(reward)
    if any(max(rewards) > min(rewards) for rewards in nodes.values()):
        return True
    scores = [score for steps in group.step_scores or [] if steps for score in steps]
    return bool(scores) and max(scores) > min(scores)


def pick_signal(window: list[Group], wanted: int) -> tuple[list[Group], list[tuple[Group, str]]]:
    """DAPO's dynamic sampling over the groups one step consumes, in their order: the first
    `wanted` with a signal, topped up in order with those without one (a step always trains
    `wanted` groups); the others, each with why it is dropped (`zero_signal` or `surplus`). A pure
    function of the rewards, so a deterministic run skips the same groups in every replay."""
    signal = [has_signal(group) for group in window]
    chosen = [i for i, yes in enumerate(signal) if yes][:wanted]
    chosen += [i for i, yes in enumerate(signal) if not yes][:wanted - len(chosen)]
    picked = set(chosen)
    train = [group for i, group in enumerate(window) if i in picked]
    dropped = [(group, "surplus" if signal[i] else "zero_signal") for i, group in enumerate(window) if i not in picked]
    return train, dropped


def build_batch(
    groups: list[Group], *, trainer_version: int, batch_id: str, advantages: AdvantageConfig,
    rollouts_accepted: int, stale_dropped: int, stale_report: StaleReport | None = None,
    baselines: Mapping[str, float] | None = None,
) -> TrainBatch:
    """`baselines`: units of roles, the role-conditioned baselines before this batch (`roles_outcome`)."""
    samples, histogram = [], Counter()
    rewards = [shaped_rewards(group, advantages) for group in groups]
    outcomes = roles_outcome(groups, rewards, advantages, baselines or {})[0] if advantages.type == "roles" else [
        tree_advantages(group_rewards, pivots, advantages.local_weight, advantages.normalize_std)
        if any(pivots := [_pivot_of(rollout) for rollout in group.rollouts]) else outcome
        for group, group_rewards, outcome in zip(groups, rewards, ESTIMATORS[advantages.type](rewards, advantages), strict=True)
    ]
    for group, group_rewards, outcome in zip(groups, rewards, outcomes, strict=True):
        per_token = token_advantages(group, outcome, advantages)
        for rollout, reward, advantage, tokens in zip(group.rollouts, group_rewards, outcome, per_token, strict=True):
            truncated = advantages.mask_truncated and rollout.finish_reason == "length"
            # Fields were validated at ingest: construct without copying the token lists.
            samples.append(
                TrainSample.model_construct(
                    prompt_token_ids=rollout.prompt_token_ids,
                    completion_token_ids=rollout.completion_token_ids,
                    logprobs=rollout.logprobs,
                    advantage=advantage,
                    reward=reward,
                    policy_version=rollout.policy_version,
                    group_id=rollout.lease_id,
                    rollout_id=rollout.rollout_id,
                    sampling_mask=rollout.sampling_mask,
                    loss_mask=[0] * len(rollout.completion_token_ids) if truncated else rollout.loss_mask,
                    expert_routing=rollout.expert_routing,
                    token_advantages=tokens,
                )
            )
            histogram[str(staleness(trainer_version, rollout.policy_version))] += 1
    return TrainBatch(
        trainer_version=trainer_version,
        samples=samples,
        staleness_histogram=dict(sorted(histogram.items())),
        rollouts_accepted=rollouts_accepted,
        stale_dropped=stale_dropped,
        stale_report=stale_report,
        batch_id=batch_id,
    )


def _pivot_of(rollout: Rollout) -> tuple[str, int] | None:
    """A tree's branch sample: its pivot (parent rollout id, tokens in); None for a root sample."""
    parent = rollout.node.parent if rollout.node is not None else None
    return (parent.rollout_id, parent.at) if isinstance(parent, BranchParent) else None


def roles_outcome(
    groups: list[Group], rewards: list[list[float]], config: AdvantageConfig, baselines: Mapping[str, float],
) -> tuple[list[list[float]], dict[str, float]]:
    """Units of roles: each group's samples by node (a derived node's id; the root's otherwise),
    each node keyed by its role, through `roles_advantages` (decentrl/rl/advantages.py); the
    advantages, group by group in sample order, and the baselines after the batch. A run has one
    task, so the role alone is the key of its kind and role."""
    nodes, keys, places = [], [], []
    for g, (group, group_rewards) in enumerate(zip(groups, rewards, strict=True)):
        members: dict[str, list[int]] = {}
        for i, rollout in enumerate(group.rollouts):
            node = rollout.node
            members.setdefault(node.node_id if node is not None and node.parent is not None else ROOT_NODE, []).append(i)
        for indices in members.values():
            node = group.rollouts[indices[0]].node
            nodes.append([group_rewards[i] for i in indices])
            keys.append((node.role if node is not None else None) or "proposer")
            places.append((g, indices))
    per_node, after = roles_advantages(
        nodes, keys, dict(baselines), single=config.single, decay=config.decay, normalize_std=config.normalize_std
    )
    result = [[0.0] * len(group_rewards) for group_rewards in rewards]
    for (g, indices), values, key in zip(places, per_node, keys, strict=True):
        for i, value in zip(indices, values, strict=True):
            result[g][i] = 0.0 if key in config.frozen_roles else value
    return result, after


def shaped_rewards(group: Group, config: AdvantageConfig) -> list[float]:
    """The group's rewards, plus DAPO's overlong punishment when `advantages.overlong` is set."""
    if config.overlong is None:
        return group.rewards
    return [
        reward + overlong_penalty(len(rollout.completion_token_ids), config.overlong)
        for rollout, reward in zip(group.rollouts, group.rewards, strict=True)
    ]


def token_advantages(group: Group, outcome: list[float], config: AdvantageConfig) -> list[list[float] | None]:
    """Per-token advantages of the group's samples, or None for a sample that trains on its
    outcome advantage alone: on-policy distillation gives every sample its teacher's; process
    rewards give those scored per step theirs (normalized over those samples' steps)."""
    if config.distill is not None:
        teacher = group.teacher_logprobs or [None] * group.size
        rollouts = group.rollouts
        baseline = distill_baseline(teacher, [r.logprobs for r in rollouts], [r.loss_mask for r in rollouts], config.distill)
        return [
            distill_advantages(logprobs, rollout.logprobs, rollout.loss_mask, advantage, config.distill, baseline)
            for rollout, logprobs, advantage in zip(rollouts, teacher, outcome, strict=True)
        ]
    if group.step_scores is None or group.step_ends is None:
        return [None] * group.size
    scored = [i for i, scores in enumerate(group.step_scores) if scores is not None]
    result: list[list[float] | None] = [None] * group.size
    if not scored:
        return result
    rollouts = group.rollouts
    per_token = process_advantages(
        [group.step_scores[i] for i in scored],  # type: ignore[misc]
        [group.step_ends[i] for i in scored],
        [rollouts[i].loss_mask for i in scored],
        [len(rollouts[i].completion_token_ids) for i in scored],
        [outcome[i] for i in scored],
        config,
    )
    for i, values in zip(scored, per_token, strict=True):
        result[i] = values
    return result


class KeptBatches:
    """The last `batches_kept` batches served, by request id, for re-asks."""

    def __init__(self, *, batches_kept: int, journal: Journaling, clock: Callable[[], float]) -> None:
        self.batches_kept = batches_kept
        self.journal = journal
        self.clock = clock
        self.served: OrderedDict[str, ServedBatch] = OrderedDict()  # request id -> batch, newest last
        self.leases: set[str] = set()  # leases of the batches in `served` (not to be forgotten yet)
        self._by_batch_id: dict[str, ServedBatch] = {}
        self.baselines: dict[str, float] = {}  # units of roles: the role-conditioned baselines after the last batch

    def retried(self, request_id: str) -> TrainBatch | None:
        served = self.served.get(request_id)
        return served.batch if served is not None else None

    def msgpack(self, batch: TrainBatch) -> bytes | None:
        """A kept batch as msgpack (None if no longer kept)."""
        served = self._by_batch_id.get(batch.batch_id or "")
        return served.msgpack() if served is not None and served.batch is batch else None

    def served_now(
        self, request_id: str, batch: TrainBatch, groups: list[Group], baselines: dict[str, float] | None = None,
    ) -> None:
        """Journal a batch as served under `request_id` and keep it, forgetting the oldest.
        `baselines`: units of roles, the baselines after it (journaled with it, with those before)."""
        assert batch.batch_id is not None
        self.journal.record(BatchServed(
            request_id,
            self.clock(),
            {
                "batch_id": batch.batch_id,
                "trainer_version": batch.trainer_version,
                "lease_ids": [group.lease_id for group in groups],
                "rewards": [group.rewards for group in groups],
                "rollouts_accepted": batch.rollouts_accepted,
                "stale_dropped": batch.stale_dropped,
                "stale_report": batch.stale_report.model_dump() if batch.stale_report is not None else None,
                **({"baselines": self.baselines, "baselines_after": baselines} if baselines is not None else {}),
            },
        ))
        self.keep(request_id, ServedBatch(batch.batch_id, groups, lambda: batch))
        if baselines is not None:
            self.baselines = baselines
        while len(self.served) > self.batches_kept:
            old_key, old = self.served.popitem(last=False)
            self.leases.difference_update(old.lease_ids)
            self._by_batch_id.pop(old.batch_id, None)
            self.journal.record(BatchForgotten(old_key, old.lease_ids))

    def keep(self, request_id: str, served: ServedBatch) -> None:
        self.served[request_id] = served
        self._by_batch_id[served.batch_id] = served
        self.leases.update(served.lease_ids)
