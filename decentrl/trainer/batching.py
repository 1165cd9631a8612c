"""From a TrainBatch to padded micro-batches: sample selection, whole-batch totals, packing, collate.

Every rank holds the whole batch (rank 0 broadcasts it), so every rank computes the same plan
without talking: which samples train, the counts the loss normalizes by, and which micro-batches
each rank runs. Called by the training loop (decentrl/trainer/train.py) once per step.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from decentrl.api.wire import TrainBatch, TrainSample
from decentrl.config import TrainerConfig
from decentrl.model.routers import batch_routes
from decentrl.rl.advantages import informative_samples
from decentrl.rl.losses import BatchTotals


@dataclass
class Tensors:
    """A micro-batch. The per-token tensors are aligned with `targets`: the next tokens from the
    first position any row's completion is predicted at (`start`) on, so the vocabulary-wide work
    skips the prompt positions before it. T = L - 1 - start."""

    input_ids: torch.Tensor  # (B, L) prompt + completion, right-padded
    attention_mask: torch.Tensor  # (B, L)
    completion_mask: torch.Tensor  # (B, T) 1 where the target is a trained completion token
    sampler_logprobs: torch.Tensor  # (B, T)
    # (B, T) each completion position holds its token's advantage (the sample's `advantage`, or
    # its `token_advantages` for process rewards); 0 elsewhere.
    advantages: torch.Tensor
    # (B, T, K) the vocabulary ids the worker's top-k/top-p kept at each target, padded with -1;
    # a row of -1 means no truncation there. None when no sample is truncated.
    kept_ids: torch.Tensor | None = None
    # (B, L, sparse layers, top_k) MoE expert ids the worker's routers chose for each input
    # position, -1 where none was recorded (decentrl/model/routers.py replays them). None: no routes.
    routes: torch.Tensor | None = None

    @property
    def start(self) -> int:
        return self.input_ids.shape[1] - 1 - self.completion_mask.shape[1]

    @property
    def targets(self) -> torch.Tensor:  # (B, T)
        return self.input_ids[:, self.start + 1 :]

    def to(self, device: torch.device) -> Tensors:
        return Tensors(*(None if (t := getattr(self, f.name)) is None else t.to(device) for f in fields(self)))


def collate(samples: list[TrainSample], pad_id: int) -> Tensors:
    """Right-pad prompt+completion; targets are shifted by one, as in next-token prediction."""
    width = max(len(s.prompt_token_ids) + len(s.completion_token_ids) for s in samples)
    start = min(len(s.prompt_token_ids) for s in samples) - 1
    ids = torch.full((len(samples), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(samples), width), dtype=torch.long)
    mask = torch.zeros((len(samples), width - 1 - start))
    sampler = torch.zeros_like(mask)
    advantages = torch.zeros_like(mask)
    for row, sample in enumerate(samples):
        p, c = len(sample.prompt_token_ids), len(sample.completion_token_ids)
        ids[row, : p + c] = torch.tensor(sample.prompt_token_ids + sample.completion_token_ids)
        attention[row, : p + c] = 1
        # Completion token j sits at position p + j and is predicted from position p + j - 1.
        # Environment tokens of a multi-turn episode (loss_mask 0) are context, not trained.
        at = slice(p - 1 - start, p - 1 - start + c)
        mask[row, at] = 1.0 if sample.loss_mask is None else torch.tensor(sample.loss_mask, dtype=torch.float32)
        sampler[row, at] = torch.tensor(sample.logprobs)
        tokens = sample.token_advantages
        advantages[row, at] = sample.advantage if tokens is None else torch.tensor(tokens, dtype=torch.float32)
    return Tensors(
        ids, attention, mask, sampler, advantages, kept_ids(samples, width, start), batch_routes([s.expert_routing for s in samples], width)
    )


def kept_ids(samples: list[TrainSample], width: int, start: int) -> torch.Tensor | None:
    """The samples' sampling masks aligned with the targets (see Tensors.kept_ids)."""
    truncated = [s for s in samples if s.sampling_mask is not None]
    if not truncated:
        return None
    k = max(len(kept) for s in truncated for kept in s.sampling_mask or [])
    kept = torch.full((len(samples), width - 1 - start, k), -1, dtype=torch.long)
    for row, sample in enumerate(samples):
        if sample.sampling_mask is not None:
            at = len(sample.prompt_token_ids) - 1 - start  # as in collate
            padded = [ids + [-1] * (k - len(ids)) for ids in sample.sampling_mask]
            kept[row, at : at + len(padded)] = torch.tensor(padded, dtype=torch.long).view(len(padded), k)
    return kept


def idle_micro_batch(pad_id: int) -> Tensors:
    """A micro-batch with no completion token: it adds nothing to the loss or the gradient, but
    a rank with fewer samples runs it so every rank joins the same FSDP collectives."""
    return Tensors(
        input_ids=torch.full((1, 2), pad_id, dtype=torch.long),
        attention_mask=torch.ones((1, 2), dtype=torch.long),
        completion_mask=torch.zeros((1, 1)),
        sampler_logprobs=torch.zeros((1, 1)),
        advantages=torch.zeros((1, 1)),
    )


def select_samples(batch: TrainBatch, drop_zero_variance: bool) -> list[TrainSample]:
    """The samples that train this step: all, or those of groups with a policy-gradient signal
    (rewards that differ, or a non-zero per-token advantage: decentrl/rl/advantages.py)."""
    if not drop_zero_variance:
        return batch.samples
    if any(s.group_id is None for s in batch.samples):
        raise ValueError(
            "trainer.advantages.drop_zero_variance needs group ids in batches; "
            "upgrade the orchestrator or set drop_zero_variance = false"
        )
    keep = informative_samples(
        [s.reward for s in batch.samples], [str(s.group_id) for s in batch.samples], [s.token_advantages for s in batch.samples]
    )
    return [s for s, k in zip(batch.samples, keep) if k]


def batch_totals(samples: list[TrainSample], max_tokens: int) -> BatchTotals:
    return BatchTotals(
        samples=len(samples),
        tokens=sum(len(s.completion_token_ids) if s.loss_mask is None else sum(s.loss_mask) for s in samples),
        max_tokens=max_tokens,
    )


def plan_micro_batches(lengths: list[int], world: int, token_budget: int) -> list[list[list[int]]]:
    """For each rank, its micro-batches as lists of sample indices; every rank gets the same count.

    Samples go to ranks round-robin from the longest down (so ranks get similar token counts);
    each rank packs its samples, longest first, into micro-batches of at most `token_budget`
    padded tokens (rows x longest row). Memory is then bounded by the budget, not by the batch.
    A rank with fewer micro-batches is topped up with empty ones (`idle_micro_batch`).
    """
    too_long = [n for n in lengths if n > token_budget]
    if too_long:
        raise ValueError(
            f"a sample of {max(too_long)} tokens (prompt + completion) does not fit in "
            f"trainer.micro_batch_tokens = {token_budget}; raise it to at least {max(too_long)}"
        )
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    plans: list[list[list[int]]] = []
    for rank in range(world):
        micro: list[list[int]] = []
        for index in order[rank::world]:
            # Longest first, so the first row of a micro-batch sets its width.
            if micro and (len(micro[-1]) + 1) * lengths[micro[-1][0]] <= token_budget:
                micro[-1].append(index)
            else:
                micro.append([index])
        plans.append(micro)
    most = max(len(micro) for micro in plans)
    return [micro + [[] for _ in range(most - len(micro))] for micro in plans]


def rank_share(
    batch: TrainBatch, *, rank: int, world: int, config: TrainerConfig, max_tokens: int, pad_id: int, device: torch.device
) -> tuple[list[TrainSample], BatchTotals, list[Tensors]]:
    """The samples that train this step, their whole-batch totals, and this rank's micro-batches."""
    samples = select_samples(batch, config.advantages.drop_zero_variance)
    lengths = [len(s.prompt_token_ids) + len(s.completion_token_ids) for s in samples]
    mine = plan_micro_batches(lengths, world, config.micro_batch_tokens)[rank]
    micro_batches = [(collate([samples[i] for i in rows], pad_id) if rows else idle_micro_batch(pad_id)).to(device) for rows in mine]
    return samples, batch_totals(samples, max_tokens), micro_batches
