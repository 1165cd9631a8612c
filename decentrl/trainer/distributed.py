"""torch.distributed plumbing of the trainer: process group, FSDP2 sharding, broadcasts, full weights.

Called by the training loop (and the parity tests, which run it on 1 and on 2 gloo ranks).

Peers lost: every collective waits at most `[trainer] peer_timeout_s` for the other ranks (the
process group's time-out), so a trainer whose nodes lose each other - one died, or the network
between them is cut - stops with `PeerLost` saying so instead of hanging (torch's default is 30
minutes). Rank 0's own long waits between collectives (a batch from the orchestrator, a publish
that retries a failing store) would count against it on the other ranks: they are cut into
heartbeats (`broadcast_when_ready`), so only silence from a peer does.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable
from typing import TypeVar

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from transformers import PreTrainedModel

T = TypeVar("T")


class PeerLost(RuntimeError):
    """A collective heard nothing from another rank within the process group's time-out."""


# What gloo raises (a plain RuntimeError) when a peer stays silent or goes away, and what NCCL's
# watchdog raises (DistBackendError, a RuntimeError too).
_PEER_FAILURES = ("Timed out waiting", "Connection closed by peer", "Connection reset by peer", "Watchdog caught collective")


def peer_failure(error: BaseException) -> bool:
    """Whether `error` is a collective that lost its peers (not a bug of the step)."""
    return isinstance(error, RuntimeError) and any(text in str(error) for text in _PEER_FAILURES)


def peer_lost(error: BaseException, *, timeout_s: float, rank: int, world: int, resume_step: int) -> PeerLost:
    """The error a rank stops with when `error` is a lost peer: what happened, and what to do."""
    return PeerLost(
        f"trainer rank {rank} of {world}: the other ranks did not answer within trainer.peer_timeout_s = "
        f"{timeout_s:g} s ({str(error).splitlines()[0][:200]}): a trainer node died or the network between the "
        f"nodes is cut. Fix the link or the node, then start the trainer again: it resumes from its checkpoint "
        f"(step {resume_step}) and replays the batches journaled since."
    )


def init_distributed(peer_timeout_s: float = 1800.0) -> tuple[int, int, torch.device]:
    """Join the torchrun group (or make a group of one); gloo on CPU, NCCL on CUDA. Every
    collective of the group waits at most `peer_timeout_s` for the other ranks."""
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    timeout = datetime.timedelta(seconds=peer_timeout_s)
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device, timeout=timeout)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=timeout)
    return dist.get_rank(), dist.get_world_size(), device


def one_unit_here(world_size: int, device_type: str) -> bool:
    """Whether `shard_model` makes the whole model one FSDP2 unit when not told: on one CUDA rank.
    One rank keeps every block gathered through a step anyway (below), so a unit a block frees
    nothing and costs hooks a block: on an H100 (2026-11-27, gpu_check.py) one unit was 1.25x a
    step of the SmolLM2-135M shape and 1.04x of Qwen3-0.6B's. On the CPU it is not: glibc maps the
    whole model's buffers fresh each step (0.90x there, docs/benchmarks.md "The trainer on one rank")."""
    return world_size == 1 and device_type == "cuda"


def shard_model(
    model: PreTrainedModel, *, mixed_precision: str = "fp32", activation_checkpointing: bool = False,
    one_unit: bool | None = None,
) -> PreTrainedModel:
    """FSDP2: each transformer block is its own unit (all-gathered just before use), then the rest.
    `one_unit`: the whole model one unit, no hooks per block; None: where `one_unit_here` says
    (benchmarks/trainer_overhead.py and gpu_check.py time both). `mixed_precision`: "bf16" or "fp32",
    trainer.mixed_precision resolved (decentrl/trainer/train.py `mixed_precision`)."""
    if mixed_precision not in ("fp32", "bf16"):
        raise ValueError(f"mixed_precision {mixed_precision!r}: resolve 'auto' first (trainer.train.mixed_precision)")
    if activation_checkpointing:
        # Non-reentrant checkpointing composes with FSDP2's hooks: the recompute in backward
        # all-gathers the block's parameters again like the forward did.
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if mixed_precision == "bf16"
        else MixedPrecisionPolicy()
    )
    # One rank holds every parameter anyway: keeping the gathered (bf16) block after its forward
    # saves gathering it again in backward; with several ranks each block is freed (less memory).
    initialized = dist.is_initialized()
    world_size = dist.get_world_size() if initialized else 1
    reshard = world_size > 1 or not initialized
    if one_unit is None:
        one_unit = one_unit_here(world_size, next(model.parameters()).device.type)
    if not one_unit:
        for layer in model.model.layers:
            fully_shard(layer, mp_policy=policy, reshard_after_forward=reshard)
    fully_shard(model, mp_policy=policy, reshard_after_forward=reshard)
    # Each rank's loss is its share of a sum normalized by whole-batch counts (decentrl.rl.losses),
    # so the ranks' gradients must be summed, not averaged as FSDP does by default.
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # plain SUM: gloo has no PREMUL_SUM
    return model


def reduce_gradients_after(model: torch.nn.Module, *, last: bool) -> None:
    """Called before each micro-batch. One rank accumulates the step's gradients unsharded (in
    float32 under bf16 compute) and reduces them into its shard, which is the whole, after the last
    micro-batch, keeping the parameters gathered until then: one reduction and one gather a step
    instead of one a micro-batch. Several ranks reduce after each micro-batch, which keeps a rank's
    gradient memory at its shard."""
    if isinstance(model, FSDPModule) and dist.get_world_size() == 1:
        model.set_requires_gradient_sync(last)
        model.set_reshard_after_backward(last)


def broadcast_object(value: T | None, rank: int) -> T:
    """Rank 0's `value` on every rank (pickled; for small objects: plans, batches)."""
    box = [value if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]  # type: ignore[return-value]


def broadcast_when_ready(take: Callable[[float], T | None] | None, rank: int, beat_s: float) -> T:
    """Rank 0's value on every rank once `take(beat_s)` (rank 0's; it waits at most `beat_s` and
    answers None while the value is not there) has it. Each wait that comes back empty is
    broadcast as None, a heartbeat: however long rank 0 waits, no rank sits in one collective for
    more than about `beat_s`, so the group's time-out measures silence, not rank 0's waits."""
    while True:
        value = take(beat_s) if take is not None and rank == 0 else None
        value = broadcast_object(value, rank)
        if value is not None:
            return value


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Collective: every rank takes part, rank 0 receives the full weights as CPU tensors it owns
    (cloned, so later optimizer steps cannot change what a background publish is writing)."""
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {name: tensor.detach().clone() for name, tensor in state.items()}
