"""Policy-gradient losses: small pure functions over padded (B, T) tensors.

Called by the trainer once per micro-batch. `logprobs` are the trainer's (with grad),
`sampler_logprobs` those the workers sampled with, `mask` is 1 on completion tokens.
"""

from __future__ import annotations

import torch


def truncated_is_weights(logprobs: torch.Tensor, sampler_logprobs: torch.Tensor, cap: float) -> torch.Tensor:
    """min(pi_trainer / pi_sampler, cap) per token, without gradient.  # (B, T)

    Corrects for the rollout being sampled by an older or numerically different policy
    (staleness, inference-engine mismatch) while bounding the variance the ratio adds.
    """
    return torch.exp(logprobs.detach() - sampler_logprobs).clamp(max=cap)


def grpo_tis_loss(
    logprobs: torch.Tensor,  # (B, T) trainer logprobs of the sampled tokens, with grad
    sampler_logprobs: torch.Tensor,  # (B, T) workers' sampling logprobs
    advantages: torch.Tensor,  # (B,)
    mask: torch.Tensor,  # (B, T) 1.0 on completion tokens
    is_cap: float,
) -> tuple[torch.Tensor, dict[str, float]]:
    """GRPO policy gradient with truncated importance sampling, sequence-mean normalized.

    loss = -mean_b [ sum_t w_bt * A_b * logp_bt * m_bt / sum_t m_bt ]; its gradient is the
    IS-corrected REINFORCE estimate with the group-relative advantage as baseline.
    """
    weights = truncated_is_weights(logprobs, sampler_logprobs, is_cap)  # (B, T)
    per_token = -weights * advantages[:, None] * logprobs * mask  # (B, T)
    lengths = mask.sum(dim=1).clamp(min=1.0)  # (B,)
    loss = (per_token.sum(dim=1) / lengths).mean()
    with torch.no_grad():
        ratio = torch.exp(logprobs.detach() - sampler_logprobs)[mask.bool()]
        stats = {
            "is_ratio_mean": ratio.mean().item() if ratio.numel() else 1.0,
            "is_ratio_max": ratio.max().item() if ratio.numel() else 1.0,
            "is_truncated_fraction": (ratio > is_cap).float().mean().item() if ratio.numel() else 0.0,
        }
    return loss, stats
