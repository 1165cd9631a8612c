"""The GSPO and CISPO objectives of decentrl.rl.losses against float64 references written here
from the papers' equations, their gradients (GSPO: one ratio per sample; CISPO: no token's
gradient dropped), their split into micro-batches, their config errors, and their gradients
equal to TRL's formulation on the same tensors."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from decentrl.config import (
    CISPOObjectiveConfig,
    ConfigError,
    DrGRPOLossConfig,
    GRPOLossConfig,
    GSPOObjectiveConfig,
    IcePopConfig,
    PPOObjectiveConfig,
    SeqMaskConfig,
    TISConfig,
    TokenLossConfig,
    parse_config,
)
from decentrl.rl.losses import BatchTotals, policy_loss, summarize

MAX_TOKENS = 12
LOSSES = {"grpo": GRPOLossConfig, "token": TokenLossConfig, "dr_grpo": DrGRPOLossConfig}
# Wider than the papers' defaults so that the random inputs below clip some samples/tokens and not others.
GSPO = GSPOObjectiveConfig(eps_low=0.08, eps_high=0.1)
CISPO = CISPOObjectiveConfig(eps_low=0.3, eps_high=0.2)
OBJECTIVES = {"gspo": GSPO, "cispo": CISPO}
NO_MASK = IcePopConfig(low=1e-9, high=1e9)  # a correction that keeps every token
CORRECTIONS = {"tis": TISConfig(cap=1.5), "icepop": IcePopConfig(low=0.7, high=1.6), "seq_mask": SeqMaskConfig(low=0.85, high=1.2)}


@pytest.fixture
def inputs() -> dict[str, torch.Tensor]:
    """Random (B, T) inputs: each sample's sampler logprobs shifted by its own offset, so that
    sequence ratios spread over GSPO's clip range; row 2 has no completion token."""
    g = torch.Generator().manual_seed(31)
    B, T = 8, 9
    logprobs = -3.0 * torch.rand(B, T, generator=g)
    offsets = torch.tensor([0.0, -0.15, 0.0, 0.12, -0.02, 0.03, 0.2, -0.2])[:, None]  # (B, 1)
    sampler = logprobs - offsets + 0.3 * torch.randn(B, T, generator=g)
    advantages = torch.tensor([0.7, 0.5, 1.0, -0.4, 1.2, -0.9, 0.3, -0.6])
    mask = (torch.rand(B, T, generator=g) < 0.7).float()
    mask[0] = 1.0
    mask[2] = 0.0
    return {"logprobs": logprobs, "sampler": sampler, "advantages": advantages, "mask": mask,
            "token_advantages": torch.randn(B, T, generator=g)}


def totals_of(mask: torch.Tensor) -> BatchTotals:
    return BatchTotals(samples=mask.shape[0], tokens=int(mask.sum().item()), max_tokens=MAX_TOKENS)


def run(inputs: dict[str, torch.Tensor], norm: str, objective: object, *, off_policy: object = NO_MASK,
        advantages: torch.Tensor | None = None, rows: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor, dict]:
    index = rows if rows is not None else list(range(inputs["mask"].shape[0]))
    logprobs = inputs["logprobs"][index].clone().requires_grad_(True)
    adv = (inputs["advantages"] if advantages is None else advantages)[index]
    loss, sums = policy_loss(
        logprobs, inputs["sampler"][index], adv, inputs["mask"][index], totals=totals_of(inputs["mask"]),
        loss=LOSSES[norm](), off_policy=off_policy, entropy=torch.zeros_like(logprobs), objective=objective,
    )
    loss.backward()
    return loss, logprobs.grad, sums


def norm_weight(norm: str, mask: list[list[float]], b: int) -> float:
    lengths = [sum(row) for row in mask]
    return {"grpo": 1 / (lengths[b] * len(mask)), "token": 1 / sum(lengths), "dr_grpo": 1 / (len(mask) * MAX_TOKENS)}[norm]


def gspo_reference(lp: list[list[float]], lps: list[list[float]], adv: list[float], mask: list[list[float]], norm: str,
                   eps_low: float, eps_high: float) -> tuple[float, list[list[float]]]:
    """GSPO (arXiv 2507.18071, eq. 5-7), element by element in float64: with
    s_i = (pi(y_i) / pi_old(y_i))^(1/|y_i|) = exp(mean_t (lp - lps)), each token carries
    -n_it * sg(s_i) * c_i * A_i * lp_it, c_i = 0 iff (A_i > 0 and s_i > 1 + eps_high) or
    (A_i < 0 and s_i < 1 - eps_low). Returns the loss and d loss / d lp."""
    loss, grad = 0.0, [[0.0] * len(row) for row in lp]
    for b in range(len(lp)):
        tokens = [t for t in range(len(lp[b])) if mask[b][t]]
        if not tokens:
            continue
        s = math.exp(sum(lp[b][t] - lps[b][t] for t in tokens) / len(tokens))
        c = 0.0 if (adv[b] > 0 and s > 1 + eps_high) or (adv[b] < 0 and s < 1 - eps_low) else 1.0
        for t in tokens:
            n = norm_weight(norm, mask, b)
            loss += -n * s * c * adv[b] * lp[b][t]
            grad[b][t] = -n * s * c * adv[b]
    return loss, grad


def cispo_reference(lp: list[list[float]], lps: list[list[float]], adv: list[float], mask: list[list[float]], norm: str,
                    eps_low: float, eps_high: float) -> tuple[float, list[list[float]]]:
    """CISPO (arXiv 2506.13585, eq. 4-5), element by element in float64: each token carries
    -n_it * sg(r_hat_it) * A_i * lp_it, r_hat = clip(r, 1 - eps_low, 1 + eps_high), r = exp(lp - lps)."""
    loss, grad = 0.0, [[0.0] * len(row) for row in lp]
    for b in range(len(lp)):
        for t in range(len(lp[b])):
            if not mask[b][t]:
                continue
            r_hat = min(max(math.exp(lp[b][t] - lps[b][t]), 1 - eps_low), 1 + eps_high)
            n = norm_weight(norm, mask, b)
            loss += -n * r_hat * adv[b] * lp[b][t]
            grad[b][t] = -n * r_hat * adv[b]
    return loss, grad


REFERENCES = {"gspo": gspo_reference, "cispo": cispo_reference}


def rows_of(t: torch.Tensor) -> list:
    return t.double().tolist()


def test_inputs_clip_some_samples_and_tokens_and_not_others(inputs: dict[str, torch.Tensor]) -> None:
    mask, adv = inputs["mask"], inputs["advantages"]
    log_ratio = (inputs["logprobs"] - inputs["sampler"]) * mask
    s = (log_ratio.sum(1) / mask.sum(1).clamp(min=1)).exp()[mask.sum(1) > 0]
    a = adv[mask.sum(1) > 0]
    clipped = ((a > 0) & (s > 1 + GSPO.eps_high)) | ((a < 0) & (s < 1 - GSPO.eps_low))
    assert clipped.any() and (~clipped).any()
    r = log_ratio.exp()[mask.bool()]
    assert (r > 1 + CISPO.eps_high).any() and (r < 1 - CISPO.eps_low).any()


@pytest.mark.parametrize("norm, name", list(itertools.product(LOSSES, OBJECTIVES)))
@pytest.mark.kernels
def test_objective_matches_float64_reference_from_the_paper(inputs: dict[str, torch.Tensor], norm: str, name: str) -> None:
    objective = OBJECTIVES[name]
    loss, grad, _ = run(inputs, norm, objective)
    expected, expected_grad = REFERENCES[name](
        rows_of(inputs["logprobs"]), rows_of(inputs["sampler"]), inputs["advantages"].double().tolist(),
        rows_of(inputs["mask"]), norm, objective.eps_low, objective.eps_high,
    )
    assert loss.item() == pytest.approx(expected, rel=1e-5, abs=1e-7)
    torch.testing.assert_close(grad.double(), torch.tensor(expected_grad, dtype=torch.float64), rtol=1e-5, atol=1e-8)
    assert torch.all(grad[inputs["mask"] == 0] == 0), "padding never gets gradient"


@pytest.mark.kernels
def test_gspo_gradient_equals_autograd_of_the_sequence_level_objective(inputs: dict[str, torch.Tensor]) -> None:
    # GSPO eq. 5: J = 1/G sum_i min(s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i), s_i with
    # gradient through every token of y_i. With grpo normalization the loss's gradient is -grad J.
    _, grad, _ = run(inputs, "grpo", GSPO)
    lp = inputs["logprobs"].double().clone().requires_grad_(True)
    mask, adv = inputs["mask"].double(), inputs["advantages"].double()
    s = torch.exp(((lp - inputs["sampler"].double()) * mask).sum(1) / mask.sum(1).clamp(min=1))  # (B,)
    J = torch.minimum(s * adv, s.clamp(1 - GSPO.eps_low, 1 + GSPO.eps_high) * adv)  # (B,)
    (-(J * (mask.sum(1) > 0)).sum() / mask.shape[0]).backward()
    torch.testing.assert_close(grad.double(), lp.grad, rtol=1e-5, atol=1e-8)


@pytest.mark.kernels
def test_gspo_token_gradient_equals_autograd_with_per_token_advantages(inputs: dict[str, torch.Tensor]) -> None:
    # GSPO-token (eq. 13-14): s_it = sg[s_i] * pi_it / sg[pi_it], clipped per token by the sign of A_it.
    adv = inputs["token_advantages"]
    _, grad, _ = run(inputs, "grpo", GSPO, advantages=adv)
    lp = inputs["logprobs"].double().clone().requires_grad_(True)
    mask, a = inputs["mask"].double(), adv.double()
    s = torch.exp(((lp - inputs["sampler"].double()) * mask).sum(1) / mask.sum(1).clamp(min=1)).detach()[:, None]  # (B, 1)
    s_token = s * torch.exp(lp - lp.detach())  # (B, T)
    J = torch.minimum(s_token * a, s_token.clamp(1 - GSPO.eps_low, 1 + GSPO.eps_high) * a)
    (-(J * mask / mask.sum(1, keepdim=True).clamp(min=1)).sum() / mask.shape[0]).backward()
    torch.testing.assert_close(grad.double(), lp.grad, rtol=1e-5, atol=1e-8)


def test_gspo_weighs_every_token_of_a_sample_by_one_ratio(inputs: dict[str, torch.Tensor]) -> None:
    # grad_bt / (-A_b n_bt) is the weight: one value per sample under GSPO, varying per token under PPO.
    mask = inputs["mask"]
    n = mask / mask.sum(1, keepdim=True).clamp(min=1) / mask.shape[0]  # grpo (B, T)
    for objective, one_per_sample in ((GSPO, True), (PPOObjectiveConfig(), False)):
        _, grad, _ = run(inputs, "grpo", objective, off_policy=TISConfig(cap=100.0))
        weight = grad / (-inputs["advantages"][:, None] * n.clamp(min=1e-12))  # (B, T)
        spread = [weight[b][mask[b] > 0] for b in range(mask.shape[0]) if mask[b].sum() > 1 and grad[b].abs().sum() > 0]
        assert spread, "some sample must train"
        same = all(torch.allclose(w, w[0].expand_as(w), rtol=1e-5) for w in spread)
        assert same is one_per_sample


def test_cispo_keeps_the_gradient_of_tokens_that_ppo_clips(inputs: dict[str, torch.Tensor]) -> None:
    mask, adv = inputs["mask"].bool(), inputs["advantages"][:, None].expand_as(inputs["mask"])
    r = (inputs["logprobs"] - inputs["sampler"]).exp()
    ppo_clipped = mask & (((adv > 0) & (r > 1 + CISPO.eps_high)) | ((adv < 0) & (r < 1 - CISPO.eps_low)))
    assert ppo_clipped.any()
    ppo = GRPOLossConfig(eps_low=CISPO.eps_low, eps_high=CISPO.eps_high)
    logprobs = inputs["logprobs"].clone().requires_grad_(True)
    loss, _ = policy_loss(logprobs, inputs["sampler"], inputs["advantages"], inputs["mask"], totals=totals_of(inputs["mask"]),
                          loss=ppo, off_policy=NO_MASK, entropy=torch.zeros_like(logprobs))
    loss.backward()
    assert torch.all(logprobs.grad[ppo_clipped] == 0), "PPO drops them"
    _, cispo_grad, _ = run(inputs, "grpo", CISPO)
    assert torch.all(cispo_grad[ppo_clipped] != 0), "CISPO keeps them"
    # ... with the clipped weight: -n * (1 + eps_high) * A above the ceiling, -n * (1 - eps_low) * A below the floor.
    n = inputs["mask"] / inputs["mask"].sum(1, keepdim=True).clamp(min=1) / inputs["mask"].shape[0]
    expected = torch.where(r > 1 + CISPO.eps_high, 1 + CISPO.eps_high, 1 - CISPO.eps_low) * -adv * n
    torch.testing.assert_close(cispo_grad[ppo_clipped], expected[ppo_clipped], rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize("norm, name, correction", list(itertools.product(LOSSES, OBJECTIVES, CORRECTIONS)))
@pytest.mark.kernels
def test_micro_batches_sum_to_the_whole_batch(inputs: dict[str, torch.Tensor], norm: str, name: str, correction: str) -> None:
    whole, whole_grad, _ = run(inputs, norm, OBJECTIVES[name], off_policy=CORRECTIONS[correction])
    parts = 0.0
    for rows in ([0, 3, 5], [1, 2], [4, 6, 7]):
        loss, grad, _ = run(inputs, norm, OBJECTIVES[name], off_policy=CORRECTIONS[correction], rows=rows)
        parts += loss.item()
        torch.testing.assert_close(grad, whole_grad[rows], rtol=1e-6, atol=1e-9)
    assert parts == pytest.approx(whole.item(), rel=1e-6, abs=1e-8)


@pytest.mark.parametrize("name", list(OBJECTIVES))
@pytest.mark.kernels
def test_gspo_and_cispo_take_only_the_mask_of_the_off_policy_correction(inputs: dict[str, torch.Tensor], name: str) -> None:
    # Their own ratio is the importance weight: TIS (a weight, no mask) changes nothing; IcePop's mask applies.
    plain, plain_grad, _ = run(inputs, "token", OBJECTIVES[name], off_policy=NO_MASK)
    tis, tis_grad, _ = run(inputs, "token", OBJECTIVES[name], off_policy=TISConfig(cap=1.01))
    assert tis.item() == plain.item() and torch.equal(tis_grad, plain_grad)
    icepop = CORRECTIONS["icepop"]
    _, grad, sums = run(inputs, "token", OBJECTIVES[name], off_policy=icepop)
    r = (inputs["logprobs"] - inputs["sampler"]).exp()
    outside = inputs["mask"].bool() & ((r < icepop.low) | (r > icepop.high))
    assert outside.any() and torch.all(grad[outside] == 0)
    inside = inputs["mask"].bool() & ~outside
    torch.testing.assert_close(grad[inside], plain_grad[inside])
    assert summarize({k: v.item() for k, v in sums.items()})["masked_fraction"] == pytest.approx(
        outside.sum().item() / inputs["mask"].sum().item())


def test_stats_count_gspo_clipped_tokens_and_cispo_clipped_weights(inputs: dict[str, torch.Tensor]) -> None:
    mask, adv = inputs["mask"], inputs["advantages"]
    log_ratio = (inputs["logprobs"] - inputs["sampler"]) * mask
    lengths = mask.sum(1)
    s = (log_ratio.sum(1) / lengths.clamp(min=1)).exp()
    clipped_samples = ((adv > 0) & (s > 1 + GSPO.eps_high)) | ((adv < 0) & (s < 1 - GSPO.eps_low))
    stats = summarize({k: v.item() for k, v in run(inputs, "grpo", GSPO)[2].items()})
    assert stats["clipped_fraction"] == pytest.approx((lengths * clipped_samples).sum().item() / mask.sum().item())
    assert stats["is_truncated_fraction"] == 0.0

    r = log_ratio.exp()[mask.bool()]
    stats = summarize({k: v.item() for k, v in run(inputs, "grpo", CISPO)[2].items()})
    outside = ((r > 1 + CISPO.eps_high) | (r < 1 - CISPO.eps_low)).sum().item()
    assert stats["is_truncated_fraction"] == pytest.approx(outside / mask.sum().item())
    assert stats["clipped_fraction"] == 0.0, "CISPO drops no token"


@pytest.mark.parametrize("name", list(OBJECTIVES))
def test_on_policy_gspo_and_cispo_are_plain_reinforce(name: str) -> None:
    # Ratio 1 everywhere: weight 1, nothing clipped, so the gradient is -A n (grpo of one sample, 2 tokens).
    lp = torch.tensor([[-0.5, -1.0]], requires_grad=True)
    loss, _ = policy_loss(lp, lp.detach().clone(), torch.tensor([2.0]), torch.ones(1, 2), totals=BatchTotals(1, 2, MAX_TOKENS),
                          loss=GRPOLossConfig(), off_policy=TISConfig(), entropy=torch.zeros(1, 2),
                          objective=OBJECTIVES[name])
    loss.backward()
    assert loss.item() == pytest.approx(-2.0 * (-1.5) / 2)
    torch.testing.assert_close(lp.grad, torch.tensor([[-1.0, -1.0]]))


@pytest.mark.parametrize(
    ("objective", "field"),
    [
        ({"type": "gspo", "eps_low": -1e-4}, "trainer.objective.eps_low"),
        ({"type": "gspo", "eps_high": 0}, "trainer.objective.eps_high"),
        ({"type": "cispo", "eps_high": -0.2}, "trainer.objective.eps_high"),
        ({"type": "cispo", "eps_low": 1.5}, "trainer.objective.eps_low"),
        ({"type": "ppo", "eps_low": 0.2}, "trainer.objective.eps_low"),  # ppo's clip lives in [trainer.loss]
        ({"type": "grpo"}, "trainer.objective"),  # a normalization is not an objective
    ],
    ids=["gspo-negative-eps", "gspo-zero-eps", "cispo-negative-eps", "cispo-floor-below-zero", "ppo-own-eps", "unknown"],
)
def test_bad_objective_is_a_config_error_naming_the_field(objective: dict, field: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config({"trainer": {"objective": objective}}, source="run.toml")
    message = str(info.value)
    assert field in message and "run.toml" in message


def test_objective_defaults_to_ppo_and_takes_the_papers_clip_ranges() -> None:
    config = parse_config({}, source="run.toml")
    assert config.trainer.objective == PPOObjectiveConfig()
    gspo = parse_config({"trainer": {"objective": {"type": "gspo"}}}, source="run.toml").trainer.objective
    assert (gspo.eps_low, gspo.eps_high) == (3e-4, 4e-4)
    cispo = parse_config({"trainer": {"objective": {"type": "cispo"}}}, source="run.toml").trainer.objective
    assert cispo.eps_low == 1.0  # no floor on the weight, as in MiniMax-M1


def trl_formulation(inputs: dict[str, torch.Tensor], norm: str, kind: str, eps_low: float, eps_high: float
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """TRL's GRPOTrainer loss on the same tensors, as its `_compute_loss` writes it (read from
    huggingface/trl's grpo_trainer.py, not imported: TRL is not a dependency), with the workers'
    logprobs as its `old_per_token_logps`:
    - GSPO is `importance_sampling_level = "sequence"`: log w = the masked mean of the log-ratio,
      one w per sample; per-token loss -min(w A, clamp(w, 1 - eps_low, 1 + eps_high) A);
    - CISPO is `loss_type = "cispo"`: per-token loss -sg(clamp(r, max=epsilon_high)) A log pi, its
      `epsilon_high` an absolute bound on the ratio (decentrl's 1 + eps_high; decentrl's floor
      1 - eps_low is 0 at eps_low = 1, TRL's none);
    then TRL's `grpo` (each sample's token mean, then the batch mean; an empty sample counted as
    decentrl counts it) or `dapo` (the batch's token mean) aggregation. Returns (loss, d loss / d logprobs)."""
    logprobs = inputs["logprobs"].clone().double().requires_grad_(True)
    sampler, mask = inputs["sampler"].double(), inputs["mask"].double()
    advantages = inputs["advantages"].double()[:, None]  # (B, 1)
    log_ratio = logprobs - sampler
    if kind == "gspo":
        coef_1 = torch.exp((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)  # (B, 1)
        coef_2 = torch.clamp(coef_1, 1 - eps_low, 1 + eps_high)
        per_token = -torch.min(coef_1 * advantages, coef_2 * advantages).expand_as(logprobs)
    else:
        clamped = torch.clamp(torch.exp(log_ratio), max=1 + eps_high).detach()
        per_token = -clamped * advantages * logprobs
    if norm == "grpo":
        loss = ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).sum() / mask.shape[0]
    else:
        loss = (per_token * mask).sum() / mask.sum().clamp(min=1.0)
    loss.backward()
    assert logprobs.grad is not None
    return loss.detach(), logprobs.grad


@pytest.mark.parametrize(("kind", "norm"), [("gspo", "grpo"), ("gspo", "token"), ("cispo", "grpo"), ("cispo", "token")])
@pytest.mark.kernels
def test_gspo_and_cispo_equal_trls_formulation_on_the_same_tensors(inputs: dict[str, torch.Tensor], kind: str, norm: str) -> None:
    """The gradient equals TRL's (`importance_sampling_level = "sequence"`, `loss_type = "cispo"`)
    with sequence-level advantages, the case TRL covers (decentrl's GSPO-token form also takes
    per-token ones; its CISPO here with no floor, as TRL's). CISPO's value too: both write it
    -sg(w) A log pi. GSPO's value differs by design: TRL's is the ratio surrogate -min(w A, ...),
    decentrl's the same weight on -A log pi, whose gradient is the same (grad w = w grad log pi)."""
    objective = GSPO if kind == "gspo" else CISPOObjectiveConfig(eps_low=1.0, eps_high=0.2)
    loss, grad, _ = run(inputs, norm, objective)
    expected_loss, expected_grad = trl_formulation(inputs, norm, kind, objective.eps_low, objective.eps_high)
    torch.testing.assert_close(grad.double(), expected_grad, rtol=1e-5, atol=1e-7)
    assert grad.abs().sum() > 0
    if kind == "cispo":
        assert loss.item() == pytest.approx(expected_loss.item(), rel=1e-5, abs=1e-7)
