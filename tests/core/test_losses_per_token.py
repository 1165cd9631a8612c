"""decentrl.rl.losses with per-token advantages (B, T), as process rewards give them.

Against a float64 reference written here independently of tests/core/test_losses.py (there every
token of a sample shares one advantage): the loss and its gradient, the PPO clip side chosen by
each token's own advantage sign, and agreement with the per-sample (B,) path when every token of
a sample carries the sample's advantage.
(tests/trainer/test_trainer_math.py checks that collate puts `token_advantages` where the loss reads them.)
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from decentrl.config import DrGRPOLossConfig, GRPOLossConfig, IcePopConfig, SeqMaskConfig, TISConfig, TokenLossConfig
from decentrl.rl.losses import BatchTotals, policy_loss

MAX_TOKENS = 10
EPS_LOW, EPS_HIGH = 0.2, 0.28
NORMS = {"grpo": GRPOLossConfig, "token": TokenLossConfig, "dr_grpo": DrGRPOLossConfig}
CORRECTIONS = {
    "tis": TISConfig(cap=1.4),
    "icepop": IcePopConfig(low=0.6, high=1.7),
    "seq_mask": SeqMaskConfig(low=0.8, high=1.25, cap=1.4),
}


def reference(lp: list[list[float]], lps: list[list[float]], adv: list[list[float]], mask: list[list[float]], norm: str, correction: str):
    """(loss, d loss / d lp) in float64, token by token:

    loss = sum over completion tokens (b, t) of  -n_bt * w_bt * k_bt * c_bt * A_bt * lp_bt
    n: grpo 1 / (B * len_b); token 1 / (total tokens); dr_grpo 1 / (B * MAX_TOKENS)
    w, k from r = exp(lp - lps): tis (min(r, cap), 1); icepop (r, low <= r <= high);
         seq_mask (min(r, cap), low <= exp(mean over b's tokens of lp - lps) <= high)
    c = 0 if A_bt > 0 and r > 1 + EPS_HIGH, or A_bt < 0 and r < 1 - EPS_LOW; else 1.
    """
    cfg = CORRECTIONS[correction]
    batch = len(lp)
    total = sum(sum(row) for row in mask)
    loss = 0.0
    grad = [[0.0 for _ in row] for row in lp]
    for b, row in enumerate(lp):
        tokens = [t for t in range(len(row)) if mask[b][t] == 1.0]
        if not tokens:
            continue
        geometric = math.exp(math.fsum(row[t] - lps[b][t] for t in tokens) / len(tokens))
        for t in tokens:
            r = math.exp(row[t] - lps[b][t])
            w = r if correction == "icepop" else min(r, cfg.cap)
            if correction == "tis":
                k = 1.0
            elif correction == "icepop":
                k = 1.0 if cfg.low <= r <= cfg.high else 0.0
            else:
                k = 1.0 if cfg.low <= geometric <= cfg.high else 0.0
            a = adv[b][t]
            c = 0.0 if (a > 0 and r > 1 + EPS_HIGH) or (a < 0 and r < 1 - EPS_LOW) else 1.0
            n = {"grpo": 1.0 / (batch * len(tokens)), "token": 1.0 / total, "dr_grpo": 1.0 / (batch * MAX_TOKENS)}[norm]
            loss += -n * w * k * c * a * row[t]
            grad[b][t] = -n * w * k * c * a
    return loss, grad


@pytest.fixture
def inputs() -> dict[str, torch.Tensor]:
    """float64 (B, T) inputs; advantages change sign inside samples; row 3 has no completion token."""
    g = torch.Generator().manual_seed(99)
    B, T = 6, 11
    logprobs = -2.5 * torch.rand(B, T, generator=g, dtype=torch.float64)
    sampler = logprobs + 0.45 * torch.randn(B, T, generator=g, dtype=torch.float64)
    mask = (torch.rand(B, T, generator=g, dtype=torch.float64) < 0.7).double()
    mask[0] = 1.0
    mask[3] = 0.0
    advantages = torch.randn(B, T, generator=g, dtype=torch.float64) * mask
    return {"logprobs": logprobs, "sampler": sampler, "advantages": advantages, "mask": mask}


def run(inputs: dict[str, torch.Tensor], advantages: torch.Tensor, norm: str, correction: str):
    logprobs = inputs["logprobs"].clone().requires_grad_(True)
    mask = inputs["mask"]
    loss, sums = policy_loss(
        logprobs, inputs["sampler"], advantages, mask,
        totals=BatchTotals(samples=mask.shape[0], tokens=int(mask.sum().item()), max_tokens=MAX_TOKENS),
        loss=NORMS[norm](eps_low=EPS_LOW, eps_high=EPS_HIGH), off_policy=CORRECTIONS[correction],
        entropy=torch.zeros_like(logprobs),
    )
    loss.backward()
    return loss, logprobs.grad, sums


def test_inputs_clip_tokens_of_both_signs_within_one_sample(inputs: dict[str, torch.Tensor]) -> None:
    r = (inputs["logprobs"] - inputs["sampler"]).exp()
    adv, mask = inputs["advantages"], inputs["mask"].bool()
    high, low = (adv > 0) & (r > 1 + EPS_HIGH) & mask, (adv < 0) & (r < 1 - EPS_LOW) & mask
    # Some sample holds a token clipped on each side, and tokens that are not clipped.
    assert any(high[b].any() and low[b].any() and (mask[b] & ~high[b] & ~low[b]).any() for b in range(len(adv)))


@pytest.mark.parametrize("norm, correction", list(itertools.product(NORMS, CORRECTIONS)))
@pytest.mark.kernels
def test_per_token_loss_and_gradient_match_float64_reference(inputs: dict[str, torch.Tensor], norm: str, correction: str) -> None:
    loss, grad, _ = run(inputs, inputs["advantages"], norm, correction)
    expected, expected_grad = reference(
        inputs["logprobs"].tolist(), inputs["sampler"].tolist(), inputs["advantages"].tolist(), inputs["mask"].tolist(), norm, correction
    )
    assert loss.item() == pytest.approx(expected, rel=1e-12, abs=1e-14)
    torch.testing.assert_close(grad, torch.tensor(expected_grad, dtype=torch.float64), rtol=1e-12, atol=1e-14)
    assert torch.all(grad[3] == 0) and torch.all(grad[inputs["mask"] == 0] == 0)


@pytest.mark.parametrize("norm, correction", list(itertools.product(NORMS, CORRECTIONS)))
@pytest.mark.kernels
def test_per_token_advantages_equal_to_the_samples_advantage_are_the_scalar_path(
    inputs: dict[str, torch.Tensor], norm: str, correction: str
) -> None:
    per_sample = torch.tensor([0.7, -1.3, 0.0, 2.0, -0.4, 1.1], dtype=torch.float64)  # (B,)
    loss, grad, sums = run(inputs, per_sample, norm, correction)
    expanded = per_sample[:, None].expand_as(inputs["logprobs"]).clone()  # (B, T), padding included
    token_loss, token_grad, token_sums = run(inputs, expanded, norm, correction)
    assert token_loss.item() == loss.item()
    assert torch.equal(token_grad, grad)
    assert {k: v.item() for k, v in token_sums.items()} == {k: v.item() for k, v in sums.items()}
    # And the scalar path itself matches the reference with A_bt = A_b.
    expected, expected_grad = reference(
        inputs["logprobs"].tolist(), inputs["sampler"].tolist(), expanded.tolist(), inputs["mask"].tolist(), norm, correction
    )
    assert loss.item() == pytest.approx(expected, rel=1e-12, abs=1e-14)
    torch.testing.assert_close(grad, torch.tensor(expected_grad, dtype=torch.float64), rtol=1e-12, atol=1e-14)


def test_the_clip_side_is_each_tokens_own_advantage_sign() -> None:
    # One sample, every token's ratio e^0.5 > 1 + eps_high: the positive-advantage token is
    # clipped (no gradient), the negative one is not; a per-sample advantage would clip both or neither.
    lp = torch.tensor([[-1.0, -1.0]], dtype=torch.float64, requires_grad=True)
    loss, sums = policy_loss(
        lp, lp.detach() - 0.5, torch.tensor([[1.0, -1.0]], dtype=torch.float64), torch.ones(1, 2, dtype=torch.float64),
        totals=BatchTotals(1, 2, MAX_TOKENS), loss=TokenLossConfig(eps_low=EPS_LOW, eps_high=EPS_HIGH),
        off_policy=TISConfig(cap=10.0), entropy=torch.zeros(1, 2, dtype=torch.float64),
    )
    loss.backward()
    assert lp.grad is not None
    assert lp.grad.tolist() == [[0.0, pytest.approx(math.exp(0.5) / 2, rel=1e-12)]]
    assert sums["clipped"].item() == 1.0

