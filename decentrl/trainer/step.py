"""One rank's share of a training step: forward, loss and backward over its micro-batches.

Gradients accumulate in the (FSDP-sharded) parameters across micro-batches; because every loss
term is normalized by whole-batch counts, the accumulated gradient (summed over ranks by FSDP)
is exactly the gradient of the whole batch in one piece. Called by the training loop.
"""

from __future__ import annotations

import functools
import os
import shutil
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

from decentrl.config import TrainerConfig
from decentrl.model.routers import replaying, routers
from decentrl.rl.losses import STAT_KEYS, BatchTotals, policy_loss
from decentrl.trainer.batching import Tensors
from decentrl.trainer.distributed import reduce_gradients_after


def model_logits(model: torch.nn.Module, batch: Tensors) -> torch.Tensor:
    """The model's logits predicting `batch.targets`, in its compute dtype; the output layer skips
    the prompt positions before `batch.start`.  # (B, T, V)"""
    keep = batch.input_ids.shape[1] - batch.start
    return model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, logits_to_keep=keep, use_cache=False).logits[:, :-1]


def compile_blocks(model: torch.nn.Module) -> None:
    """`[trainer] compile`: each transformer block's forward compiled in place, before sharding, so
    FSDP2's hooks stay outside the compiled code and the state dict keeps its names. The blocks
    share their code, so one compilation serves them all, and a few more the first micro-batches
    whose length or row count differs (each varying dimension is then compiled dynamic)."""
    if routers(model):
        raise ValueError(
            "trainer.compile = true: this model has MoE routers, whose routes the trainer replays with hooks that a "
            "compiled block would not follow; set trainer.compile = false"
        )
    if missing := compiler_missing(next(model.parameters()).device):
        raise ValueError(f"trainer.compile = true needs {missing} to build its kernels; or set trainer.compile = false")
    for block in model.model.layers:
        block.forward = torch.compile(block.forward)


def compiler_missing(device: torch.device) -> str | None:
    """What torch.compile's inductor lacks to build kernels on `device`, or None: at start-up, not
    at the first step."""
    if device.type == "cuda":
        from torch.utils._triton import has_triton

        return None if has_triton() else "triton (installed with CUDA torch wheels: pip install triton)"
    compiler = os.environ.get("CXX", "c++")  # inductor's C++ compiler on Linux
    return None if shutil.which(compiler) else f"a C++ compiler ({compiler!r} is not on PATH: install g++, or set CXX)"


def token_stats(
    logits: torch.Tensor, targets: torch.Tensor, kept_ids: torch.Tensor | None, temperature: float, *,
    entropies: bool = True, entropy_grad: bool = False, chunk_mb: float = 0, compiled: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Each target's logprob under the tempered, float32 `logits` and, with `entropies`, each
    position's entropy (with a gradient only if `entropy_grad`).  # (B, T), (B, T) or None

    With `chunk_mb` ([trainer] loss_chunk_mb) and more float32 logits than that, over chunks of
    positions, each recomputed in the backward: at long completions and large vocabularies the
    whole's float32 copies, not the model, set a step's peak memory (16k positions x 152k ids:
    10 GB a copy). `compiled` ([trainer] compile): the float32 copy, the logsumexp, the gathers
    and the entropy fused into fewer passes over the logits."""
    stats = _compiled_token_stats() if compiled else _token_stats
    rows, positions, vocab = logits.shape
    per_chunk = max(1, int(chunk_mb * 2**18) // (rows * vocab))  # 4 bytes an element
    if not chunk_mb or per_chunk >= positions:
        return stats(logits, targets, kept_ids, temperature, entropies, entropy_grad)
    kept = kept_ids.split(per_chunk, dim=1) if kept_ids is not None else [None] * -(-positions // per_chunk)
    chunks = [
        checkpoint(stats, *args, temperature, entropies, entropy_grad, use_reentrant=False)
        for args in zip(logits.split(per_chunk, dim=1), targets.split(per_chunk, dim=1), kept, strict=True)
    ]
    return torch.cat([lp for lp, _ in chunks], dim=1), torch.cat([h for _, h in chunks], dim=1) if entropies else None


def _token_stats(
    logits: torch.Tensor, targets: torch.Tensor, kept_ids: torch.Tensor | None, temperature: float, entropies: bool,
    entropy_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    logits = logits.float()
    if temperature != 1.0:  # each pass over (B, T, V) costs memory bandwidth: none for temperature 1
        logits = logits / temperature
    normalizer = logits.logsumexp(dim=-1)  # (B, T)
    logprobs = sampled_logprobs(logits, targets, kept_ids, normalizer)
    if not entropies:
        return logprobs, None
    # Last: the backward's recomputation of a chunk stops once it has what the gradient needs,
    # so an entropy without gradient is not computed again.
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        return logprobs, entropy(logits, normalizer)


@functools.cache
def _compiled_token_stats():  # noqa: ANN202 - torch.compile's wrapper of _token_stats
    return torch.compile(_token_stats)


def sampled_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, kept_ids: torch.Tensor | None, normalizer: torch.Tensor
) -> torch.Tensor:
    """log softmax(logits)[target], without materializing the (B, T, V) log-softmax.  # (B, T)

    With `kept_ids` (B, T, K), positions the worker truncated normalize over the kept ids only:
    the logprob under the distribution it sampled from (logits outside the set at -inf), so the
    importance ratio compares like with like. Gathering K logits avoids a (B, T, V) mask.
    `normalizer`: logits.logsumexp(-1).
    """
    if kept_ids is not None:
        truncated = kept_ids[..., :1] >= 0  # (B, T, 1)
        # Padding is -inf only at truncated positions: an all -inf row would give a NaN
        # gradient through logsumexp even where torch.where discards its value.
        kept = logits.gather(-1, kept_ids.clamp(min=0)).masked_fill((kept_ids < 0) & truncated, float("-inf"))  # (B, T, K)
        normalizer = torch.where(truncated.squeeze(-1), kept.logsumexp(dim=-1), normalizer)
    return logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - normalizer


def entropy(logits: torch.Tensor, normalizer: torch.Tensor) -> torch.Tensor:
    """Entropy of each next-token distribution: logsumexp(z) - sum softmax(z) z, with
    `normalizer` = logsumexp(z).  # (B, T)"""
    return normalizer - ((logits - normalizer.unsqueeze(-1)).exp() * logits).sum(dim=-1)


def token_logprobs(model: torch.nn.Module, batch: Tensors, temperature: float) -> torch.Tensor:
    """Logprob of each next token under the tempered policy the workers sample from, with the
    workers' MoE routes replayed when the batch carries them.  # (B, T)"""
    with replaying(model, batch.routes):
        return token_stats(model_logits(model, batch), batch.targets, batch.kept_ids, temperature, entropies=False)[0]


def accumulate_gradients(
    model: torch.nn.Module,
    reference: torch.nn.Module | None,
    micro_batches: list[Tensors],
    *,
    totals: BatchTotals,
    config: TrainerConfig,
    temperature: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Forward and backward every micro-batch; returns this rank's loss and token sums (see policy_loss)."""
    loss_sum = torch.zeros(())
    sums = {key: torch.zeros(()) for key in STAT_KEYS}
    for index, batch in enumerate(micro_batches):
        reduce_gradients_after(model, last=index == len(micro_batches) - 1)
        # Routes replayed from the forward through the backward: activation checkpointing's
        # recomputation must route as the forward did (decentrl/model/routers.py).
        replay_reference = replaying(reference, batch.routes) if reference is not None else nullcontext()
        with replaying(model, batch.routes), replay_reference:
            loss, stats = micro_batch_loss(model, reference, batch, totals=totals, config=config, temperature=temperature)
            loss.backward()
        loss_sum = loss_sum.to(loss.device) + loss.detach()
        sums = merge_sums(sums, stats)
    return loss_sum, sums


def micro_batch_loss(
    model: torch.nn.Module,
    reference: torch.nn.Module | None,
    batch: Tensors,
    *,
    totals: BatchTotals,
    config: TrainerConfig,
    temperature: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One micro-batch's forward and loss (see policy_loss)."""
    logprobs, entropies = token_stats(
        model_logits(model, batch), batch.targets, batch.kept_ids, temperature,
        entropy_grad=config.entropy_coef > 0, chunk_mb=config.loss_chunk_mb, compiled=config.compile,
    )
    ref_logprobs = None
    if reference is not None:
        with torch.no_grad():
            ref_logprobs = token_stats(
                model_logits(reference, batch), batch.targets, batch.kept_ids, temperature,
                entropies=False, chunk_mb=config.loss_chunk_mb, compiled=config.compile,
            )[0]
    loss, stats = policy_loss(
        logprobs,
        batch.sampler_logprobs,
        batch.advantages,
        batch.completion_mask,
        totals=totals,
        loss=config.loss,
        off_policy=config.off_policy,
        objective=config.objective,
        entropy=entropies,
        ref_logprobs=ref_logprobs,
        kl_coef=config.kl_coef,
        entropy_coef=config.entropy_coef,
    )
    return loss, stats


def merge_sums(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Add two micro-batches' token sums; `ratio_max` is a max."""
    return {key: torch.maximum(a[key].to(b[key].device), b[key]) if key == "ratio_max" else a[key].to(b[key].device) + b[key] for key in a}


def reduce_over_ranks(loss: torch.Tensor, sums: dict[str, torch.Tensor], device: torch.device) -> tuple[float, dict[str, float]]:
    """The whole-batch loss (a sum of the ranks' shares) and token sums; one max. Collective."""
    keys = [key for key in STAT_KEYS if key != "ratio_max"]
    totals = torch.stack([loss.to(device)] + [sums[key].to(device) for key in keys]).double()
    dist.all_reduce(totals)  # SUM
    peak = sums["ratio_max"].to(device).double()
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    values = totals.tolist()
    return values[0], {**dict(zip(keys, values[1:])), "ratio_max": peak.item()}
