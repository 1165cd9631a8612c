"""Group-relative advantages (GRPO): each sample's reward minus its group's mean.

The orchestrator calls `group_advantages` when a group is complete (`[orchestrator.advantages]`
normalize_std), so the trainer receives ready advantages; the trainer calls
`informative_samples` to drop the groups whose rewards are all equal (no policy-gradient
signal) when `[trainer.advantages]` drop_zero_variance is set.
"""

from __future__ import annotations

import statistics
from collections import defaultdict


def group_advantages(rewards: list[float], normalize_std: bool = False, eps: float = 1e-6) -> list[float]:
    """Advantages of one group; with normalize_std, divided by the group's (population) std."""
    mean = statistics.fmean(rewards)
    centered = [r - mean for r in rewards]
    if not normalize_std:
        return centered
    std = statistics.pstdev(rewards)
    return [c / (std + eps) for c in centered]


def informative_samples(rewards: list[float], group_ids: list[str]) -> list[bool]:
    """Per sample: does its group hold at least two different rewards?

    A group of equal rewards has all advantages zero, with or without std normalization.
    """
    distinct: dict[str, set[float]] = defaultdict(set)
    for reward, group in zip(rewards, group_ids, strict=True):
        distinct[group].add(reward)
    return [len(distinct[group]) > 1 for group in group_ids]
