"""Group-relative advantages (GRPO): each sample's reward minus its group's mean; per token, from
step scores, for process rewards.

The orchestrator calls `group_advantages` when a group is complete (`[orchestrator.advantages]`
normalize_std), and `process_advantages` when a scorer also gave the group's samples one score per
step (decentrl/rl/steps.py splits the steps), so the trainer receives ready advantages; the trainer
calls `informative_samples` to drop the groups with no policy-gradient signal when
`[trainer.advantages]` drop_zero_variance is set.
"""

from __future__ import annotations

import statistics
from collections import defaultdict

from decentrl.config import AdvantageConfig


def group_advantages(rewards: list[float], normalize_std: bool = False, eps: float = 1e-6) -> list[float]:
    """Advantages of one group; with normalize_std, divided by the group's (population) std + eps."""
    return _normalize(rewards, normalize_std, eps)


def process_advantages(
    step_scores: list[list[float]],
    step_ends: list[list[int]],
    loss_masks: list[list[int] | None],
    lengths: list[int],
    outcome_advantages: list[float],
    config: AdvantageConfig,
    eps: float = 1e-6,
) -> list[list[float]]:
    """Per-token advantages of one group from its step scores (one list per sample, in group order).

    `step_scores[i][j]` is the score of step j of sample i, `step_ends[i][j]` the index of that
    step's last completion token (decentrl/rl/steps.py `Steps.ends`: strictly increasing),
    `lengths[i]` the completion's length, `outcome_advantages[i]` the sample's `group_advantages`.
    With every step score r_ij of the group normalized over the group's steps,

        s_ij = (r_ij - mean(r)) [/ (std(r) + eps) with config.normalize_std]   (0 if all r are equal)

    token t of sample i gets

        A_it = m_it * (process_weight * P_it + outcome_weight * A_i)

    where m_it is its loss mask (1 without one), A_i the outcome advantage, and P_it
    - `process = "return"`: sum of s_ij over the steps j with step_ends[i][j] >= t (the process
      supervision of DeepSeekMath, arXiv:2402.03300 section 4.1.3: a token is credited with the
      normalized rewards of its step and of every later step);
    - `process = "step"`: s_ij of the step holding t (the first j with step_ends[i][j] >= t).
    Tokens after a sample's last step (environment tokens after an episode's last turn) have P = 0.
    """
    if not len(step_scores) == len(step_ends) == len(loss_masks) == len(lengths) == len(outcome_advantages):
        raise ValueError("process_advantages needs one entry per sample in every list")
    for scores, ends, length in zip(step_scores, step_ends, lengths, strict=True):
        if not scores or len(scores) != len(ends):
            raise ValueError(f"{len(scores)} step scores for {len(ends)} steps (at least one step, one score each)")
        if any(b <= a for a, b in zip(ends, ends[1:])) or ends[0] < 0 or ends[-1] >= length:
            raise ValueError(f"step ends {ends} are not strictly increasing token indices below {length}")
    normalized = _normalize([score for scores in step_scores for score in scores], config.normalize_std, eps)
    result, offset = [], 0
    for scores, ends, mask, length, outcome in zip(step_scores, step_ends, loss_masks, lengths, outcome_advantages, strict=True):
        steps = normalized[offset : offset + len(scores)]
        offset += len(scores)
        if config.process == "return":
            steps = [sum(steps[j:]) for j in range(len(steps))]  # suffix sums: step j and every later step
        tokens, start = [], 0
        for end, value in zip(ends, steps, strict=True):
            tokens += [value] * (end + 1 - start)
            start = end + 1
        tokens += [0.0] * (length - start)
        result.append([
            (config.process_weight * p + config.outcome_weight * outcome) * (1 if mask is None else mask[t])
            for t, p in enumerate(tokens)
        ])
    return result


def _normalize(values: list[float], normalize_std: bool, eps: float) -> list[float]:
    """Values minus their mean (over their std + eps with normalize_std); exactly 0 when all are equal
    (fmean of three 0.1s is 0.10000000000000002; a constant group must have no signal at all)."""
    if max(values) == min(values):
        return [0.0] * len(values)
    mean = statistics.fmean(values)
    scale = statistics.pstdev(values) + eps if normalize_std else 1.0
    return [(v - mean) / scale for v in values]


def informative_samples(
    rewards: list[float], group_ids: list[str], token_advantages: list[list[float] | None] | None = None
) -> list[bool]:
    """Per sample: does its group carry a policy-gradient signal?

    A group whose samples carry per-token advantages (process rewards) does iff one of them is
    non-zero: equal outcome rewards with different step scores still teach. Any other group does
    iff it holds at least two different rewards: a group of equal rewards has all advantages zero,
    with or without std normalization.
    """
    distinct: dict[str, set[float]] = defaultdict(set)
    per_token: dict[str, bool] = {}  # group -> some token advantage is non-zero (groups with any)
    for i, (reward, group) in enumerate(zip(rewards, group_ids, strict=True)):
        distinct[group].add(reward)
        tokens = token_advantages[i] if token_advantages is not None else None
        if tokens is not None:
            per_token[group] = per_token.get(group, False) or any(tokens)
    return [per_token[group] if group in per_token else len(distinct[group]) > 1 for group in group_ids]
