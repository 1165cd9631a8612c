"""torch.distributed plumbing of the trainer: process group, FSDP2 sharding, broadcasts, full weights.

Called by the training loop (and the parity tests, which run it on 1 and on 2 gloo ranks).
"""

from __future__ import annotations

import os
from typing import TypeVar

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from transformers import PreTrainedModel

T = TypeVar("T")


def init_distributed() -> tuple[int, int, torch.device]:
    """Join the torchrun group (or make a group of one); gloo on CPU, NCCL on CUDA."""
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
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


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Collective: every rank takes part, rank 0 receives the full weights as CPU tensors it owns
    (cloned, so later optimizer steps cannot change what a background publish is writing)."""
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {name: tensor.detach().clone() for name, tensor in state.items()}
