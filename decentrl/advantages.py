"""Group-relative advantages (GRPO): each sample's reward minus its group's mean.

Called by the orchestrator when a group is complete, so the trainer receives ready advantages.
"""

from __future__ import annotations

import statistics


def group_advantages(rewards: list[float], normalize_std: bool = False, eps: float = 1e-6) -> list[float]:
    """Advantages of one group; with normalize_std, divided by the group's (population) std."""
    mean = statistics.fmean(rewards)
    centered = [r - mean for r in rewards]
    if not normalize_std:
        return centered
    std = statistics.pstdev(rewards)
    return [c / (std + eps) for c in centered]
