"""Advantages from rewards: group-relative (GRPO), leave-one-out (RLOO), batch-normalized
(REINFORCE++); over a tree of a root and branches from pivots (DEEP-GRPO); per token, from step
scores, for process rewards, and from a teacher's log-probs, for on-policy distillation; DAPO's
overlong shaping.

The orchestrator builds each batch's advantages (orchestrator/batches.py `build_batch`): it shapes
the rewards (`overlong_penalty`, with `[orchestrator.advantages.overlong]`), turns the batch's
groups of rewards into advantages with the estimator `[orchestrator.advantages] type` names
(`ESTIMATORS`), and calls `process_advantages` when a scorer also gave the group's samples one
score per step (decentrl/rl/steps.py splits the steps) and `distill_advantages` when a teacher
scorer gave the log-prob of every completion token, so the trainer receives ready advantages;
the trainer calls `informative_samples` to drop the groups with no policy-gradient signal when
`[trainer.advantages]` drop_zero_variance is set.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Callable

from decentrl.config import AdvantageConfig, OverlongConfig
from decentrl.config.distill import DistillConfig


def group_advantages(rewards: list[float], normalize_std: bool = False, eps: float = 1e-6) -> list[float]:
    """GRPO (Shao et al. 2024, arXiv 2402.03300): A_i = r_i - mean(r) of one group; with
    normalize_std, divided by the group's (population) std + eps."""
    return _normalize(rewards, normalize_std, eps)


def rloo_advantages(rewards: list[float]) -> list[float]:
    """RLOO (Ahmadian et al. 2024, "Back to Basics", arXiv 2402.14740, eq. 4) for one group of G:
    A_i = r_i - 1/(G-1) sum_{j != i} r_j = G/(G-1) * (r_i - mean(r)), an unbiased baseline that
    does not contain the sample's own reward. A group of one has no other sample: 0."""
    if len(rewards) < 2:
        return [0.0] * len(rewards)
    scale = len(rewards) / (len(rewards) - 1)
    return [scale * a for a in _normalize(rewards, False, 0.0)]


def reinforce_pp_advantages(groups: list[list[float]], eps: float = 1e-6) -> list[list[float]]:
    """REINFORCE++ (Hu 2025, arXiv 2501.03262), outcome reward, no critic: every reward of the
    batch whitened by the batch's mean and (population) std + eps, A = (r - mean_B) / std_B.
    Groups play no part: an all-correct group still gets positive advantages."""
    flat = _normalize([r for rewards in groups for r in rewards], True, eps)
    return _regroup(flat, groups)


def reinforce_pp_baseline_advantages(groups: list[list[float]], eps: float = 1e-6) -> list[list[float]]:
    """REINFORCE++-baseline (Hu 2025, arXiv 2501.03262): each reward minus its group's mean, then
    divided by the (population) std + eps of those centered values over the whole batch,
    A_i = (r_i - mean_group(r)) / std_B. A group of equal rewards gets exactly 0."""
    centered = [a for rewards in groups for a in _normalize(rewards, False, 0.0)]
    if not any(centered):
        return _regroup(centered, groups)
    scale = statistics.pstdev(centered) + eps
    return _regroup([a / scale for a in centered], groups)


def _regroup(flat: list[float], groups: list[list[float]]) -> list[list[float]]:
    result, offset = [], 0
    for rewards in groups:
        result.append(flat[offset : offset + len(rewards)])
        offset += len(rewards)
    return result


# A batch's groups of rewards -> their advantages, by `[orchestrator.advantages] type`.
ESTIMATORS: dict[str, Callable[[list[list[float]], AdvantageConfig], list[list[float]]]] = {
    "grpo": lambda groups, config: [group_advantages(rewards, config.normalize_std) for rewards in groups],
    "rloo": lambda groups, config: [rloo_advantages(rewards) for rewards in groups],
    "reinforce_pp": lambda groups, config: reinforce_pp_advantages(groups),
    "reinforce_pp_baseline": lambda groups, config: reinforce_pp_baseline_advantages(groups),
}


def tree_advantages(
    rewards: list[float], pivots: list[object | None], local_weight: float, normalize_std: bool = False, eps: float = 1e-6
) -> list[float]:
    """A tree unit's advantages (DEEP-GRPO's dual stream, Guo et al. 2026, arXiv 2602.14169): the
    root's samples (`pivots[i]` None) form the global group, each pivot's branches (the samples
    whose `pivots[i]` is that pivot) a local group of their own:

        A_i = r_i - mean(r over the root's samples)                  for a root sample
        A_i = lambda * (r_i - mean(r over the branches of its pivot))   for a branch sample

    each centered value divided by its group's (population) std + eps with `normalize_std`, and 0
    in a group of equal rewards. A branch's prefix is its prompt, so it carries no gradient (the
    trainer never sees it as completion); the loss is global + lambda x local as written, one
    term per sample."""
    if len(rewards) != len(pivots):
        raise ValueError(f"{len(rewards)} rewards for {len(pivots)} samples")
    groups: dict[object | None, list[int]] = defaultdict(list)
    for i, pivot in enumerate(pivots):
        groups[pivot].append(i)
    if None not in groups:
        raise ValueError("a tree has root samples (pivot None); these are all branches")
    result = [0.0] * len(rewards)
    for pivot, members in groups.items():
        weight = 1.0 if pivot is None else local_weight
        for i, value in zip(members, _normalize([rewards[i] for i in members], normalize_std, eps), strict=True):
            result[i] = weight * value
    return result


def overlong_penalty(length: int, config: OverlongConfig) -> float:
    """DAPO's soft overlong punishment (Yu et al. 2025, arXiv 2503.14476, eq. 13) of a completion
    of `length` tokens, added to its reward: with L_max = max_length, L_cache = cache,

        R_len(L) = 0                              if L <= L_max - L_cache
                 = ((L_max - L_cache) - L) / L_cache   if L_max - L_cache < L <= L_max
                 = -1                             if L > L_max

    times `penalty`. Long answers are discouraged gradually instead of all scoring 0 at the cut."""
    start = config.max_length - config.cache
    if length <= start:
        return 0.0
    if length <= config.max_length:
        return config.penalty * (start - length) / config.cache
    return -config.penalty


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


def distill_advantages(
    teacher_logprobs: list[float] | None,
    student_logprobs: list[float],
    loss_mask: list[int] | None,
    outcome_advantage: float,
    config: DistillConfig,
    baseline: list[float] | None = None,
) -> list[float]:
    """Per-token advantages of one sample under on-policy distillation (Agarwal et al. 2024, GKD,
    arXiv 2306.13649; Thinking Machines, "On-Policy Distillation", 2025): token t gets

        A_t = m_t * (weight * (clip(teacher_t - student_t) - b_t) + outcome_weight * A)

    where teacher_t is the teacher's log-prob of the sampled token given the prompt and the tokens
    before it, student_t the student's sampling log-prob (the worker's `Rollout.logprobs`), clip
    bounds the difference to [-clip, clip] when `config.clip` is set, b_t the `baseline` at
    position t (0 without one: `distill_baseline`), A the sample's outcome
    advantage and m_t its loss mask (1 without one). teacher_t - student_t is the one-sample
    estimate of -KL(student || teacher) at position t: the policy gradient with it as the advantage
    lowers the reverse KL on the student's own samples. A sample the teacher could not score
    (`teacher_logprobs` None: a failure the run scored by default) keeps outcome_weight * A alone.
    """
    n = len(student_logprobs)
    if teacher_logprobs is not None and len(teacher_logprobs) != n:
        raise ValueError(f"{len(teacher_logprobs)} teacher log-probs for {n} completion tokens (one per token)")
    if loss_mask is not None and len(loss_mask) != n:
        raise ValueError(f"loss mask of {len(loss_mask)} for {n} completion tokens")
    outcome = config.outcome_weight * outcome_advantage
    result = []
    for t in range(n):
        if loss_mask is not None and not loss_mask[t]:
            result.append(0.0)
            continue
        gap = 0.0 if teacher_logprobs is None else _gap(teacher_logprobs[t], student_logprobs[t], config)
        if teacher_logprobs is not None and baseline is not None and t < len(baseline):
            gap -= baseline[t]
        result.append(config.weight * gap + outcome)
    return result


def distill_baseline(
    teacher_logprobs: list[list[float] | None], student_logprobs: list[list[float]], loss_masks: list[list[int] | None],
    config: DistillConfig,
) -> list[float] | None:
    """`baseline = "group"`: at each position t, the mean (clipped) teacher-minus-student gap over
    the group's samples graded and unmasked at t - the group answers one prompt, so a token is
    credited for how much better the teacher finds it than its siblings' at the same place. None
    for `baseline = "none"`."""
    if config.baseline == "none":
        return None
    sums: list[float] = []
    counts: list[int] = []
    for teacher, student, mask in zip(teacher_logprobs, student_logprobs, loss_masks, strict=True):
        if teacher is None:
            continue
        for t, (a, b) in enumerate(zip(teacher, student, strict=True)):
            if mask is not None and not mask[t]:
                continue
            while len(sums) <= t:
                sums.append(0.0)
                counts.append(0)
            sums[t] += _gap(a, b, config)
            counts[t] += 1
    return [total / count if count else 0.0 for total, count in zip(sums, counts, strict=True)]


def _gap(teacher: float, student: float, config: DistillConfig) -> float:
    """teacher - student log-prob of one token, bounded to [-clip, clip] when `config.clip` is set."""
    gap = teacher - student
    return gap if config.clip is None else min(max(gap, -config.clip), config.clip)


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


# Units whose nodes have roles (a proposer and its solvers, docs/architecture.md "The unit of work,
# widened"): the proposer's reward from its solvers' results, the batch's repetition penalty, and
# advantages with a baseline per role and task kind.


def learnability(solve_rewards: list[float], rule: str) -> float:
    """A valid proposal's reward from its solvers' rewards, p = their mean (each in [0, 1]):

    - `absolute_zero` (Zhao et al. 2025, arXiv 2505.03335, the learnability reward): 1 - p if 0 < p < 1, else 0 -
      a problem every solver gets, or none does, teaches nothing;
    - `r_zero` (Huang et al. 2025, arXiv 2508.05004, the uncertainty reward): 1 - 2 |p - 1/2| = 2 min(p, 1 - p),
      highest where the solvers agree least.
    No solver result (a node closed with none in): 0."""
    if not solve_rewards:
        return 0.0
    p = statistics.fmean(solve_rewards)
    if rule == "absolute_zero":
        return 1.0 - p if 0.0 < p < 1.0 else 0.0
    if rule == "r_zero":
        return 1.0 - 2.0 * abs(p - 0.5)
    raise ValueError(f"learnability rule {rule!r}: use 'absolute_zero' or 'r_zero'")


def repetition_penalties(proposals: list[str | None], weight: float) -> list[float]:
    """R-Zero's repetition penalty (arXiv 2508.05004) over a batch of B proposals:
    r_rep(x_i) = weight * |C(x_i)| / B, where C(x_i) is the cluster holding x_i. R-Zero clusters by
    BLEU distance; a proposal here is the task's canonical form of a problem (the same problem
    written differently is one form), so a cluster is the proposals of one form. An invalid
    proposal (None) is in no cluster and gets 0; it is still counted in B."""
    counts: dict[str, int] = defaultdict(int)
    for proposal in proposals:
        if proposal is not None:
            counts[proposal] += 1
    size = len(proposals)
    return [0.0 if proposal is None else weight * counts[proposal] / size for proposal in proposals]


def roles_advantages(
    nodes: list[list[float]], keys: list[str], baselines: dict[str, float], *, single: str, decay: float,
    normalize_std: bool = False, eps: float = 1e-6,
) -> tuple[list[list[float]], dict[str, float]]:
    """Advantages of a batch's nodes of roles: `nodes[i]` the rewards of node i's samples, `keys[i]`
    its task kind and role ("kind/role"), `baselines` the role-conditioned baselines so far.
    Returns the advantages, node by node, and the baselines after this batch (a new dict).

    A node of two or more samples (one proposal's solvers) answers one prompt: its baseline is its
    own mean (GRPO, over its std + eps with normalize_std). A node of one sample (the proposer) has
    no siblings; its baseline is conditioned on its kind and role, by `single`:
    - `rae`: SPIRAL's role-conditioned advantage estimation (Liu et al. 2025, arXiv 2506.24119),
      an exponential moving average per kind and role, updated first, in batch order:
      b <- decay * b + (1 - decay) * r, then A = r - b (b starts at 0);
    - `batch`: Absolute Zero's task-relative REINFORCE++ (arXiv 2505.03335), the mean (and
      with normalize_std the std) over the batch's one-sample nodes of the same kind and role:
      A = (r - mean_key) [/ (std_key + eps)].
    """
    if len(nodes) != len(keys):
        raise ValueError(f"{len(nodes)} nodes for {len(keys)} keys (one kind/role per node)")
    if single not in ("rae", "batch"):
        raise ValueError(f"single-sample baseline {single!r}: use 'rae' or 'batch'")
    result: list[list[float]] = [[] for _ in nodes]
    updated = dict(baselines)
    by_key: dict[str, list[int]] = defaultdict(list)
    for i, (rewards, key) in enumerate(zip(nodes, keys, strict=True)):
        if len(rewards) > 1:
            result[i] = _normalize(rewards, normalize_std, eps)
        elif len(rewards) == 1 and single == "rae":
            b = decay * updated.get(key, 0.0) + (1.0 - decay) * rewards[0]
            updated[key] = b
            result[i] = [rewards[0] - b]
        elif len(rewards) == 1:
            by_key[key].append(i)
    for members in by_key.values():
        centred = _normalize([nodes[i][0] for i in members], normalize_std, eps)
        for i, advantage in zip(members, centred, strict=True):
            result[i] = [advantage]
    return result, updated
