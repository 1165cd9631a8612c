"""One rank's share of a training step: forward, loss and backward over its micro-batches.

Gradients accumulate in the (FSDP-sharded) parameters across micro-batches; because every loss
term is normalized by whole-batch counts, the accumulated gradient (summed over ranks by FSDP)
is exactly the gradient of the whole batch in one piece. Called by the training loop.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.distributed as dist

from decentrl.config import TrainerConfig
from decentrl.model.routers import replaying
from decentrl.rl.losses import STAT_KEYS, BatchTotals, policy_loss
from decentrl.trainer.batching import Tensors


def next_token_logits(model: torch.nn.Module, batch: Tensors, temperature: float) -> torch.Tensor:
    """Tempered logits predicting `batch.targets`, in float32; the model's output layer skips the
    prompt positions before `batch.start`.  # (B, T, V)"""
    keep = batch.input_ids.shape[1] - batch.start
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, logits_to_keep=keep).logits[:, :-1].float()
    # Each pass over (B, T, V) costs memory bandwidth on a GPU: none for temperature 1.
    return logits if temperature == 1.0 else logits / temperature


def sampled_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, kept_ids: torch.Tensor | None = None, normalizer: torch.Tensor | None = None
) -> torch.Tensor:
    """log softmax(logits)[target], without materializing the (B, T, V) log-softmax.  # (B, T)

    With `kept_ids` (B, T, K), positions the worker truncated normalize over the kept ids only:
    the logprob under the distribution it sampled from (logits outside the set at -inf), so the
    importance ratio compares like with like. Gathering K logits avoids a (B, T, V) mask.
    `normalizer`: `logits.logsumexp(-1)` where the caller has it already.
    """
    if normalizer is None:
        normalizer = logits.logsumexp(dim=-1)  # (B, T)
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
        return sampled_logprobs(next_token_logits(model, batch, temperature), batch.targets, batch.kept_ids)


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
    for batch in micro_batches:
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
    logits = next_token_logits(model, batch, temperature)  # (B, T, V)
    targets = batch.targets  # (B, T)
    normalizer = logits.logsumexp(dim=-1)  # (B, T)
    with torch.set_grad_enabled(config.entropy_coef > 0):
        entropies = entropy(logits, normalizer)  # (B, T)
    ref_logprobs = None
    if reference is not None:
        with torch.no_grad():
            ref_logprobs = sampled_logprobs(next_token_logits(reference, batch, temperature), targets, batch.kept_ids)
    loss, stats = policy_loss(
        sampled_logprobs(logits, targets, batch.kept_ids, normalizer),
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
