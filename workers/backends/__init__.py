"""Inference backends (`[worker] backend`). Each loads a pulled checkpoint directory, swaps weights
in place, and returns the logprobs of the distribution actually sampled (after temperature and
top-k/top-p, renormalized over the kept set, which is returned as the sampling mask).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, Protocol

from decentrl.api.wire import ExpertRouting, SamplingParams
from decentrl.model.stopping import stop_cut

# "interrupted": stopped for a weight swap, continued under the new weights; never posted as such.
FinishReason = Literal["stop", "length", "interrupted"]


@dataclass(frozen=True)
class Completion:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    sampling_mask: list[list[int]] | None = None  # per token, the kept vocabulary ids; None: no truncation
    # MoE: the experts of every token fed, prompt first (decentrl/model/routing.py); None: not recorded.
    routes: ExpertRouting | None = None


# Backends whose engine batches concurrent requests itself (a server's continuous batching): every
# slot calls it at once and the worker does not combine their rows (workers/batching.py).
BATCHING_ITSELF = frozenset({"openai"})


def never() -> bool:
    return False


class Backend(Protocol):
    version: int | None
    records_routes: bool  # whether `generate` returns MoE routes (a keep_routing run needs them)
    plays_trees: bool  # whether it decodes tree leases step by step (workers/tree.py: hf, vllm)
    compute_dtype: str | None  # "float32", "bfloat16": what it computes in, once known (None: not said)

    def load(self, checkpoint_dir: str, version: int) -> None:
        """Make `version` (a verified local checkpoint directory) the weights used from now on."""
        ...

    def generate(
        self, prompts: list[list[int]], sampling: SamplingParams, should_stop: Callable[[], bool] = never
    ) -> list[Completion]:
        """One completion per prompt; once `should_stop()` is true, unfinished ones end "interrupted"
        (checked between tokens or chunks). The hf backend also takes `seeds=` (deterministic runs)."""
        ...


def truncates(sampling: SamplingParams) -> bool:
    """Whether sampling keeps only part of the vocabulary (so a sampling mask is recorded)."""
    return sampling.top_k > 0 or sampling.top_p < 1.0


def extended(before: Completion, chunk: Completion, sampling: SamplingParams, text: Callable[[list[int]], str]) -> Completion:
    """`before` continued by `chunk`: "stop" at a stop string, which may span the two (the engine
    saw only the chunk), "length" at the budget, else "interrupted" (more to generate). The
    sampling mask is kept where both have one."""
    ids, lps = before.token_ids + chunk.token_ids, before.logprobs + chunk.logprobs
    mask = None if before.sampling_mask is None or chunk.sampling_mask is None else before.sampling_mask + chunk.sampling_mask
    cut = stop_cut(text, ids, sampling.stop, start=len(before.token_ids))
    if cut is not None:
        return Completion(ids[:cut], lps[:cut], "stop", None if mask is None else mask[:cut])
    if chunk.finish_reason == "stop":
        return Completion(ids, lps, "stop", mask)
    return Completion(ids, lps, "length" if len(ids) >= sampling.max_tokens else "interrupted", mask)


def in_chunks(
    prompts: list[list[int]], sampling: SamplingParams, should_stop: Callable[[], bool], *, chunk_tokens: int,
    generate: Callable[[list[list[int]], SamplingParams, list[int]], list[Completion]], text: Callable[[list[int]], str],
) -> list[Completion]:
    """Completions generated `chunk_tokens` at a time, `generate(prompts, sampling, budgets)` called
    for the rows still open, so that `should_stop` can interrupt them between chunks."""
    done = [Completion([], [], "interrupted", [] if truncates(sampling) else None) for _ in prompts]
    while open_rows := [i for i, c in enumerate(done) if c.finish_reason == "interrupted"]:
        budgets = [min(chunk_tokens, sampling.max_tokens - len(done[i].token_ids)) for i in open_rows]
        chunks = generate([prompts[i] + done[i].token_ids for i in open_rows], sampling, budgets)
        for i, chunk in zip(open_rows, chunks, strict=True):
            done[i] = extended(done[i], chunk, sampling, text)
        if should_stop():
            break
    return done
