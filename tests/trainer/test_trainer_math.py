"""Trainer-side tensor math (collate, token_logprobs) and its agreement with the hf worker backend.

The train/inference consistency check: logprobs the worker reports for the tokens it sampled
must equal what the trainer recomputes for the same tokens with the same weights; otherwise
the importance ratio is biased before any staleness.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from decentrl.api.wire import SamplingParams, TrainSample
from decentrl.config import PretrainedModelConfig, TinyModelConfig
from decentrl.model.build import build_model, end_of_sequence_ids
from decentrl.trainer.train import collate, token_logprobs
from workers.backends import Completion
from workers.backends.hf import HFBackend

TINY = TinyModelConfig(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64)


def sample(prompt: list[int], completion: list[int], logprobs: list[float] | None = None, advantage: float = 0.0) -> TrainSample:
    return TrainSample(
        prompt_token_ids=prompt,
        completion_token_ids=completion,
        logprobs=logprobs if logprobs is not None else [-0.1 * (i + 1) for i in range(len(completion))],
        advantage=advantage,
        reward=0.0,
        policy_version=0,
    )


@pytest.fixture(scope="module")
def model() -> PreTrainedModel:
    return build_model(TINY).eval()


@pytest.fixture(scope="module")
def checkpoint_dir(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, tmp_path_factory: pytest.TempPathFactory
) -> str:
    directory = tmp_path_factory.mktemp("tiny-v0")
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return str(directory)


@pytest.fixture(scope="module")
def backend(checkpoint_dir: str) -> HFBackend:
    backend = HFBackend(device="cpu")
    backend.load(checkpoint_dir, 0)
    return backend


# -- collate ------------------------------------------------------------------------------


def test_collate_places_completion_at_shifted_positions() -> None:
    short = sample([1, 7, 3], [5, 2], logprobs=[-0.5, -0.25], advantage=1.5)
    long = sample([1, 7, 5, 8, 3], [4, 4, 6, 2], logprobs=[-1.0, -2.0, -3.0, -4.0], advantage=-0.5)
    batch = collate([short, long], pad_id=0)

    assert batch.input_ids.tolist() == [[1, 7, 3, 5, 2, 0, 0, 0, 0], [1, 7, 5, 8, 3, 4, 4, 6, 2]]
    assert batch.attention_mask.tolist() == [[1] * 5 + [0] * 4, [1] * 9]
    # Completion token j sits at p + j and is predicted at p - 1 + j; the per-token tensors begin
    # at the first position any row predicts a completion token from (the shorter prompt's p - 1).
    assert batch.start == 2
    assert batch.completion_mask.tolist() == [[1, 1, 0, 0, 0, 0], [0, 0, 1, 1, 1, 1]]
    assert batch.sampler_logprobs.tolist() == [[-0.5, -0.25, 0, 0, 0, 0], [0, 0, -1.0, -2.0, -3.0, -4.0]]
    # Each completion position carries its sample's advantage (per token: process rewards may differ).
    assert batch.advantages.tolist() == [[1.5, 1.5, 0, 0, 0, 0], [0, 0, -0.5, -0.5, -0.5, -0.5]]
    # The targets under the mask are exactly the completion tokens.
    targets = batch.targets
    assert targets.tolist() == batch.input_ids[:, 3:].tolist()
    assert targets[0][batch.completion_mask[0].bool()].tolist() == [5, 2]
    assert targets[1][batch.completion_mask[1].bool()].tolist() == [4, 4, 6, 2]


def test_collate_places_token_advantages_at_the_shifted_completion_positions() -> None:
    process = sample([1, 7, 3], [5, 2], advantage=9.0).model_copy(update={"token_advantages": [0.25, -0.5]})
    outcome = sample([1, 7, 5, 8], [4, 4, 6], advantage=-0.75)
    batch = collate([process, outcome], pad_id=0)
    # Token advantages replace the sample's advantage; a sample without them carries its scalar
    # advantage at each of its completion positions.
    assert batch.advantages.tolist() == [[0.25, -0.5, 0, 0], [0, -0.75, -0.75, -0.75]]
    assert batch.advantages.shape == batch.completion_mask.shape


def test_collate_shapes_and_dtypes() -> None:
    batch = collate([sample([1, 4], [5]), sample([1], [6, 7, 2])], pad_id=0)
    assert batch.input_ids.shape == batch.attention_mask.shape == (2, 4)
    assert batch.completion_mask.shape == batch.sampler_logprobs.shape == batch.advantages.shape == (2, 3)
    assert batch.input_ids.dtype == torch.long
    assert batch.completion_mask.dtype == batch.sampler_logprobs.dtype == batch.advantages.dtype == torch.float32
    assert batch.completion_mask.sum().item() == 4
    assert batch.start == 0  # a one-token prompt predicts its first completion token from position 0


# -- token_logprobs -----------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.kernels
def test_token_logprobs_equal_hand_computed_log_softmax(model: PreTrainedModel, temperature: float) -> None:
    prompt, completion = [1, 7, 5, 8, 5, 3], [5, 5, 7, 8, 2]
    # A shorter second row makes the first one carry no padding and the second one some.
    batch = collate([sample(prompt, completion), sample([1, 9, 3], [6, 2])], pad_id=0)
    with torch.no_grad():
        got = token_logprobs(model, batch, temperature)
        logits = model(input_ids=torch.tensor([prompt + completion])).logits[0]  # (L, V)
    assert got.shape == batch.completion_mask.shape

    p = len(prompt)
    for j, token in enumerate(completion):
        expected = torch.log_softmax(logits[p - 1 + j].double() / temperature, dim=-1)[token]
        assert got[0, p - 1 + j - batch.start].item() == pytest.approx(expected.item(), abs=1e-5)
    assert torch.all(got <= 0)


def test_token_logprobs_carry_gradient(model: PreTrainedModel) -> None:
    batch = collate([sample([1, 7, 3], [5, 2])], pad_id=0)
    model.zero_grad()
    lp = token_logprobs(model, batch, 1.0)
    (lp * batch.completion_mask).sum().backward()
    assert model.lm_head.weight.grad is not None and model.lm_head.weight.grad.abs().sum() > 0
    model.zero_grad()


# -- hf backend vs trainer ----------------------------------------------------------------


def generate(backend: HFBackend, prompts: list[list[int]], sampling: SamplingParams, seed: int) -> list[Completion]:
    torch.manual_seed(seed)
    return backend.generate(prompts, sampling)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.kernels
def test_hf_backend_logprobs_match_trainer_recompute(
    backend: HFBackend, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, temperature: float
) -> None:
    # Prompts of different lengths exercise the backend's left padding.
    prompts = [tokenizer(text).input_ids for text in ("3141=", "27=", "9=", "504321=")] * 3
    sampling = SamplingParams(temperature=temperature, max_tokens=6)
    completions = generate(backend, prompts, sampling, seed=0)

    batch = collate(
        [sample(p, c.token_ids, logprobs=c.logprobs) for p, c in zip(prompts, completions)],
        pad_id=tokenizer.pad_token_id,
    )
    with torch.no_grad():
        trainer = token_logprobs(model, batch, temperature)
    mask = batch.completion_mask.bool()
    torch.testing.assert_close(trainer[mask], batch.sampler_logprobs[mask], atol=1e-4, rtol=0)


def test_hf_backend_finish_reason_and_length(backend: HFBackend, tokenizer: PreTrainedTokenizerBase) -> None:
    eos, max_tokens = tokenizer.eos_token_id, 6
    prompts = [tokenizer(text).input_ids for text in ("3141=", "27=", "0000=")] * 8
    completions = generate(backend, prompts, SamplingParams(temperature=1.0, max_tokens=max_tokens), seed=1)

    assert len(completions) == len(prompts)
    for c in completions:
        assert 1 <= len(c.token_ids) <= max_tokens
        assert len(c.logprobs) == len(c.token_ids)
        assert all(lp <= 0 for lp in c.logprobs)
        assert (c.finish_reason == "stop") == (c.token_ids[-1] == eos)
        assert eos not in c.token_ids[:-1]  # nothing after end-of-sequence
        if c.finish_reason == "length":
            assert len(c.token_ids) == max_tokens
    # The seed gives both outcomes, so both branches above were checked.
    assert {c.finish_reason for c in completions} == {"stop", "length"}


def test_hf_backend_swaps_weights_in_place(
    backend: HFBackend, checkpoint_dir: str, tokenizer: PreTrainedTokenizerBase, tmp_path: Path
) -> None:
    other = build_model(TINY.model_copy(update={"seed": 1}))
    other.save_pretrained(tmp_path)
    module = backend.model
    try:
        backend.load(str(tmp_path), 1)
        assert backend.version == 1 and backend.model is module
        for name, tensor in other.state_dict().items():
            torch.testing.assert_close(backend.model.state_dict()[name], tensor, rtol=0, atol=0)
        # And the logprobs it reports are now those of the new weights.
        prompts = [tokenizer("3141=").input_ids] * 4
        completions = generate(backend, prompts, SamplingParams(temperature=1.0, max_tokens=6), seed=2)
        batch = collate([sample(p, c.token_ids, logprobs=c.logprobs) for p, c in zip(prompts, completions)], 0)
        with torch.no_grad():
            trainer = token_logprobs(other.eval(), batch, 1.0)
        mask = batch.completion_mask.bool()
        torch.testing.assert_close(trainer[mask], batch.sampler_logprobs[mask], atol=1e-4, rtol=0)
    finally:
        backend.load(checkpoint_dir, 0)  # the module-scoped backend goes back to version 0


def test_hf_backend_cuts_at_any_of_several_eos_ids(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, tmp_path: Path
) -> None:
    eos = tokenizer.eos_token_id
    model.generation_config.eos_token_id = [eos, tokenizer.convert_tokens_to_ids("=")]
    try:
        model.save_pretrained(tmp_path)
    finally:
        model.generation_config.eos_token_id = eos
    backend = HFBackend(device="cpu")
    backend.load(str(tmp_path), 0)
    completions = generate(backend, [tokenizer("3141=").input_ids] * 16, SamplingParams(temperature=1.0, max_tokens=6), 0)
    stops = {eos, tokenizer.convert_tokens_to_ids("=")}
    assert any(c.token_ids[-1] in stops for c in completions)
    for c in completions:
        assert (c.finish_reason == "stop") == (c.token_ids[-1] in stops)
        assert not stops & set(c.token_ids[:-1])
    # The orchestrator's checks of how a generation ended accept every id the backend stops at,
    # read from the generation config, or from config.json when a checkpoint has none.
    assert end_of_sequence_ids(PretrainedModelConfig(path=str(tmp_path)), tokenizer) == stops
    (tmp_path / "generation_config.json").unlink()
    assert end_of_sequence_ids(PretrainedModelConfig(path=str(tmp_path)), tokenizer) == {eos}
