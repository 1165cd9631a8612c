"""FSDP2 parity: the same batch trained on 1 and on 2 gloo ranks (real torch.multiprocessing
processes) gives the same loss and gradients as one plain model on the whole batch; one step
changes every trainable parameter; the background weight gather hands rank 0 exactly the
weights after the step. The CUDA/NCCL path (bf16, one GPU) is marked `gpu`."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.fsdp import FSDPModule

from decentrl.api.wire import TrainBatch, TrainSample
from decentrl.cli.launch import free_port
from decentrl.config import TinyModelConfig, TrainerConfig
from decentrl.model.build import build_model
from decentrl.rl.losses import summarize
from decentrl.trainer.batching import batch_totals, collate, rank_share, select_samples
from decentrl.trainer.distributed import full_state_dict, init_distributed, shard_model
from decentrl.trainer.gather import WeightGather
from decentrl.trainer.step import accumulate_gradients, compile_blocks, reduce_over_ranks

pytestmark = pytest.mark.integration

TINY = TinyModelConfig(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64)
REFERENCE = TINY.model_copy(update={"seed": 1})
TEMPERATURE = 0.9
MAX_TOKENS = 6
# Token-level loss, IcePop masking, PPO clipping, k3 KL to a reference, entropy bonus; zero-variance
# groups dropped, so the 12 samples become 9 and the ranks get unequal shares.
TRAINER = {
    "loss": {"type": "token", "eps_low": 0.2, "eps_high": 0.28},
    "off_policy": {"type": "icepop", "low": 0.5, "high": 2.0},
    "advantages": {"drop_zero_variance": True},
    "kl_coef": 0.05,
    "entropy_coef": 0.01,
    "micro_batch_tokens": 24,
}


def make_batch() -> TrainBatch:
    rng = random.Random(7)
    samples = []
    for group in range(4):
        rewards = [1.0] * 3 if group == 1 else [0.0, 0.25, 1.0][: 3 - group % 2] + [0.5] * (group % 2)
        mean = sum(rewards) / 3
        prompt = [1] + [rng.randint(3, 13) for _ in range(rng.randint(3, 5))]
        for reward in rewards:
            completion = [rng.randint(3, 13) for _ in range(rng.randint(1, MAX_TOKENS))]
            samples.append(TrainSample(
                prompt_token_ids=prompt, completion_token_ids=completion,
                logprobs=[-rng.uniform(1.5, 3.5) for _ in completion],  # ratios around the icepop bounds
                advantage=reward - mean, reward=reward, policy_version=0, group_id=f"g{group}",
            ))
    return TrainBatch(trainer_version=0, samples=samples, staleness_histogram={"0": 12}, rollouts_accepted=12, stale_dropped=0)


def ranks_main(rank: int, world: int, port: int, variants: list[tuple[bool, bool, str]]) -> None:
    """Each spawned rank: `one_step` for each (activation checkpointing, compiled, out) in turn, in
    one process group (a spawn and its imports cost more than a step here: 4 spawns took 145 s of CI)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    _, _, device = init_distributed()
    for activation_checkpointing, compiled, out in variants:
        one_step(rank, world, device, out, activation_checkpointing, compiled)
    dist.barrier()  # as the trainer ends: no rank tears gloo down while another still uses it
    dist.destroy_process_group()


def one_step(rank: int, world: int, device: torch.device, out: str, activation_checkpointing: bool, compiled: bool) -> None:
    """One training step exactly as the loop runs it (`load_policy`'s order: compile, then shard),
    from a freshly built model; rank 0 saves what it saw."""
    config = TrainerConfig(**TRAINER, activation_checkpointing=activation_checkpointing, compile=compiled)
    model = build_model(TINY).to(device).train()
    before = {name: p.detach().clone().cpu() for name, p in model.named_parameters()}
    reference = build_model(REFERENCE).to(device).requires_grad_(False).eval()  # for the k3 KL
    if compiled:
        compile_blocks(model)
        compile_blocks(reference)
    model = shard_model(model, activation_checkpointing=activation_checkpointing)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    reference = shard_model(reference)
    gathered: dict[int, dict[str, torch.Tensor]] = {}
    gather = WeightGather(model, deliver=lambda version, state: gathered.update({version: state}))

    samples, totals, micro = rank_share(make_batch(), rank=rank, world=world, config=config, max_tokens=MAX_TOKENS, pad_id=0, device=device)
    loss, sums = accumulate_gradients(model, reference, micro, totals=totals, config=config, temperature=TEMPERATURE)
    loss_total, token_sums = reduce_over_ranks(loss, sums, device)
    grads = {name: p.grad.full_tensor().cpu() for name, p in model.named_parameters()}  # collective
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    gather.submit(1)
    gather.close()
    after = full_state_dict(model)  # collective; the reference for what the gather delivered
    if rank == 0:
        torch.save(
            {"loss": loss_total, "stats": summarize(token_sums), "grads": grads, "before": before, "after": after,
             "gathered": gathered[1], "micro_batches": len(micro), "samples": len(samples)},
            out,
        )


def run_ranks(world: int, tmp_path: Path, variants: list[tuple[bool, bool]]) -> list[dict]:
    """What rank 0 saw of one step per (activation checkpointing, compiled) in `variants`, on `world` ranks."""
    outs = [(ac, compiled, str(tmp_path / f"world{world}-ac{int(ac)}-compiled{int(compiled)}.pt")) for ac, compiled in variants]
    mp.spawn(ranks_main, args=(world, free_port(), outs), nprocs=world, join=True)
    return [torch.load(out, weights_only=False) for _, _, out in outs]


def plain_reference() -> tuple[float, dict[str, torch.Tensor]]:
    """One unsharded model, the whole batch in one micro-batch."""
    config = TrainerConfig(**TRAINER)
    model = build_model(TINY).train()
    samples = select_samples(make_batch(), drop_zero_variance=True)
    reference = build_model(REFERENCE).eval()
    loss, _ = accumulate_gradients(
        model, reference, [collate(samples, 0)], totals=batch_totals(samples, MAX_TOKENS), config=config, temperature=TEMPERATURE
    )
    return loss.item(), {name: p.grad for name, p in model.named_parameters()}


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    tmp = tmp_path_factory.mktemp("parity")
    # [trainer] compile ("2-ac-compiled"): compiled blocks under FSDP2 and activation checkpointing,
    # micro-batches of several lengths (a recompilation with dynamic shapes), the compiled loss with
    # its entropy and KL; on 2 ranks, as configs/gpu.toml compiles on 4 (each block freed after its
    # forward, gathered again for the recompute). One compiled rank: tests/trainer/test_compile.py,
    # gpu_check's section.
    two, two_ac, two_ac_compiled = run_ranks(2, tmp, [(False, False), (True, False), (True, True)])
    return {"1": run_ranks(1, tmp, [(False, False)])[0], "2": two, "2-ac": two_ac, "2-ac-compiled": two_ac_compiled}


def test_parity_of_loss_and_gradients_on_one_and_two_ranks(results: dict[str, dict]) -> None:
    expected_loss, expected_grads = plain_reference()
    assert results["1"]["samples"] == results["2"]["samples"] == 9, "4 groups of 3, one dropped: an odd split"
    assert results["2"]["micro_batches"] >= 2, "each rank accumulates over several micro-batches"
    for name in ("1", "2", "2-ac", "2-ac-compiled"):
        run = results[name]
        assert run["loss"] == pytest.approx(expected_loss, rel=1e-5, abs=1e-7), name
        for param, grad in expected_grads.items():
            torch.testing.assert_close(run["grads"][param], grad, rtol=1e-4, atol=1e-7, msg=f"{name}: {param}")
    for key in ("is_ratio_mean", "is_ratio_max", "masked_fraction", "clipped_fraction", "entropy", "kl"):
        assert results["2"]["stats"][key] == pytest.approx(results["1"]["stats"][key], rel=1e-5), key
    assert 0 < results["1"]["stats"]["masked_fraction"] < 1, "the batch exercises icepop masking"
    assert results["1"]["stats"]["kl"] > 0


def test_one_training_step_changes_every_trainable_parameter(results: dict[str, dict]) -> None:
    for name in ("1", "2"):
        run = results[name]
        assert set(run["after"]) == set(run["before"])
        unchanged = [p for p in run["before"] if torch.equal(run["before"][p], run["after"][p])]
        assert unchanged == [], f"{name} ranks: parameters not changed by one step: {unchanged}"


def test_background_gather_delivers_exactly_the_weights_after_the_step(results: dict[str, dict]) -> None:
    for name in ("1", "2"):
        run = results[name]
        assert set(run["gathered"]) == set(run["after"])
        for param, tensor in run["after"].items():
            assert torch.equal(run["gathered"][param], tensor), f"{name}: {param}"


@pytest.mark.gpu
def test_cuda_nccl_bf16_step_matches_fp32_on_cpu(tmp_path: Path) -> None:
    """One GPU rank (NCCL) with bf16 mixed precision, the whole model one FSDP2 unit (the trainer's
    cut on one CUDA rank): the loss agrees with fp32 to bf16 precision."""
    out = str(tmp_path / "gpu.pt")
    mp.spawn(gpu_step, args=(free_port(), out), nprocs=1, join=True)
    run = torch.load(out, weights_only=False)
    expected_loss, expected_grads = plain_reference()
    assert run["device"].startswith("cuda") and run["units"] == [""]
    assert run["loss"] == pytest.approx(expected_loss, rel=5e-2, abs=1e-3)
    cosine = torch.nn.functional.cosine_similarity(
        torch.cat([g.flatten() for g in run["grads"].values()]),
        torch.cat([expected_grads[p].flatten() for p in run["grads"]]), dim=0,
    )
    assert cosine > 0.98


def gpu_step(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    _, _, device = init_distributed()
    config = TrainerConfig(**TRAINER, mixed_precision="bf16", activation_checkpointing=True)
    model = shard_model(build_model(TINY).to(device).train(), mixed_precision="bf16", activation_checkpointing=True)
    reference = shard_model(build_model(REFERENCE).to(device).requires_grad_(False).eval(), mixed_precision="bf16")
    samples = select_samples(make_batch(), drop_zero_variance=True)
    loss, _ = accumulate_gradients(
        model, reference, [collate(samples, 0).to(device)], totals=batch_totals(samples, MAX_TOKENS), config=config, temperature=TEMPERATURE
    )
    grads = {name: p.grad.full_tensor().float().cpu() for name, p in model.named_parameters()}
    units = [name for name, module in model.named_modules() if isinstance(module, FSDPModule)]
    torch.save({"loss": loss.item(), "grads": grads, "device": str(device), "units": units}, out)
    dist.destroy_process_group()
