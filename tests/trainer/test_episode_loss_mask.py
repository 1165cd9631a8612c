"""Multi-turn episodes on the data path: a rollout's loss mask marks environment tokens, the
trainer trains only the model's tokens (environment tokens are context: no loss, not counted,
their logprobs unused). Episodes themselves: tests/core/test_episodes.py.
"""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from decentrl.api.wire import Rollout, SamplingParams, TrainSample
from decentrl.config import TinyModelConfig, TrainerConfig
from decentrl.model.build import build_model
from decentrl.trainer.batching import batch_totals, collate
from decentrl.trainer.step import accumulate_gradients

SAMPLING = SamplingParams(temperature=1.0, max_tokens=8)
# completion: model turn [5, 6], environment feedback [9, 9, 4], model's final turn [7, 2]
COMPLETION, LOSS_MASK = [5, 6, 9, 9, 4, 7, 2], [1, 1, 0, 0, 0, 1, 1]


def rollout(**update: object) -> Rollout:
    values: dict[str, object] = dict(
        rollout_id="r", run_name="run", lease_id="l", prompt_id=0, worker_id="w", policy_version=0,
        prompt_token_ids=[1, 3], completion_token_ids=COMPLETION, logprobs=[-0.5] * 7, finish_reason="stop",
        sampling=SAMPLING, loss_mask=LOSS_MASK,
    )
    values.update(update)
    return Rollout(**values)  # type: ignore[arg-type]


def test_rollout_loss_mask_is_validated() -> None:
    assert rollout().loss_mask == LOSS_MASK
    with pytest.raises(ValidationError, match="loss_mask has 6 entries"):
        rollout(loss_mask=LOSS_MASK[:-1])
    with pytest.raises(ValidationError):
        rollout(loss_mask=[1, 1, 0, 0, 2, 1, 1])


def train_sample(env_logprob: float, env_tokens: list[int], loss_mask: list[int] | None = LOSS_MASK) -> TrainSample:
    completion = COMPLETION[:2] + env_tokens + COMPLETION[5:]
    logprobs = [-2.0, -2.5, env_logprob, env_logprob, env_logprob, -1.5, -2.2]
    return TrainSample(prompt_token_ids=[1, 3], completion_token_ids=completion, logprobs=logprobs, advantage=1.0,
                       reward=1.0, policy_version=0, loss_mask=loss_mask)


def gradients(samples: list[TrainSample]) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = build_model(TinyModelConfig(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64))
    config = TrainerConfig()
    accumulate_gradients(model, None, [collate(samples, pad_id=0)], totals=batch_totals(samples, SAMPLING.max_tokens),
                         config=config, temperature=1.0)
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def test_trainer_trains_only_model_tokens() -> None:
    sample = train_sample(0.0, [9, 9, 4])
    batch = collate([sample], pad_id=0)
    assert batch.start == 1 and batch.completion_mask[0].tolist() == [1, 1, 0, 0, 0, 1, 1]
    assert batch_totals([sample], 8).tokens == 4
    # Environment tokens' logprobs are not used: 0.0 or anything else gives the same gradient.
    same = gradients([train_sample(-7.0, [9, 9, 4])])
    for a, b in zip(gradients([sample]), same, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # Without the mask those tokens train (with their made-up logprobs): the gradient changes.
    unmasked = gradients([train_sample(0.0, [9, 9, 4], loss_mask=None)])
    assert any(not torch.allclose(a, b) for a, b in zip(gradients([sample]), unmasked, strict=True))
