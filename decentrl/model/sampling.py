"""The distribution a worker samples from, given the model's logits: shared by the HF worker
backend (workers/backends/hf.py, which samples from it) and the orchestrator's logprob
spot-checks (orchestrator/verify.py, which recomputes it). One definition, so the verifier
checks exactly the math the worker ran."""

from __future__ import annotations

import torch

from decentrl.api.wire import SamplingParams


def sampling_distribution(logits: torch.Tensor, sampling: SamplingParams) -> torch.Tensor:
    """Log-probabilities (B, V) of the distribution sampled from: -inf outside the kept set,
    renormalized over it. Order as in vLLM and transformers: temperature, top-k, top-p."""
    scaled = logits.float() / sampling.temperature  # (B, V)
    if sampling.top_k > 0 and sampling.top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, sampling.top_k, dim=-1).values[:, -1:]  # (B, 1)
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if sampling.top_p < 1.0:
        ordered, order = torch.sort(scaled, dim=-1, descending=True)
        probs = torch.softmax(ordered, dim=-1)
        # Keep tokens until the cumulative probability reaches top_p (the crossing token stays);
        # the most likely token is always kept.
        drop = (torch.cumsum(probs, dim=-1) - probs) >= sampling.top_p
        drop[:, 0] = False
        scaled = scaled.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return torch.log_softmax(scaled, dim=-1)
