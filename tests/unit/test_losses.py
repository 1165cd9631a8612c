"""Unit tests for decentrl.losses and decentrl.advantages against float64 references in the test."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from decentrl.advantages import group_advantages
from decentrl.losses import grpo_tis_loss, truncated_is_weights

CAP = 1.5


def reference_loss(lp: list[list[float]], lp_s: list[list[float]], adv: list[float], mask: list[list[float]]) -> float:
    """loss = -mean_b [ sum_t min(exp(lp - lp_s), C) * A_b * lp_bt * m_bt / sum_t m_bt ], in float64."""
    total = 0.0
    for b in range(len(lp)):
        numerator = sum(
            min(math.exp(lp[b][t] - lp_s[b][t]), CAP) * adv[b] * lp[b][t] * mask[b][t] for t in range(len(lp[b]))
        )
        length = max(sum(mask[b]), 1.0)
        total += numerator / length
    return -total / len(lp)


@pytest.fixture
def inputs() -> dict[str, torch.Tensor]:
    """Random (B, T) inputs whose ratios straddle the cap; row 2 has no completion token at all."""
    g = torch.Generator().manual_seed(1234)
    B, T = 6, 9
    logprobs = -3.0 * torch.rand(B, T, generator=g)
    sampler = logprobs + 0.8 * torch.randn(B, T, generator=g)  # ratios exp(+-0.8 sigma)
    advantages = torch.randn(B, generator=g)
    mask = (torch.rand(B, T, generator=g) < 0.6).float()
    mask[0] = 1.0
    mask[2] = 0.0
    return {"logprobs": logprobs, "sampler": sampler, "advantages": advantages, "mask": mask}


def test_grpo_tis_loss_matches_float64_reference(inputs: dict[str, torch.Tensor]) -> None:
    ratio = torch.exp(inputs["logprobs"] - inputs["sampler"])[inputs["mask"].bool()]
    assert (ratio > CAP).any() and (ratio < CAP).any(), "inputs must exercise both sides of the cap"

    loss, _ = grpo_tis_loss(inputs["logprobs"], inputs["sampler"], inputs["advantages"], inputs["mask"], CAP)

    expected = reference_loss(
        inputs["logprobs"].double().tolist(),
        inputs["sampler"].double().tolist(),
        inputs["advantages"].double().tolist(),
        inputs["mask"].double().tolist(),
    )
    assert loss.shape == ()
    assert loss.item() == pytest.approx(expected, rel=1e-5, abs=1e-6)


def test_grpo_tis_loss_gradient_is_weighted_reinforce(inputs: dict[str, torch.Tensor]) -> None:
    logprobs = inputs["logprobs"].clone().requires_grad_(True)
    loss, _ = grpo_tis_loss(logprobs, inputs["sampler"], inputs["advantages"], inputs["mask"], CAP)
    loss.backward()

    # The IS weights are constants: d loss / d lp_bt = -w_bt * A_b * m_bt / len_b / B.
    B = logprobs.shape[0]
    weights = torch.exp(inputs["logprobs"].double() - inputs["sampler"].double()).clamp(max=CAP)
    lengths = inputs["mask"].double().sum(dim=1).clamp(min=1.0)
    expected = -weights * inputs["advantages"].double()[:, None] * inputs["mask"].double() / lengths[:, None] / B
    assert logprobs.grad is not None
    torch.testing.assert_close(logprobs.grad.double(), expected, rtol=1e-5, atol=1e-7)
    assert torch.all(logprobs.grad[2] == 0), "a row without completion tokens contributes no gradient"


def test_loss_is_weights_cap_tokens_above_it_exactly() -> None:
    lp = torch.tensor([[-1.0, -1.0, -1.0, -2.0]], requires_grad=True)
    lp_s = torch.tensor([[-5.0, -1.0, -1.2, -2.0 - math.log(CAP)]])  # ratios e^4, 1, e^0.2, CAP
    weights = truncated_is_weights(lp, lp_s, CAP)

    assert not weights.requires_grad, "IS weights must not carry gradient"
    assert weights[0, 0].item() == CAP  # exactly the cap, not e^4
    assert weights[0, 1].item() == pytest.approx(1.0)
    assert weights[0, 2].item() == pytest.approx(math.exp(0.2), rel=1e-6)
    assert weights[0, 3].item() == pytest.approx(CAP, rel=1e-6)


def test_grpo_tis_loss_uses_capped_weight_for_large_ratios() -> None:
    # One token, ratio e^3 >> cap: the loss is -CAP * A * lp, not -e^3 * A * lp.
    lp = torch.tensor([[-0.5]])
    loss, stats = grpo_tis_loss(lp, torch.tensor([[-3.5]]), torch.tensor([2.0]), torch.ones(1, 1), CAP)
    assert loss.item() == pytest.approx(-CAP * 2.0 * -0.5)
    assert stats["is_truncated_fraction"] == 1.0
    assert stats["is_ratio_max"] == pytest.approx(math.exp(3.0), rel=1e-5)


def test_grpo_tis_loss_stats_use_masked_tokens_only(inputs: dict[str, torch.Tensor]) -> None:
    sampler = inputs["sampler"].clone()
    # Masked-out positions get a ratio of e^6: counting them would move every statistic.
    sampler[inputs["mask"] == 0] = inputs["logprobs"][inputs["mask"] == 0] - 6.0

    _, stats = grpo_tis_loss(inputs["logprobs"], sampler, inputs["advantages"], inputs["mask"], CAP)

    ratios = [
        math.exp(lp - lps)
        for lp_row, lps_row, m_row in zip(
            inputs["logprobs"].double().tolist(), sampler.double().tolist(), inputs["mask"].tolist()
        )
        for lp, lps, m in zip(lp_row, lps_row, m_row)
        if m == 1.0
    ]
    assert stats["is_ratio_mean"] == pytest.approx(statistics.fmean(ratios), rel=1e-5)
    assert stats["is_ratio_max"] == pytest.approx(max(ratios), rel=1e-5)
    assert stats["is_truncated_fraction"] == pytest.approx(sum(r > CAP for r in ratios) / len(ratios))
    assert stats["is_ratio_max"] < math.exp(6.0) / 2


def test_grpo_tis_loss_with_no_completion_tokens_is_zero_not_nan() -> None:
    lp = torch.full((2, 3), -1.0, requires_grad=True)
    loss, stats = grpo_tis_loss(lp, lp.detach() - 1.0, torch.tensor([1.0, -1.0]), torch.zeros(2, 3), CAP)
    loss.backward()
    assert loss.item() == 0.0
    assert lp.grad is not None and torch.all(lp.grad == 0)
    assert stats == {"is_ratio_mean": 1.0, "is_ratio_max": 1.0, "is_truncated_fraction": 0.0}


def test_loss_group_advantages_are_reward_minus_group_mean() -> None:
    rewards = [1.0, 0.5, 0.0, 0.25]
    advantages = group_advantages(rewards)
    mean = sum(rewards) / len(rewards)
    assert advantages == pytest.approx([r - mean for r in rewards])
    assert sum(advantages) == pytest.approx(0.0, abs=1e-12)


def test_loss_group_advantages_std_normalization() -> None:
    rewards = [1.0, 0.5, 0.0, 0.25, 0.75]
    advantages = group_advantages(rewards, normalize_std=True)
    mean = statistics.fmean(rewards)
    std = statistics.pstdev(rewards)
    assert advantages == pytest.approx([(r - mean) / std for r in rewards], rel=1e-5)
    assert statistics.fmean(advantages) == pytest.approx(0.0, abs=1e-12)
    assert statistics.pstdev(advantages) == pytest.approx(1.0, rel=1e-5)


def test_loss_group_advantages_of_a_constant_group_are_zero() -> None:
    # All samples equally good: no signal, and std normalization must not divide 0 by 0.
    assert group_advantages([0.5, 0.5, 0.5]) == [0.0, 0.0, 0.0]
    assert group_advantages([0.5, 0.5, 0.5], normalize_std=True) == [0.0, 0.0, 0.0]
