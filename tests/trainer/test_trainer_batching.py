"""Micro-batching under a token budget: the plan, and that gradient accumulation over micro-batches
reproduces the whole-batch loss and gradients exactly (decentrl/trainer/batching.py, step.py)."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import PreTrainedModel

from decentrl.api.wire import TrainSample
from decentrl.config import TinyModelConfig, TrainerConfig
from decentrl.model.build import build_model
from decentrl.trainer.batching import batch_totals, collate, idle_micro_batch, plan_micro_batches
from decentrl.trainer.step import accumulate_gradients

TINY = TinyModelConfig(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64)


@pytest.mark.parametrize("world, budget", [(1, 12), (2, 12), (2, 30), (3, 8), (4, 100)])
def test_plan_micro_batches_covers_every_sample_once_within_the_budget(world: int, budget: int) -> None:
    rng = random.Random(world * 100 + budget)
    lengths = [rng.randint(2, 8) for _ in range(23)]
    plans = plan_micro_batches(lengths, world, budget)

    assert len(plans) == world
    assert len({len(micro) for micro in plans}) == 1, "every rank runs the same number of micro-batches"
    assigned = sorted(i for micro in plans for rows in micro for i in rows)
    assert assigned == list(range(len(lengths)))
    for micro in plans:
        for rows in micro:
            if rows:
                assert len(rows) * max(lengths[i] for i in rows) <= budget
    # Round-robin from the longest: ranks' token counts differ by at most one longest sample.
    per_rank = [sum(lengths[i] for rows in micro for i in rows) for micro in plans]
    assert max(per_rank) - min(per_rank) <= max(lengths)


def test_plan_pads_ranks_with_fewer_samples_with_empty_micro_batches() -> None:
    plans = plan_micro_batches([5, 5, 5], world=2, token_budget=5)
    assert plans == [[[0], [2]], [[1], []]]
    assert plan_micro_batches([], world=2, token_budget=5) == [[], []]


def test_plan_rejects_a_sample_longer_than_the_budget_with_the_fix() -> None:
    with pytest.raises(ValueError, match="raise it to at least 9"):
        plan_micro_batches([4, 9, 3], world=1, token_budget=8)


def random_samples(n: int, seed: int) -> list[TrainSample]:
    rng = random.Random(seed)
    samples = []
    for i in range(n):
        prompt = [1] + [rng.randint(3, 13) for _ in range(rng.randint(2, 6))]
        completion = [rng.randint(3, 13) for _ in range(rng.randint(1, 6))]
        samples.append(
            TrainSample(
                prompt_token_ids=prompt,
                completion_token_ids=completion,
                logprobs=[-rng.uniform(0.5, 4.0) for _ in completion],
                advantage=rng.uniform(-1, 1),
                reward=rng.random(),
                policy_version=0,
                group_id=str(i // 4),
            )
        )
    return samples


def gradients_of(
    model: PreTrainedModel, samples: list[TrainSample], rows: list[list[int]], config: TrainerConfig
) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    micro = [collate([samples[i] for i in r], pad_id=0) if r else idle_micro_batch(0) for r in rows]
    loss, _ = accumulate_gradients(model, None, micro, totals=batch_totals(samples, 6), config=config, temperature=0.8)
    return loss.item(), {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("loss_type", ["grpo", "token", "dr_grpo"])
@pytest.mark.kernels
def test_micro_batched_loss_and_gradients_equal_the_whole_batch(loss_type: str) -> None:
    torch.manual_seed(0)
    model = build_model(TINY).train()
    samples = random_samples(12, seed=3)
    config = TrainerConfig(loss={"type": loss_type}, entropy_coef=0.01)

    whole_loss, whole = gradients_of(model, samples, [list(range(len(samples)))], config)
    (micro,) = plan_micro_batches([len(s.prompt_token_ids) + len(s.completion_token_ids) for s in samples], 1, 14)
    assert len(micro) >= 4, "the budget must split the batch"
    split_loss, split = gradients_of(model, samples, micro + [[]], config)  # an idle micro-batch adds nothing

    assert split_loss == pytest.approx(whole_loss, rel=1e-5, abs=1e-7)
    for name in whole:
        torch.testing.assert_close(split[name], whole[name], rtol=1e-4, atol=1e-7, msg=name)
    assert any(g.abs().sum() > 0 for g in whole.values())


def with_token_advantages(samples: list[TrainSample], seed: int) -> list[TrainSample]:
    rng = random.Random(seed)
    return [s.model_copy(update={"token_advantages": [rng.uniform(-1, 1) for _ in s.completion_token_ids]}) for s in samples]


@pytest.mark.kernels
def test_token_advantages_micro_batch_like_the_whole_batch() -> None:
    torch.manual_seed(0)
    model = build_model(TINY).train()
    samples = with_token_advantages(random_samples(12, seed=4), seed=5)
    config = TrainerConfig()
    whole_loss, whole = gradients_of(model, samples, [list(range(len(samples)))], config)
    (micro,) = plan_micro_batches([len(s.prompt_token_ids) + len(s.completion_token_ids) for s in samples], 1, 14)
    split_loss, split = gradients_of(model, samples, micro, config)
    assert split_loss == pytest.approx(whole_loss, rel=1e-5, abs=1e-7)
    for name in whole:
        torch.testing.assert_close(split[name], whole[name], rtol=1e-4, atol=1e-7, msg=name)


@pytest.mark.kernels
def test_token_advantages_equal_to_the_samples_advantage_train_exactly_like_it() -> None:
    torch.manual_seed(0)
    model = build_model(TINY).train()
    samples = random_samples(8, seed=6)
    same = [s.model_copy(update={"token_advantages": [s.advantage] * len(s.completion_token_ids)}) for s in samples]
    config = TrainerConfig()
    rows = [list(range(len(samples)))]
    loss, grads = gradients_of(model, samples, rows, config)
    token_loss, token_grads = gradients_of(model, same, rows, config)
    assert token_loss == loss
    for name in grads:
        assert torch.equal(token_grads[name], grads[name]), name
    # Different token advantages do change the step.
    other_loss, _ = gradients_of(model, with_token_advantages(samples, seed=7), rows, config)
    assert other_loss != loss
