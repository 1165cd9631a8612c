"""GSPO and CISPO(+RLOO) wired end to end: a batch built by the orchestrator (orchestrator/batches.py
with the configured estimator) trains a tiny model for a few steps through the trainer's own step
(rank_share, accumulate_gradients) with the configured objective. Every parameter changes and the
best completion gains probability over the worst."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from decentrl.api.wire import Lease, TrainBatch
from decentrl.config import AdvantageConfig, TinyModelConfig, TrainerConfig
from decentrl.model.build import build_model
from decentrl.trainer.batching import collate, rank_share
from decentrl.trainer.step import accumulate_gradients, token_logprobs
from orchestrator.batches import build_batch
from orchestrator.buffer import Group

TINY = TinyModelConfig(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64)
MAX_TOKENS = 6
COMPLETIONS = [[3, 4, 5, 6], [7, 8, 9], [10, 11, 12, 13, 3], [4, 9, 12]]
REWARDS = [1.0, 0.0, 0.25, 0.5]


def on_policy_batch(model: torch.nn.Module, make_rollout: Any, advantages: AdvantageConfig) -> TrainBatch:
    """One group of four, advantages by the orchestrator, sampling logprobs those of `model`."""
    lease = Lease(lease_id="g", prompt_id=0, prompt_token_ids=[1, 5, 7], group_size=4, deadline=0.0)
    rollouts = [make_rollout(lease, ids) for ids in COMPLETIONS]
    group = Group.of("g", 0, rollouts, REWARDS)
    batch = build_batch([group], trainer_version=0, batch_id="b", advantages=advantages, rollouts_accepted=4, stale_dropped=0)
    with torch.no_grad():
        tensors = collate(batch.samples, 0)
        logprobs = token_logprobs(model, tensors, 1.0) * tensors.completion_mask  # (B, T)
    samples = [
        s.model_copy(update={"logprobs": logprobs[i][tensors.completion_mask[i] > 0].tolist()})
        for i, s in enumerate(batch.samples)
    ]
    return batch.model_copy(update={"samples": samples})


def mean_logprob(model: torch.nn.Module, batch: TrainBatch, index: int) -> float:
    with torch.no_grad():
        tensors = collate([batch.samples[index]], 0)
        return (token_logprobs(model, tensors, 1.0) * tensors.completion_mask).sum().item() / len(COMPLETIONS[index])


@pytest.mark.parametrize(
    ("objective", "estimator"),
    [({"type": "gspo"}, "grpo"), ({"type": "cispo"}, "rloo")],
    ids=["gspo", "cispo-rloo"],
)
def test_a_few_steps_with_the_objective_train_toward_the_best_completion(make_rollout: Any, objective: dict, estimator: str) -> None:
    torch.manual_seed(0)
    model = build_model(TINY).train()
    config = TrainerConfig(objective=objective, loss={"type": "token"}, micro_batch_tokens=16)
    batch = on_policy_batch(model, make_rollout, AdvantageConfig(type=estimator))
    advantages = [s.advantage for s in batch.samples]
    if estimator == "rloo":
        assert advantages[0] == pytest.approx(1.0 - (0.0 + 0.25 + 0.5) / 3)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    gap = mean_logprob(model, batch, 0) - mean_logprob(model, batch, 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    clipped, truncated = [], []  # per step: tokens whose gradient the clip dropped / whose weight it cut
    for _ in range(4):  # one batch, several steps: later steps are off-policy, so the clip and weights act
        _, totals, micro = rank_share(batch, rank=0, world=1, config=config, max_tokens=MAX_TOKENS, pad_id=0, device=torch.device("cpu"))
        assert len(micro) > 1, "the batch is split into micro-batches"
        loss, sums = accumulate_gradients(model, None, micro, totals=totals, config=config, temperature=1.0)
        assert torch.isfinite(loss) and sums["tokens"].item() == sum(map(len, COMPLETIONS))
        clipped.append(sums["clipped"].item())
        truncated.append(sums["truncated"].item())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    changed = [name for name, p in model.named_parameters() if not torch.equal(p.detach(), before[name])]
    assert changed == [name for name, _ in model.named_parameters()], "every parameter trains"
    assert mean_logprob(model, batch, 0) - mean_logprob(model, batch, 1) > gap + 0.1
    assert clipped[0] == truncated[0] == 0, "on-policy: nothing clipped"
    if objective["type"] == "gspo":  # the paper's 3e-4/4e-4 range: one step moves every sample out of it
        assert min(clipped[1:]) > 0
    else:  # CISPO cuts weights, drops no token
        assert max(clipped) == 0 and max(truncated[1:]) > 0
