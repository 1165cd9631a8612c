"""The loss's per-token statistics over chunks of positions (decentrl/trainer/step.py
`token_stats`, above [trainer] loss_chunk_mb): the same logprobs, entropies, loss and gradients as in
one piece, truncated sampling sets, temperature, the entropy bonus and the KL reference included.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from decentrl.api.wire import TrainSample
from decentrl.config import TinyModelConfig, TrainerConfig
from decentrl.model.build import build_model
from decentrl.trainer import step
from decentrl.trainer.batching import batch_totals, collate
from decentrl.trainer.step import accumulate_gradients, token_stats
from tests.tolerances import rounding_atol

WHOLE = 0  # never in chunks


def mb(elements: int) -> float:
    """loss_chunk_mb for chunks of `elements` float32 logits."""
    return (elements + 0.5) / 2**18


def logits_and_targets(rows: int = 3, positions: int = 10, vocab: int = 50) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(rows, positions, vocab, generator=generator) * 3
    kept = torch.full((rows, positions, 4), -1, dtype=torch.long)
    kept[0, 2:7] = torch.tensor([1, 5, 9, -1])  # truncated positions, one id of padding
    kept[2, :4] = torch.tensor([0, 2, 4, 6])
    targets = torch.randint(0, vocab, (rows, positions), generator=generator)
    targets[0, 2:7], targets[2, :4] = 5, 4  # a kept id where truncated
    return logits, targets, kept


def counted_chunks(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Appends the positions of every chunk `token_stats` computes apart (recomputed in the backward)."""
    chunks: list[int] = []
    real = step.checkpoint

    def counting(function, logits, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        chunks.append(logits.shape[1])
        return real(function, logits, *args, **kwargs)

    monkeypatch.setattr(step, "checkpoint", counting)
    return chunks


@pytest.mark.parametrize("entropy_grad", [False, True])
@pytest.mark.kernels
def test_chunks_give_the_whole_logprobs_entropies_and_gradients(monkeypatch: pytest.MonkeyPatch, entropy_grad: bool) -> None:
    base, targets, kept = logits_and_targets()
    chunks = counted_chunks(monkeypatch)
    results = []
    for chunk_mb in (WHOLE, mb(3 * 3 * 50)):  # 3 positions a chunk: 4 chunks, the last of 1
        logits = base.clone().requires_grad_(True)
        logprobs, entropies = token_stats(logits, targets, kept, 0.7, entropy_grad=entropy_grad, chunk_mb=chunk_mb)
        assert entropies.requires_grad == entropy_grad
        (logprobs.sum() + (0.1 * entropies.sum() if entropy_grad else 0)).backward()
        results.append((logprobs.detach(), entropies.detach(), logits.grad))
    assert chunks == [3, 3, 3, 1]  # the whole run in one piece, the chunked one in four
    (lp, h, grad), (lp_chunked, h_chunked, grad_chunked) = results
    assert torch.isfinite(lp).all() and torch.isfinite(grad).all()
    torch.testing.assert_close(lp_chunked, lp, rtol=0, atol=1e-6)
    torch.testing.assert_close(h_chunked, h, rtol=0, atol=1e-6)
    torch.testing.assert_close(grad_chunked, grad, rtol=0, atol=1e-6)


@pytest.mark.kernels
def test_the_compiled_statistics_in_chunks_give_the_eager_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    """[trainer] compile: the compiled statistics, each chunk recomputed in the backward, with truncated
    sampling sets, a temperature and the entropy's gradient, against the eager whole."""
    base, targets, kept = logits_and_targets()
    chunks = counted_chunks(monkeypatch)
    results = []
    for compiled, chunk_mb in ((False, WHOLE), (True, mb(3 * 3 * 50))):
        logits = base.clone().requires_grad_(True)
        logprobs, entropies = token_stats(logits, targets, kept, 0.7, entropy_grad=True, chunk_mb=chunk_mb, compiled=compiled)
        (logprobs.sum() + 0.1 * entropies.sum()).backward()
        results.append((logprobs.detach(), entropies.detach(), logits.grad))
    assert chunks == [3, 3, 3, 1]
    # Inductor's fused kernels round otherwise than the eager ones (and otherwise on each CPU: its
    # AVX2 code is not its AVX-512 code), so the two agree to float32 rounding. The tempered logits
    # z reach Z = max|z| (17.6 here). A logprob, z - logsumexp(z), and a gradient, (onehot - p) / T
    # plus the entropy's, round sums over the vocabulary of terms up to Z. The entropy,
    # n - sum p z with n = logsumexp(z) ~ Z, cancels: the normalizer's one rounding (u Z) is a
    # relative error of every p, which sum p z ~ Z carries as u Z^2 (1.2e-5 apart on an emulated
    # AVX2 CPU, 2026-11-28, against 1e-5 allowed before).
    z = base.abs().max().item() / 0.7
    vocab = base.shape[-1]
    sums_atol = rounding_atol(torch.float32, z, terms=vocab)
    (logprobs, entropies, grads), (want_logprobs, want_entropies, want_grads) = results[1], results[0]
    torch.testing.assert_close(logprobs, want_logprobs, rtol=0, atol=sums_atol)
    torch.testing.assert_close(entropies, want_entropies, rtol=0, atol=rounding_atol(torch.float32, z * z))
    torch.testing.assert_close(grads, want_grads, rtol=0, atol=sums_atol)


@pytest.mark.kernels
def test_chunks_of_bf16_logits_are_computed_in_float32(monkeypatch: pytest.MonkeyPatch) -> None:
    base, targets, _ = logits_and_targets()
    chunks = counted_chunks(monkeypatch)
    logprobs, entropies = token_stats(base.bfloat16(), targets, None, 1.0, chunk_mb=mb(3 * 2 * 50))
    assert chunks == [2] * 5
    want = base.bfloat16().float().log_softmax(-1).gather(-1, targets[..., None]).squeeze(-1)
    assert logprobs.dtype == entropies.dtype == torch.float32
    torch.testing.assert_close(logprobs, want, rtol=0, atol=1e-5)


def sample(prompt: list[int], completion: list[int], advantage: float) -> TrainSample:
    return TrainSample(prompt_token_ids=prompt, completion_token_ids=completion, logprobs=[-1.5] * len(completion),
                       advantage=advantage, reward=advantage, policy_version=0)


@pytest.mark.kernels
def test_a_step_in_chunks_gives_the_whole_steps_loss_stats_and_gradients(monkeypatch: pytest.MonkeyPatch) -> None:
    samples = [sample([1, 7, 3], [5, 2, 8, 2], 1.0), sample([1, 7, 5, 8, 3], [4, 4, 6, 2], -0.5), sample([1, 9], [6], 0.25)]
    torch.manual_seed(0)
    policy = build_model(TinyModelConfig(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64))
    reference = copy.deepcopy(policy)
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(0.01 * torch.randn_like(p))  # a KL term that is not zero
    chunks = counted_chunks(monkeypatch)
    runs = []
    for chunk_mb in (WHOLE, mb(3 * policy.config.vocab_size)):  # one position a chunk
        config = TrainerConfig(entropy_coef=0.01, kl_coef=0.05, loss_chunk_mb=chunk_mb)
        policy.zero_grad()
        loss, sums = accumulate_gradients(policy, reference, [collate(samples, pad_id=0)],
                                          totals=batch_totals(samples, 8), config=config, temperature=0.8)
        runs.append((loss, sums, [p.grad.clone() for p in policy.parameters()]))
    (loss, sums, grads), (loss_chunked, sums_chunked, grads_chunked) = runs
    assert chunks == [1] * 14  # the policy's and the reference's 7 positions (9 wide, from 1), one by one
    assert sums["kl_sum"] != 0 and sums["entropy_sum"] > 0
    torch.testing.assert_close(loss_chunked, loss, rtol=0, atol=1e-6)
    for key in sums:
        torch.testing.assert_close(sums_chunked[key], sums[key], rtol=0, atol=1e-5)
    for got, want in zip(grads_chunked, grads, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_the_loss_memory_benchmark_prints_its_ratios() -> None:
    """benchmarks/loss_memory.py at a tiny shape: the same code paths, figures that mean nothing."""
    root = Path(__file__).resolve().parents[2]
    command = [sys.executable, str(root / "benchmarks" / "loss_memory.py"), "--rows", "2", "--positions", "64",
               "--vocab", "1000", "--chunk-mb", str(mb(2 * 16 * 1000)), "--rounds", "1", "--threads", "1"]
    result = json.loads(subprocess.run(command, check=True, capture_output=True, text=True, timeout=300).stdout.splitlines()[-1])
    assert result["chunked_vs_whole_time"] > 0 and "chunked_vs_whole_peak" in result  # None where the whole grew nothing
    assert result["whole"]["seconds"] > 0 and result["chunked"]["peak_over_inputs_gb"] >= 0
    assert result["compiled_vs_whole_time"] > 0 and result["compiled"]["compile_s"] > 0 and "compiled_vs_whole_peak" in result
