"""The trainer truncates its distribution as the worker did (sampling masks), so that with the
same weights its logprobs equal the worker's sampling logprobs: importance ratio 1.

Without the mask the trainer normalizes over the whole vocabulary and the ratio is off by the
probability mass top-k/top-p removed; with it, the ratio compares like with like.
"""

from __future__ import annotations

import pytest
import torch
from transformers import PreTrainedModel

from decentrl.api.wire import SamplingParams, TrainSample
from decentrl.config import TinyModelConfig
from decentrl.model.build import build_model
from decentrl.trainer.batching import collate
from decentrl.trainer.step import token_logprobs
from tests.workers.test_worker_sampling import write_version
from workers.backends.hf import HFBackend

TINY = TinyModelConfig(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, seed=5)
PROMPTS = [[1, 7, 5, 8, 3], [1, 4, 3], [1, 9, 9, 2, 6, 3, 3]] * 2


@pytest.fixture(scope="module")
def model_and_backend(tmp_path_factory: pytest.TempPathFactory) -> tuple[PreTrainedModel, HFBackend]:
    model = build_model(TINY).eval()
    backend = HFBackend(seed=4)
    backend.load(write_version(str(tmp_path_factory.mktemp("v0")), model), 0)
    return model, backend


def train_samples(backend: HFBackend, sampling: SamplingParams, *, with_mask: bool) -> list[TrainSample]:
    return [
        TrainSample(
            prompt_token_ids=prompt, completion_token_ids=c.token_ids, logprobs=c.logprobs, advantage=1.0,
            reward=0.0, policy_version=0, sampling_mask=c.sampling_mask if with_mask else None,
        )
        for prompt, c in zip(PROMPTS, backend.generate(PROMPTS, sampling), strict=True)
    ]


@pytest.mark.parametrize(
    "sampling",
    [SamplingParams(temperature=0.8, max_tokens=8, top_k=3), SamplingParams(temperature=1.2, max_tokens=8, top_p=0.6)],
    ids=["top_k", "top_p"],
)
@pytest.mark.kernels
def test_trainer_logprobs_with_the_mask_equal_the_workers(
    model_and_backend: tuple[PreTrainedModel, HFBackend], sampling: SamplingParams
) -> None:
    model, backend = model_and_backend
    masked = collate(train_samples(backend, sampling, with_mask=True), pad_id=0)
    assert masked.kept_ids is not None
    where = masked.completion_mask.bool()
    with torch.no_grad():
        trainer = token_logprobs(model, masked, sampling.temperature)
    ratio = (trainer - masked.sampler_logprobs)[where].exp()
    torch.testing.assert_close(ratio, torch.ones_like(ratio), atol=2e-4, rtol=0)
    # The same samples without their masks: the trainer's full-vocabulary logprobs are lower.
    plain = collate([s.model_copy(update={"sampling_mask": None}) for s in train_samples(backend, sampling, with_mask=True)], 0)
    assert plain.kept_ids is None
    with torch.no_grad():
        untruncated = token_logprobs(model, plain, sampling.temperature)
    gap = (plain.sampler_logprobs - untruncated)[plain.completion_mask.bool()]
    assert (gap > -1e-5).all() and gap.max() > 0.05


def test_mixed_batch_keeps_untruncated_samples_unchanged_and_gradients_finite(
    model_and_backend: tuple[PreTrainedModel, HFBackend],
) -> None:
    model, backend = model_and_backend
    truncated = train_samples(backend, SamplingParams(temperature=1.0, max_tokens=6, top_k=4), with_mask=True)
    full = train_samples(backend, SamplingParams(temperature=1.0, max_tokens=6), with_mask=True)
    assert all(s.sampling_mask is None for s in full)
    mixed = collate(truncated[:3] + full[:3], pad_id=0)
    alone = collate(full[:3], pad_id=0)
    assert mixed.kept_ids is not None and alone.kept_ids is None
    lp = token_logprobs(model, mixed, 1.0)
    where = mixed.completion_mask.bool()
    torch.testing.assert_close(lp[where], mixed.sampler_logprobs[where], atol=2e-4, rtol=0)
    # Rows without a mask are computed exactly as in a batch with no mask at all.
    with torch.no_grad():
        reference = token_logprobs(model, alone, 1.0)
    width = reference.shape[1]
    torch.testing.assert_close(lp[3:, :width].detach()[alone.completion_mask.bool()], reference[alone.completion_mask.bool()])
    model.zero_grad()
    (lp * mixed.completion_mask).sum().backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
    model.zero_grad()

