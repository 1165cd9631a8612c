"""FSDP2 parity for a mixture-of-experts model with replayed routes (issue 15): the same batch,
carrying recorded expert routes, trained on 1 and on 2 gloo ranks (real processes), with and
without activation checkpointing, gives the loss and gradients of one plain model on the whole
batch; the routers get gradient through the replayed gate weights."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from decentrl.api.wire import ExpertRouting, TrainBatch, TrainSample
from decentrl.cli.launch import free_port
from decentrl.config import TinyModelConfig, TrainerConfig
from decentrl.model.build import build_model
from decentrl.trainer.batching import batch_totals, collate, rank_share, select_samples
from decentrl.trainer.distributed import init_distributed, shard_model
from decentrl.trainer.step import accumulate_gradients, reduce_over_ranks

pytestmark = pytest.mark.integration

MOE = TinyModelConfig(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64,
                      moe={"num_experts": 4, "top_k": 2, "expert_intermediate_size": 16})
TEMPERATURE = 0.9
MAX_TOKENS = 6
TRAINER = {"loss": {"type": "token"}, "off_policy": {"type": "icepop", "low": 0.5, "high": 2.0}, "micro_batch_tokens": 24}


def make_batch() -> TrainBatch:
    rng = random.Random(11)
    samples = []
    for group in range(3):
        prompt = [1] + [rng.randint(3, 13) for _ in range(rng.randint(3, 5))]
        for reward in (0.0, 0.5, 1.0):
            completion = [rng.randint(3, 13) for _ in range(rng.randint(1, MAX_TOKENS))]
            rows = len(prompt) + len(completion) - 1
            experts = [e for _ in range(rows * 2) for e in rng.sample(range(4), 2)]  # two distinct per layer
            samples.append(TrainSample(
                prompt_token_ids=prompt, completion_token_ids=completion,
                logprobs=[-rng.uniform(1.5, 3.5) for _ in completion], advantage=reward - 0.5, reward=reward,
                policy_version=0, group_id=f"g{group}", expert_routing=ExpertRouting(layers=2, top_k=2, experts=experts),
            ))
    return TrainBatch(trainer_version=0, samples=samples, staleness_histogram={"0": 9}, rollouts_accepted=9, stale_dropped=0)


def one_step(rank: int, world: int, port: int, out: str, activation_checkpointing: bool) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    _, _, device = init_distributed()
    config = TrainerConfig(**TRAINER, activation_checkpointing=activation_checkpointing)
    model = shard_model(build_model(MOE).to(device).train(), activation_checkpointing=activation_checkpointing)
    _, totals, micro = rank_share(make_batch(), rank=rank, world=world, config=config, max_tokens=MAX_TOKENS, pad_id=0, device=device)
    loss, sums = accumulate_gradients(model, None, micro, totals=totals, config=config, temperature=TEMPERATURE)
    loss_total, _ = reduce_over_ranks(loss, sums, device)
    grads = {name: p.grad.full_tensor().cpu() for name, p in model.named_parameters()}  # collective
    if rank == 0:
        torch.save({"loss": loss_total, "grads": grads}, out)
    dist.barrier()  # as the trainer ends: no rank tears gloo down while another still uses it
    dist.destroy_process_group()


def run_ranks(world: int, tmp_path: Path, activation_checkpointing: bool = False) -> dict:
    out = str(tmp_path / f"moe-world{world}-ac{int(activation_checkpointing)}.pt")
    mp.spawn(one_step, args=(world, free_port(), out, activation_checkpointing), nprocs=world, join=True)
    return torch.load(out, weights_only=False)


def test_moe_with_replayed_routes_trains_the_same_on_one_and_two_ranks(tmp_path: Path) -> None:
    config = TrainerConfig(**TRAINER)
    model = build_model(MOE).train()
    samples = select_samples(make_batch(), drop_zero_variance=False)
    loss, _ = accumulate_gradients(
        model, None, [collate(samples, 0)], totals=batch_totals(samples, MAX_TOKENS), config=config, temperature=TEMPERATURE
    )
    want = {name: p.grad for name, p in model.named_parameters()}
    assert all(want[name].abs().sum() > 0 for name in want if "gate.weight" in name)  # routers learn under replay
    for result in (run_ranks(1, tmp_path), run_ranks(2, tmp_path), run_ranks(2, tmp_path, activation_checkpointing=True)):
        assert result["loss"] == pytest.approx(loss.item(), rel=1e-5, abs=1e-6)
        for name, grad in want.items():
            assert torch.allclose(result["grads"][name], grad, rtol=1e-4, atol=1e-6), name
