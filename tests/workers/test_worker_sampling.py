"""The hf backend's sampling: truncation, renormalized logprobs, sampling masks, stop strings.

The reference is a single full forward pass over prompt + completion (no KV cache, no padding)
in float64: the logprob the backend reports for each token must be that of the truncated,
renormalized distribution at that position.
"""

from __future__ import annotations

import math

import pytest
import torch

from decentrl.api.wire import SamplingParams
from decentrl.config import TinyModelConfig
from decentrl.model.build import build_model, build_tiny_tokenizer
from decentrl.model.stopping import stop_cut
from decentrl.store.weights import write_hf_dir
from tests.tolerances import rounding_atol
from workers.backends.hf import HFBackend, sampling_distribution, without_cudnn_attention

TINY = TinyModelConfig(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, seed=3)


def write_version(directory: str, model: torch.nn.Module) -> str:
    """A checkpoint directory exactly as the trainer publishes one."""
    tokenizer = build_tiny_tokenizer()
    tokenizer.save_pretrained(directory)
    model.generation_config.save_pretrained(directory)
    write_hf_dir(directory, model.state_dict(), model.config, extras_from=directory)
    return directory


@pytest.fixture(scope="module")
def backend(tmp_path_factory: pytest.TempPathFactory) -> HFBackend:
    model = build_model(TINY)
    hf = HFBackend(seed=0)
    hf.load(write_version(str(tmp_path_factory.mktemp("v0")), model), 0)
    return hf


def reference_logprobs(model: torch.nn.Module, prompt: list[int], completion: list[int], sampling: SamplingParams) -> list[float]:
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].double()  # (T, V)
    dist = sampling_distribution(logits, sampling)
    return dist.gather(-1, torch.tensor(completion)[:, None]).squeeze(-1).tolist()


def test_top_k_keeps_k_tokens_renormalized() -> None:
    logits = torch.tensor([[3.0, 1.0, 2.0, 0.0, -1.0]])
    dist = sampling_distribution(logits, SamplingParams(temperature=0.5, max_tokens=1, top_k=2))
    kept = torch.isfinite(dist[0]).nonzero().squeeze(-1).tolist()
    assert kept == [0, 2]
    expected = torch.log_softmax(torch.tensor([3.0, 2.0]) / 0.5, dim=-1)
    assert dist[0, [0, 2]].tolist() == pytest.approx(expected.tolist(), abs=1e-6)
    assert float(dist[0].exp().sum()) == pytest.approx(1.0, abs=1e-6)


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    probs = torch.tensor([[0.5, 0.25, 0.15, 0.1]])
    logits = probs.log()
    # 0.5 < 0.7, 0.5 + 0.25 >= 0.7: the crossing token stays, the rest go.
    dist = sampling_distribution(logits, SamplingParams(temperature=1.0, max_tokens=1, top_p=0.7))
    assert torch.isfinite(dist[0]).tolist() == [True, True, False, False]
    assert dist[0, :2].exp().tolist() == pytest.approx([0.5 / 0.75, 0.25 / 0.75], abs=1e-6)
    # The most likely token is kept even when it alone exceeds top_p.
    only = sampling_distribution(logits, SamplingParams(temperature=1.0, max_tokens=1, top_p=0.1))
    assert torch.isfinite(only[0]).tolist() == [True, False, False, False]
    assert float(only[0, 0]) == pytest.approx(0.0, abs=1e-6)


@pytest.mark.parametrize(
    "sampling",
    [
        SamplingParams(temperature=1.0, max_tokens=6),
        SamplingParams(temperature=0.7, max_tokens=6, top_k=4),
        SamplingParams(temperature=1.3, max_tokens=6, top_p=0.8),
        SamplingParams(temperature=1.0, max_tokens=6, top_k=6, top_p=0.9),
    ],
)
@pytest.mark.kernels
def test_logprobs_are_those_of_the_sampled_distribution(backend: HFBackend, sampling: SamplingParams) -> None:
    # Prompts of different lengths exercise the left padding and the position ids.
    prompts = [[1, 7, 5, 8, 5, 3], [1, 4, 3], [1, 12, 11, 10, 9, 8, 7, 3]] * 3
    completions = backend.generate(prompts, sampling)
    assert backend.model is not None
    for prompt, completion in zip(prompts, completions, strict=True):
        assert 1 <= len(completion.token_ids) <= sampling.max_tokens
        expected = reference_logprobs(backend.model, prompt, completion.token_ids, sampling)
        assert completion.logprobs == pytest.approx(expected, abs=2e-4)
        if sampling.top_k == 0 and sampling.top_p == 1.0:
            assert completion.sampling_mask is None
            continue
        assert completion.sampling_mask is not None and len(completion.sampling_mask) == len(completion.token_ids)
        for token, kept in zip(completion.token_ids, completion.sampling_mask, strict=True):
            assert token in kept
            if sampling.top_k:
                assert len(kept) <= sampling.top_k
        # The mask is exactly the finite support of the reference distribution.
        ids = torch.tensor([prompt + completion.token_ids])
        with torch.no_grad():
            logits = backend.model(input_ids=ids).logits[0, len(prompt) - 1 : -1]
        support = torch.isfinite(sampling_distribution(logits, sampling))
        assert [row.nonzero().squeeze(-1).tolist() for row in support] == completion.sampling_mask


def test_finish_reasons_and_eos(backend: HFBackend) -> None:
    completions = backend.generate([[1, 5, 3]] * 32, SamplingParams(temperature=1.0, max_tokens=4))
    eos = 2
    for completion in completions:
        if completion.finish_reason == "stop":
            assert completion.token_ids[-1] == eos and eos not in completion.token_ids[:-1]
        else:
            assert completion.finish_reason == "length" and len(completion.token_ids) == 4
            assert eos not in completion.token_ids
    assert {c.finish_reason for c in completions} == {"stop", "length"}  # both happen with a random model


def test_stop_strings_end_the_completion_at_the_completing_token(backend: HFBackend) -> None:
    sampling = SamplingParams(temperature=1.5, max_tokens=12, stop=["7", "00"])
    for completion in backend.generate([[1, 5, 3]] * 24, sampling):
        text = backend._text(completion.token_ids)
        if completion.finish_reason == "stop" and completion.token_ids[-1] != 2:
            assert text.endswith("7") or text.endswith("00")
        assert "7" not in backend._text(completion.token_ids[:-1])
        assert "00" not in backend._text(completion.token_ids[:-1])


def test_stop_cut_finds_multi_token_stops() -> None:
    text_of = "".join  # one character per token
    assert stop_cut(text_of, list("12=45"), ["=4"]) == 4
    assert stop_cut(text_of, list("12=45"), ["9"]) is None
    assert stop_cut(text_of, list("12=45"), []) is None
    assert stop_cut(text_of, list("1234"), ["34"], start=3) == 4


def test_interruption_returns_partial_completions(backend: HFBackend) -> None:
    calls = []

    def after_two_tokens() -> bool:
        calls.append(1)
        return len(calls) >= 2

    completions = backend.generate([[1, 5, 3]] * 4, SamplingParams(temperature=1.0, max_tokens=8), after_two_tokens)
    for completion in completions:
        assert len(completion.token_ids) <= 2
        assert completion.finish_reason in ("stop", "interrupted")
        assert all(math.isfinite(lp) and lp <= 0 for lp in completion.logprobs)


@pytest.mark.kernels
def test_seeded_rows_do_not_depend_on_their_batch(backend: HFBackend) -> None:
    """Deterministic runs: row i samples from its own generator, so a row's tokens are the same
    alone, next to other rows, or in another place of the call (workers/batching.py); its
    logprobs are the same to rounding, and bitwise in a call of the same shape."""
    sampling = SamplingParams(temperature=1.0, max_tokens=8)
    prompt, other = [1, 5, 3, 7], [1, 6, 2, 4]
    alone = backend.generate([prompt], sampling, seeds=[11])[0]
    paired = backend.generate([other, prompt, other], sampling, seeds=[5, 11, 6])
    assert paired[1].token_ids == alone.token_ids
    again = backend.generate([prompt, prompt], sampling, seeds=[11, 12])
    assert again[0].token_ids == alone.token_ids
    # One, two and three rows are other matmul shapes, which on some CPUs take other kernels (an
    # AVX2 EPYC, 2026-11-28: a last bit apart), so the logprobs agree to rounding: each is
    # z - logsumexp(z) over the vocabulary, of magnitude about log(vocab) (the tiny model's logits
    # are below 1: their matmuls' rounding is far smaller).
    assert backend.model is not None
    vocab = backend.model.config.vocab_size
    close = rounding_atol(torch.float32, max(abs(lp) for lp in alone.logprobs), terms=vocab)
    assert again[0].logprobs == pytest.approx(alone.logprobs, abs=close, rel=0)
    assert paired[1].logprobs == pytest.approx(alone.logprobs, abs=close, rel=0)
    # The same call again: the same shapes, kernels and seeds, so bitwise.
    assert backend.generate([prompt, prompt], sampling, seeds=[11, 12]) == again
    with pytest.raises(ValueError, match="one seed per prompt"):
        backend.generate([prompt], sampling, seeds=[1, 2])


@pytest.mark.gpu
def test_the_gpu_sampler_draws_from_the_distribution() -> None:
    """On CUDA the hf backend's draws follow p, a zero-probability id is never drawn, and per-row
    seeds reproduce a row (checked on an H100, 2026-11-26)."""
    backend = HFBackend(device="cuda", seed=0)
    p = torch.tensor([0.1, 0.2, 0.7, 0.0], device="cuda")
    dist = p.log().expand(200_000, 4)
    counts = torch.bincount(backend._sample(dist, None).squeeze(-1), minlength=4).double() / 200_000
    assert torch.allclose(counts, p.double(), atol=0.005)
    assert counts[3] == 0
    seeded = [torch.Generator(device="cuda").manual_seed(s) for s in (1, 2)]
    again = [torch.Generator(device="cuda").manual_seed(s) for s in (1, 2)]
    assert torch.equal(backend._sample(dist[:2], seeded), backend._sample(dist[:2], again))


def test_the_decode_leaves_cudnn_attention_off_on_cuda_only_and_puts_it_back() -> None:
    """cuDNN's SDPA builds a plan per sequence length (a decode meets a new one every token): the
    hf backend decodes without it on CUDA, and leaves the process's setting as it found it."""
    before = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        torch.backends.cuda.enable_cudnn_sdp(True)
        with without_cudnn_attention(torch.device("cpu")):
            assert torch.backends.cuda.cudnn_sdp_enabled()
        with pytest.raises(RuntimeError, match="mid-decode"), without_cudnn_attention(torch.device("cuda", 0)):
            assert not torch.backends.cuda.cudnn_sdp_enabled()
            raise RuntimeError("mid-decode")
        assert torch.backends.cuda.cudnn_sdp_enabled()
        torch.backends.cuda.enable_cudnn_sdp(False)  # a process that had turned it off keeps it off
        with without_cudnn_attention(torch.device("cuda")):
            pass
        assert not torch.backends.cuda.cudnn_sdp_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)


@pytest.mark.gpu
def test_the_gpu_decode_runs_without_cudnn_attention(tmp_path) -> None:  # noqa: ANN001
    hf = HFBackend(device="cuda", seed=0)
    hf.load(write_version(str(tmp_path), build_model(TINY)), 0)
    seen: list[bool] = []
    hf.model.register_forward_pre_hook(lambda *_: seen.append(torch.backends.cuda.cudnn_sdp_enabled()))
    hf.generate([[5, 6, 7]], SamplingParams(temperature=1.0, max_tokens=4))
    assert seen and not any(seen)
    assert torch.backends.cuda.cudnn_sdp_enabled()
