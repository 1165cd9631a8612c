"""Policy-gradient losses: small pure functions over padded (B, T) tensors.

Called by the trainer once per micro-batch (decentrl/trainer/step.py). `logprobs` are the
trainer's (with grad) for the sampled tokens, `sampler_logprobs` those the workers sampled with,
`mask` is 1.0 on completion tokens, `advantages` one per token (B, T) - the trainer's batches
always carry them so (decentrl/trainer/batching.py), process rewards giving each token its own - or
one per sample (B,), broadcast over the sample's tokens: one code path either way.

Every loss is a sum over tokens of a per-token term times a normalization weight computed from
whole-batch counts (`BatchTotals`), never from the micro-batch at hand: micro-batches and ranks
then add up to exactly the loss (and gradient) of the whole batch in one piece.

Three choices come from the config, each a table from the section's `type` to a function:
- normalization, `trainer.loss.type`: grpo (sequence mean), token (DAPO), dr_grpo (constant);
- off-policy correction, `trainer.off_policy.type`: tis, icepop, seq_mask. Each turns the
  detached log-ratio log(pi_trainer / pi_sampler) into a per-token weight and keep-mask;
- objective, `trainer.objective.type`: ppo, gspo, cispo. Each turns the same log-ratio (and the
  correction's weight) into the per-token importance weight the REINFORCE term is scaled by and
  a clip-keep mask: PPO clipping (separate eps_low / eps_high, against the sampling policy)
  drops the tokens where the clipped surrogate has no gradient, GSPO clips one ratio per
  sample, CISPO clips the weight and drops nothing.
KL to a reference (k3) and an entropy bonus are optional.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from decentrl.config import (
    CISPOObjectiveConfig,
    GSPOObjectiveConfig,
    IcePopConfig,
    LossConfig,
    ObjectiveConfig,
    OffPolicyConfig,
    PPOObjectiveConfig,
    SeqMaskConfig,
    TISConfig,
)


@dataclass(frozen=True)
class BatchTotals:
    """Counts over the whole batch (every rank, every micro-batch) that losses normalize by."""

    samples: int  # sequences kept for training
    tokens: int  # completion tokens of those sequences
    max_tokens: int  # sampling.max_tokens: Dr.GRPO's constant generation budget


# -- normalization: weights w_bt, the loss is sum_bt w_bt * term_bt ---------------------------


def grpo_weights(mask: torch.Tensor, totals: BatchTotals) -> torch.Tensor:
    """GRPO: mean over each sample's tokens, then mean over samples.  # (B, T)"""
    lengths = mask.sum(dim=1, keepdim=True).clamp(min=1.0)  # (B, 1)
    return mask / lengths / max(totals.samples, 1)


def token_weights(mask: torch.Tensor, totals: BatchTotals) -> torch.Tensor:
    """Token-level (DAPO): mean over every completion token of the batch, so long answers weigh more.  # (B, T)"""
    return mask / max(totals.tokens, 1)


def dr_grpo_weights(mask: torch.Tensor, totals: BatchTotals) -> torch.Tensor:
    """Dr.GRPO: a constant divisor (samples * max_tokens), free of the length bias of per-sample means.  # (B, T)"""
    return mask / (max(totals.samples, 1) * totals.max_tokens)


NORMALIZATIONS: dict[str, Callable[[torch.Tensor, BatchTotals], torch.Tensor]] = {
    "grpo": grpo_weights,
    "token": token_weights,
    "dr_grpo": dr_grpo_weights,
}


# -- off-policy correction: (weight, keep) per token from the detached log-ratio ----------------


def tis_correction(log_ratio: torch.Tensor, mask: torch.Tensor, config: TISConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Truncated IS: weight min(ratio, C); keeps every token.  # (B, T), (B, T)

    Corrects for the rollout being sampled by an older or numerically different policy
    (staleness, inference-engine mismatch) while bounding the variance the ratio adds.
    """
    return log_ratio.exp().clamp(max=config.cap), torch.ones_like(mask)


def icepop_correction(log_ratio: torch.Tensor, mask: torch.Tensor, config: IcePopConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """IcePop: weight = ratio inside [low, high]; tokens outside are masked out entirely.  # (B, T), (B, T)"""
    ratio = log_ratio.exp()
    keep = ((ratio >= config.low) & (ratio <= config.high)).to(mask.dtype)
    return ratio, keep


def seq_mask_correction(log_ratio: torch.Tensor, mask: torch.Tensor, config: SeqMaskConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence masking: drop a whole sample whose geometric-mean ratio leaves [low, high];
    the samples kept get truncated IS weights min(ratio, cap).  # (B, T), (B, T)"""
    lengths = mask.sum(dim=1).clamp(min=1.0)  # (B,)
    geometric_mean = ((log_ratio * mask).sum(dim=1) / lengths).exp()  # (B,)
    keep = ((geometric_mean >= config.low) & (geometric_mean <= config.high)).to(mask.dtype)  # (B,)
    return log_ratio.exp().clamp(max=config.cap), keep[:, None].expand_as(mask)


CORRECTIONS: dict[str, Callable[..., tuple[torch.Tensor, torch.Tensor]]] = {
    "tis": tis_correction,
    "icepop": icepop_correction,
    "seq_mask": seq_mask_correction,
}


# -- PPO clipping, KL, entropy -----------------------------------------------------------------


def ppo_clip_keep(log_ratio: torch.Tensor, advantages: torch.Tensor, eps_low: float, eps_high: float) -> torch.Tensor:
    """1.0 where the clipped surrogate min(r A, clip(r, 1-eps_low, 1+eps_high) A) has gradient.  # (B, T)

    `advantages` is per token (B, T): the clip side is chosen by each token's own advantage sign.

    r is pi_trainer / pi_sampler: with one optimizer step per batch, the sampling policy is the
    only "old" policy that differs from the current one. The surrogate's gradient is r A grad(log p)
    inside the trust region and 0 where the clip binds: a positive advantage beyond 1 + eps_high,
    a negative one below 1 - eps_low.
    """
    ratio = log_ratio.exp()
    clipped = ((advantages > 0) & (ratio > 1.0 + eps_high)) | ((advantages < 0) & (ratio < 1.0 - eps_low))
    return (~clipped).to(log_ratio.dtype)


# -- objective: (weight, clip_keep, truncated) per token from the detached log-ratio ---------------
# The REINFORCE term of every objective is -weight * clip_keep * A * log p (weight, clip_keep
# constants); `truncated` marks the tokens whose weight is below or off the ratio it stands for,
# for the is_truncated_fraction statistic.


def ppo_objective(
    log_ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, is_weight: torch.Tensor,
    *, loss: LossConfig, objective: PPOObjectiveConfig,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PPO (Schulman et al. 2017, arXiv 1707.06347) on token ratios: the gradient of
    min(r A, clip(r, 1 - eps_low, 1 + eps_high) A) is r A grad log p inside the trust region and 0
    where the clip binds; r's factor is the off-policy correction's weight.  # (B, T) x 3"""
    truncated = (log_ratio.exp() > is_weight).to(mask.dtype)  # (B, T) TIS cap
    return is_weight, ppo_clip_keep(log_ratio, advantages, loss.eps_low, loss.eps_high), truncated


def gspo_objective(
    log_ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, is_weight: torch.Tensor,
    *, loss: LossConfig, objective: GSPOObjectiveConfig,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization", arXiv 2507.18071), GSPO-token form.

    s_b = exp(1/|y_b| sum_t log(pi / pi_sampler)_bt), one ratio per sample over its completion
    tokens; the token objective is min(s_bt A_bt, clip(s_bt, 1 - eps_low, 1 + eps_high) A_bt) with
    s_bt = sg[s_b] * pi_bt / sg[pi_bt], whose gradient is sg[s_b] A_bt grad log pi_bt, or 0 where
    the clip binds (the whole sample when its advantage is per sample). With per-sample advantages
    and grpo normalization this is the paper's sequence-level GSPO gradient exactly. The token
    ratios' own weight (`is_weight`) is not used: s_b is the importance weight.  # (B, T) x 3
    """
    lengths = mask.sum(dim=1).clamp(min=1.0)  # (B,)
    sequence_log_ratio = ((log_ratio * mask).sum(dim=1) / lengths)[:, None].expand_as(log_ratio)  # (B, T)
    clip_keep = ppo_clip_keep(sequence_log_ratio, advantages, objective.eps_low, objective.eps_high)  # (B, T)
    return sequence_log_ratio.exp(), clip_keep, torch.zeros_like(mask)


def cispo_objective(
    log_ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, is_weight: torch.Tensor,
    *, loss: LossConfig, objective: CISPOObjectiveConfig,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """CISPO (MiniMax-M1, arXiv 2506.13585): per token -sg(clip(r, 1 - eps_low, 1 + eps_high)) A log pi.

    The clip bounds the importance weight instead of zeroing the gradient, so every token (the
    rare "However"/"Wait" tokens PPO clips away after their first update included) keeps its
    REINFORCE gradient. The clipped ratio is the importance weight (`is_weight` is not used).  # (B, T) x 3
    """
    ratio = log_ratio.exp()  # (B, T)
    weight = ratio.clamp(min=1.0 - objective.eps_low, max=1.0 + objective.eps_high)  # (B, T)
    return weight, torch.ones_like(mask), (weight != ratio).to(mask.dtype)


OBJECTIVES: dict[str, Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {
    "ppo": ppo_objective,
    "gspo": gspo_objective,
    "cispo": cispo_objective,
}


def k3_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k3 estimator of KL(pi || pi_ref) per sampled token: e^d - d - 1 with d = log pi_ref - log pi (>= 0).  # (B, T)"""
    delta = ref_logprobs - logprobs
    return delta.exp() - delta - 1.0


# -- the loss ------------------------------------------------------------------------------------


def policy_loss(
    logprobs: torch.Tensor,  # (B, T) trainer logprobs of the sampled tokens, with grad
    sampler_logprobs: torch.Tensor,  # (B, T) workers' sampling logprobs
    advantages: torch.Tensor,  # (B, T) per token, or (B,) per sample
    mask: torch.Tensor,  # (B, T) 1.0 on completion tokens
    *,
    totals: BatchTotals,
    loss: LossConfig,
    off_policy: OffPolicyConfig,
    entropy: torch.Tensor,  # (B, T) entropy of the tempered next-token distribution (grad if entropy_coef)
    ref_logprobs: torch.Tensor | None = None,  # (B, T) reference model, needed iff kl_coef > 0
    kl_coef: float = 0.0,
    entropy_coef: float = 0.0,
    objective: ObjectiveConfig = PPOObjectiveConfig(),  # frozen, so one shared default is safe
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Importance-corrected, clipped policy gradient (+ k3 KL, - entropy bonus), normalized per `loss.type`.

    per token: -w_bt * keep_bt * clip_bt * A_bt * log p_bt + kl_coef * k3_bt - entropy_coef * H_bt,
    with w, keep, clip constants (no gradient): keep from the off-policy correction, w and clip
    from the objective (PPO: w the correction's weight). The gradient of the first term is the
    off-policy corrected REINFORCE estimate with the group-relative advantage as baseline
    (A_bt = A_b for every token of sample b when advantages are per sample).
    Returns the loss and token sums (plus one max) that add up over micro-batches and ranks.
    """
    if advantages.dim() == 1:
        advantages = advantages[:, None]  # (B, 1)
    advantages = advantages.expand_as(logprobs)  # (B, T)
    # Zero off the completion, so padding can never overflow exp() or reach a statistic.
    log_ratio = (logprobs.detach() - sampler_logprobs) * mask  # (B, T)
    is_weight, keep = CORRECTIONS[off_policy.type](log_ratio, mask, off_policy)  # (B, T), (B, T)
    weight, clip_keep, truncated = OBJECTIVES[objective.type](
        log_ratio, advantages, mask, is_weight, loss=loss, objective=objective
    )  # (B, T) x 3
    per_token = -(weight * keep * clip_keep) * advantages * logprobs  # (B, T)
    kl = k3_kl(logprobs, ref_logprobs) if ref_logprobs is not None else torch.zeros_like(logprobs)
    per_token = per_token + kl_coef * kl - entropy_coef * entropy
    value = (per_token * NORMALIZATIONS[loss.type](mask, totals)).sum()

    with torch.no_grad():
        ratio = log_ratio.exp() * mask  # (B, T)
        sums = {
            "tokens": mask.sum(),
            "ratio_sum": ratio.sum(),
            "ratio_max": ratio.max() if ratio.numel() else ratio.new_zeros(()),
            "truncated": (truncated * mask).sum(),
            "masked": ((1.0 - keep) * mask).sum(),
            "clipped": ((1.0 - clip_keep) * mask).sum(),
            "entropy_sum": (entropy.detach() * mask).sum(),
            "kl_sum": (kl.detach() * mask).sum(),
            # k3 estimate of KL(sampler || trainer) on the sampled tokens: e^d - 1 - d, d = log_ratio
            # (0 off the completion). Staleness and inference/training mismatch (MoE routing) both add to it.
            "sampler_kl_sum": ((log_ratio.exp() - 1.0 - log_ratio) * mask).sum(),
        }
    return value, sums


STAT_KEYS = ("tokens", "ratio_sum", "ratio_max", "truncated", "masked", "clipped", "entropy_sum", "kl_sum", "sampler_kl_sum")


def summarize(sums: dict[str, float]) -> dict[str, float]:
    """Per-token means of the sums `policy_loss` returns (after adding them over micro-batches and ranks)."""
    tokens = max(sums["tokens"], 1.0)
    return {
        "is_ratio_mean": sums["ratio_sum"] / tokens if sums["tokens"] else 1.0,
        "is_ratio_max": sums["ratio_max"] if sums["tokens"] else 1.0,
        "is_truncated_fraction": sums["truncated"] / tokens,
        "masked_fraction": sums["masked"] / tokens,
        "clipped_fraction": sums["clipped"] / tokens,
        "entropy": sums["entropy_sum"] / tokens,
        "kl": sums["kl_sum"] / tokens,
        "sampler_kl": sums["sampler_kl_sum"] / tokens,
    }
