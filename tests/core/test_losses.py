"""Unit tests for decentrl.rl.losses against float64 references written here from the formulas.

Each variant (normalization x off-policy correction x PPO clipping, plus k3 KL and entropy) is
checked on random inputs with masks: the loss value against a per-element Python reference, the
gradient against the reference's derivative (or against autograd of the textbook surrogate).
"""

from __future__ import annotations

import itertools
import math
import statistics

import pytest
import torch

from decentrl.config import (
    DrGRPOLossConfig,
    GRPOLossConfig,
    IcePopConfig,
    SeqMaskConfig,
    TISConfig,
    TokenLossConfig,
)
from decentrl.rl.losses import BatchTotals, policy_loss, summarize, tis_correction

CAP = 1.5
MAX_TOKENS = 12
NO_CLIP = {"eps_low": 1.0, "eps_high": 1e9}  # a trust region that never binds
LOSSES = {"grpo": GRPOLossConfig, "token": TokenLossConfig, "dr_grpo": DrGRPOLossConfig}
CORRECTIONS = {
    "tis": TISConfig(cap=CAP),
    "icepop": IcePopConfig(low=0.7, high=1.6),
    "seq_mask": SeqMaskConfig(low=0.85, high=1.2, cap=CAP),
}


def rows(t: torch.Tensor) -> list:
    return t.double().tolist()


def reference(
    lp: list[list[float]],
    lps: list[list[float]],
    adv: list[float],
    mask: list[list[float]],
    *,
    norm: str,
    correction: str,
    eps_low: float,
    eps_high: float,
    ref: list[list[float]] | None = None,
    ent: list[list[float]] | None = None,
    kl_coef: float = 0.0,
    entropy_coef: float = 0.0,
) -> tuple[float, list[list[float]], list[list[float]]]:
    """(loss, d loss / d lp, d loss / d entropy), element by element in float64.

    loss = sum_bt n_bt * [ -w_bt k_bt c_bt A_b lp_bt + kl_coef * k3_bt - entropy_coef * H_bt ] over
    completion tokens, with w, k, c constants:
      n: grpo 1/(len_b B), token 1/sum_b len_b, dr_grpo 1/(B * MAX_TOKENS)
      w, k: tis min(r, C), 1; icepop r, [lo <= r <= hi]; seq_mask min(r, C), [lo <= geo_b <= hi]
            with r = exp(lp - lps), geo_b = exp(mean_t over the sample's tokens (lp - lps))
      c: 0 iff (A > 0 and r > 1 + eps_high) or (A < 0 and r < 1 - eps_low)
      k3 = exp(ref - lp) - (ref - lp) - 1
    """
    config = CORRECTIONS[correction]
    B = len(lp)
    lengths = [sum(row) for row in mask]
    total_tokens = sum(lengths)
    loss, grad_lp, grad_ent = 0.0, [[0.0] * len(r) for r in lp], [[0.0] * len(r) for r in lp]
    for b in range(B):
        if lengths[b] == 0:
            continue
        geo = math.exp(sum((lp[b][t] - lps[b][t]) for t in range(len(lp[b])) if mask[b][t]) / lengths[b])
        for t in range(len(lp[b])):
            if not mask[b][t]:
                continue
            r = math.exp(lp[b][t] - lps[b][t])
            if correction == "tis":
                w, k = min(r, config.cap), 1.0
            elif correction == "icepop":
                w, k = r, float(config.low <= r <= config.high)
            else:
                w, k = min(r, config.cap), float(config.low <= geo <= config.high)
            c = 0.0 if (adv[b] > 0 and r > 1 + eps_high) or (adv[b] < 0 and r < 1 - eps_low) else 1.0
            n = {"grpo": 1 / (lengths[b] * B), "token": 1 / total_tokens, "dr_grpo": 1 / (B * MAX_TOKENS)}[norm]
            term = -w * k * c * adv[b] * lp[b][t]
            grad = -w * k * c * adv[b]
            if ref is not None:
                d = ref[b][t] - lp[b][t]
                term += kl_coef * (math.exp(d) - d - 1)
                grad += kl_coef * (1 - math.exp(d))
            if ent is not None:
                term -= entropy_coef * ent[b][t]
                grad_ent[b][t] = -entropy_coef * n
            loss += n * term
            grad_lp[b][t] = n * grad
    return loss, grad_lp, grad_ent


@pytest.fixture
def inputs() -> dict[str, torch.Tensor]:
    """Random (B, T) inputs whose ratios straddle every threshold; row 2 has no completion token."""
    g = torch.Generator().manual_seed(1234)
    B, T = 8, 9
    logprobs = -3.0 * torch.rand(B, T, generator=g)
    sampler = logprobs + 0.5 * torch.randn(B, T, generator=g)  # ratios exp(+-0.5 sigma)
    sampler[5] = logprobs[5] + 0.02 * torch.randn(T, generator=g)  # a sample close to on-policy
    advantages = torch.randn(B, generator=g)
    mask = (torch.rand(B, T, generator=g) < 0.6).float()
    mask[0] = 1.0
    mask[2] = 0.0
    return {
        "logprobs": logprobs,
        "sampler": sampler,
        "advantages": advantages,
        "mask": mask,
        "ref": logprobs + 0.3 * torch.randn(B, T, generator=g),
        "entropy": 2.0 * torch.rand(B, T, generator=g),
    }


def totals_of(mask: torch.Tensor) -> BatchTotals:
    return BatchTotals(samples=mask.shape[0], tokens=int(mask.sum().item()), max_tokens=MAX_TOKENS)


def run_loss(
    inputs: dict[str, torch.Tensor], norm: str, correction: str, *, kl_coef: float = 0.0, entropy_coef: float = 0.0, **clip: float
):
    logprobs = inputs["logprobs"].clone().requires_grad_(True)
    entropy = inputs["entropy"].clone().requires_grad_(True)
    loss, sums = policy_loss(
        logprobs,
        inputs["sampler"],
        inputs["advantages"],
        inputs["mask"],
        totals=totals_of(inputs["mask"]),
        loss=LOSSES[norm](**(clip or NO_CLIP)),
        off_policy=CORRECTIONS[correction],
        entropy=entropy,
        ref_logprobs=inputs["ref"] if kl_coef else None,
        kl_coef=kl_coef,
        entropy_coef=entropy_coef,
    )
    loss.backward()
    return loss, logprobs.grad, entropy.grad, sums


def reference_of(
    inputs: dict[str, torch.Tensor], norm: str, correction: str, *, kl_coef: float = 0.0, entropy_coef: float = 0.0, **clip: float
):
    clip = clip or NO_CLIP
    return reference(
        rows(inputs["logprobs"]), rows(inputs["sampler"]), inputs["advantages"].double().tolist(), rows(inputs["mask"]),
        norm=norm, correction=correction, eps_low=clip["eps_low"], eps_high=clip["eps_high"],
        ref=rows(inputs["ref"]) if kl_coef else None, ent=rows(inputs["entropy"]), kl_coef=kl_coef, entropy_coef=entropy_coef,
    )


def test_inputs_exercise_every_threshold(inputs: dict[str, torch.Tensor]) -> None:
    mask = inputs["mask"].bool()
    ratio = torch.exp(inputs["logprobs"] - inputs["sampler"])
    assert (ratio[mask] > CAP).any() and (ratio[mask] < CAP).any()
    icepop = CORRECTIONS["icepop"]
    assert (ratio[mask] < icepop.low).any() and (ratio[mask] > icepop.high).any()
    lengths = inputs["mask"].sum(1).clamp(min=1)
    geo = torch.exp(((inputs["logprobs"] - inputs["sampler"]) * inputs["mask"]).sum(1) / lengths)[lengths > 0]
    seq = CORRECTIONS["seq_mask"]
    assert ((geo < seq.low) | (geo > seq.high)).any() and ((geo >= seq.low) & (geo <= seq.high)).any()


@pytest.mark.parametrize("norm, correction", list(itertools.product(LOSSES, CORRECTIONS)))
@pytest.mark.kernels
def test_loss_matches_float64_reference(inputs: dict[str, torch.Tensor], norm: str, correction: str) -> None:
    clip = {"eps_low": 0.2, "eps_high": 0.28}
    loss, grad, _, _ = run_loss(inputs, norm, correction, **clip)
    expected, expected_grad, _ = reference_of(inputs, norm, correction, **clip)

    assert loss.shape == ()
    assert loss.item() == pytest.approx(expected, rel=1e-5, abs=1e-7)
    torch.testing.assert_close(grad.double(), torch.tensor(expected_grad, dtype=torch.float64), rtol=1e-5, atol=1e-8)
    assert torch.all(grad[2] == 0), "a row without completion tokens contributes no gradient"
    assert torch.all(grad[inputs["mask"] == 0] == 0), "padding never gets gradient"


@pytest.mark.parametrize("norm", list(LOSSES))
@pytest.mark.kernels
def test_loss_with_k3_kl_and_entropy_bonus_matches_reference(inputs: dict[str, torch.Tensor], norm: str) -> None:
    loss, grad, entropy_grad, sums = run_loss(inputs, norm, "tis", kl_coef=0.3, entropy_coef=0.05)
    expected, expected_grad, expected_entropy_grad = reference_of(inputs, norm, "tis", kl_coef=0.3, entropy_coef=0.05)

    assert loss.item() == pytest.approx(expected, rel=1e-5, abs=1e-7)
    torch.testing.assert_close(grad.double(), torch.tensor(expected_grad, dtype=torch.float64), rtol=1e-5, atol=1e-8)
    torch.testing.assert_close(entropy_grad.double(), torch.tensor(expected_entropy_grad, dtype=torch.float64), rtol=1e-5, atol=1e-9)
    mask = inputs["mask"].bool()
    d = (inputs["ref"] - inputs["logprobs"]).double()[mask]
    assert sums["kl_sum"].item() == pytest.approx((d.exp() - d - 1).sum().item(), rel=1e-5)
    assert (d.exp() - d - 1 >= 0).all(), "k3 is a non-negative KL estimate"


@pytest.mark.parametrize("norm", list(LOSSES))
@pytest.mark.kernels
def test_ppo_clip_gradient_equals_autograd_of_textbook_surrogate(inputs: dict[str, torch.Tensor], norm: str) -> None:
    # With no IS truncation or masking (icepop over (0, inf)), the loss's gradient must be the
    # gradient of -sum n_bt min(r A, clip(r, 1 - eps_low, 1 + eps_high) A), r = pi / pi_sampler.
    eps_low, eps_high = 0.2, 0.28
    logprobs = inputs["logprobs"].clone().requires_grad_(True)
    loss, _ = policy_loss(
        logprobs, inputs["sampler"], inputs["advantages"], inputs["mask"], totals=totals_of(inputs["mask"]),
        loss=LOSSES[norm](eps_low=eps_low, eps_high=eps_high), off_policy=IcePopConfig(low=1e-9, high=1e9),
        entropy=torch.zeros_like(logprobs),
    )
    loss.backward()

    lp = inputs["logprobs"].double().clone().requires_grad_(True)
    mask, adv = inputs["mask"].double(), inputs["advantages"].double()[:, None]
    r = torch.exp(lp - inputs["sampler"].double())
    surrogate = torch.minimum(r * adv, r.clamp(1 - eps_low, 1 + eps_high) * adv)
    lengths = mask.sum(1, keepdim=True).clamp(min=1)
    B, tokens = mask.shape[0], mask.sum()
    n = {"grpo": mask / lengths / B, "token": mask / tokens, "dr_grpo": mask / (B * MAX_TOKENS)}[norm]
    (-(surrogate * n).sum()).backward()

    clipped = ((adv > 0) & (r > 1 + eps_high)) | ((adv < 0) & (r < 1 - eps_low))
    assert (clipped & mask.bool()).any() and (~clipped & mask.bool()).any(), "inputs must clip some tokens, not all"
    torch.testing.assert_close(logprobs.grad.double(), lp.grad, rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("norm, correction", list(itertools.product(LOSSES, CORRECTIONS)))
@pytest.mark.kernels
def test_loss_of_micro_batches_sums_to_loss_of_whole_batch(inputs: dict[str, torch.Tensor], norm: str, correction: str) -> None:
    whole, whole_grad, _, whole_sums = run_loss(inputs, norm, correction, eps_low=0.2, eps_high=0.28)
    parts, grads = [], []
    for rows_ in ([0, 3, 5], [1, 2], [4, 6, 7]):
        logprobs = inputs["logprobs"][rows_].clone().requires_grad_(True)
        loss, _ = policy_loss(
            logprobs, inputs["sampler"][rows_], inputs["advantages"][rows_], inputs["mask"][rows_],
            totals=totals_of(inputs["mask"]),  # whole-batch counts, not the micro-batch's
            loss=LOSSES[norm](eps_low=0.2, eps_high=0.28), off_policy=CORRECTIONS[correction],
            entropy=inputs["entropy"][rows_],
        )
        loss.backward()
        parts.append(loss.item())
        grads.append((rows_, logprobs.grad))
    assert sum(parts) == pytest.approx(whole.item(), rel=1e-6, abs=1e-8)
    for rows_, grad in grads:
        torch.testing.assert_close(grad, whole_grad[rows_], rtol=1e-6, atol=1e-9)


def test_tis_weights_cap_tokens_above_it_exactly() -> None:
    log_ratio = torch.tensor([[4.0, 0.0, 0.2, math.log(CAP)]])
    weights, keep = tis_correction(log_ratio, torch.ones(1, 4), TISConfig(cap=CAP))

    assert weights[0, 0].item() == CAP  # exactly the cap, not e^4
    assert weights[0, 1].item() == pytest.approx(1.0)
    assert weights[0, 2].item() == pytest.approx(math.exp(0.2), rel=1e-6)
    assert weights[0, 3].item() == pytest.approx(CAP, rel=1e-6)
    assert torch.all(keep == 1)


def test_loss_weights_carry_no_gradient() -> None:
    # One token, ratio e^3 >> cap: the gradient is -CAP * A / 1 (grpo of one token), not -e^3 * A.
    lp = torch.tensor([[-0.5]], requires_grad=True)
    loss, sums = policy_loss(
        lp, torch.tensor([[-3.5]]), torch.tensor([2.0]), torch.ones(1, 1), totals=BatchTotals(1, 1, MAX_TOKENS),
        loss=GRPOLossConfig(**NO_CLIP), off_policy=TISConfig(cap=CAP), entropy=torch.zeros(1, 1),
    )
    loss.backward()
    assert loss.item() == pytest.approx(-CAP * 2.0 * -0.5)
    assert lp.grad.item() == pytest.approx(-CAP * 2.0)
    stats = summarize({k: v.item() for k, v in sums.items()})
    assert stats["is_truncated_fraction"] == 1.0
    assert stats["is_ratio_max"] == pytest.approx(math.exp(3.0), rel=1e-5)


@pytest.mark.parametrize("correction", list(CORRECTIONS))
def test_loss_stats_use_completion_tokens_only(inputs: dict[str, torch.Tensor], correction: str) -> None:
    sampler = inputs["sampler"].clone()
    # Padding positions get a ratio of e^6: counting them would move every statistic.
    sampler[inputs["mask"] == 0] = inputs["logprobs"][inputs["mask"] == 0] - 6.0
    clip = {"eps_low": 0.2, "eps_high": 0.28}
    _, _, _, sums = run_loss({**inputs, "sampler": sampler}, "grpo", correction, **clip)
    stats = summarize({k: v.item() for k, v in sums.items()})

    config = CORRECTIONS[correction]
    ratios, truncated, masked, clipped, entropies, k3 = [], 0, 0, 0, [], []
    lp, lps, mask, adv = rows(inputs["logprobs"]), rows(sampler), rows(inputs["mask"]), inputs["advantages"].tolist()
    for b in range(len(lp)):
        kept = [t for t in range(len(lp[b])) if mask[b][t]]
        geo = math.exp(sum(lp[b][t] - lps[b][t] for t in kept) / len(kept)) if kept else 1.0
        for t in kept:
            r = math.exp(lp[b][t] - lps[b][t])
            ratios.append(r)
            k3.append(r - 1 - math.log(r))  # KL(sampler || trainer), one sampled token
            entropies.append(inputs["entropy"][b, t].item())
            truncated += correction != "icepop" and r > config.cap
            if correction == "icepop":
                masked += not config.low <= r <= config.high
            elif correction == "seq_mask":
                masked += not config.low <= geo <= config.high
            clipped += (adv[b] > 0 and r > 1.28) or (adv[b] < 0 and r < 0.8)
    n = len(ratios)
    assert stats["is_ratio_mean"] == pytest.approx(statistics.fmean(ratios), rel=1e-5)
    assert stats["is_ratio_max"] == pytest.approx(max(ratios), rel=1e-5)
    assert stats["is_ratio_max"] < math.exp(6.0) / 2
    assert stats["is_truncated_fraction"] == pytest.approx(truncated / n)
    assert stats["masked_fraction"] == pytest.approx(masked / n)
    assert stats["clipped_fraction"] == pytest.approx(clipped / n)
    assert stats["entropy"] == pytest.approx(statistics.fmean(entropies), rel=1e-5)
    assert stats["sampler_kl"] == pytest.approx(statistics.fmean(k3), rel=1e-5) and stats["sampler_kl"] > 0
    if correction != "tis":
        assert 0 < stats["masked_fraction"] < 1


@pytest.mark.parametrize("norm, correction", list(itertools.product(LOSSES, CORRECTIONS)))
def test_loss_with_no_completion_tokens_is_zero_not_nan(norm: str, correction: str) -> None:
    lp = torch.full((2, 3), -1.0, requires_grad=True)
    loss, sums = policy_loss(
        lp, lp.detach() - 1.0, torch.tensor([1.0, -1.0]), torch.zeros(2, 3), totals=BatchTotals(0, 0, MAX_TOKENS),
        loss=LOSSES[norm](), off_policy=CORRECTIONS[correction], entropy=torch.ones(2, 3),
    )
    loss.backward()
    assert loss.item() == 0.0
    assert lp.grad is not None and torch.all(lp.grad == 0)
    stats = summarize({k: v.item() for k, v in sums.items()})
    assert stats["is_ratio_mean"] == stats["is_ratio_max"] == 1.0
    assert stats["masked_fraction"] == stats["clipped_fraction"] == stats["entropy"] == 0.0
