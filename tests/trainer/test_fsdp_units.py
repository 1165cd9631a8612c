"""How `shard_model` cuts the model into FSDP2 units, and what one rank does with its gradients.

Each transformer block is its own unit, or with `one_unit` the whole model is one (one CUDA rank's
cut, `one_unit_here`; LoRA's frozen base and adapters in one unit get the blocks' gradients). On one rank a
step's gradients accumulate unsharded over its micro-batches and are reduced once, after the last
(`reduce_gradients_after`). The loss and gradients of that, with either cut, must be those of
FSDP2's default, a reduction after every micro-batch, in bf16 mixed precision too (the reduction is
in float32 either way). Real gloo processes; the fp32 gradients against a plain model are
test_trainer_parity's. The benchmark that times these choices, benchmarks/trainer_overhead.py,
runs once here too."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.fsdp import FSDPModule

from decentrl.cli.launch import free_port
from decentrl.config import LoRAConfig, TinyModelConfig, TrainerConfig
from decentrl.model.build import build_model
from decentrl.trainer.batching import rank_share
from decentrl.trainer.distributed import init_distributed, one_unit_here, shard_model
from decentrl.trainer.lora import add_adapters
from decentrl.trainer.step import accumulate_gradients, micro_batch_loss
from tests.trainer.test_trainer_parity import MAX_TOKENS, make_batch

pytestmark = pytest.mark.integration

TINY = TinyModelConfig(hidden_size=32, num_layers=3, num_heads=2, intermediate_size=64)


def units(model: torch.nn.Module) -> list[str]:
    return [name for name, module in model.named_modules() if isinstance(module, FSDPModule)]


def grads_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: parameter.grad.full_tensor() for name, parameter in model.named_parameters()}


def one_rank(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    torch.set_num_threads(1)
    _, _, device = init_distributed()
    saved: dict[str, object] = {
        "units": units(shard_model(build_model(TINY).train())),  # one CPU rank: a unit a block
        "one_unit": units(shard_model(build_model(TINY).train(), one_unit=True)),
        "per_block": units(shard_model(build_model(TINY).train(), one_unit=False)),
    }
    config = TrainerConfig(micro_batch_tokens=24, mixed_precision="bf16", entropy_coef=0.01)
    _, totals, micro_batches = rank_share(make_batch(), rank=0, world=1, config=config, max_tokens=MAX_TOKENS, pad_id=0, device=device)
    each_micro = shard_model(build_model(TINY).train(), mixed_precision="bf16")
    reference = torch.zeros(())
    for batch in micro_batches:  # reduced after every micro-batch, FSDP2's default
        part, _ = micro_batch_loss(each_micro, None, batch, totals=totals, config=config, temperature=1.0)
        part.backward()
        reference = reference + part.detach()
    saved.update(micro_batches=len(micro_batches), reference_loss=reference.item(), reference_grads=grads_of(each_micro))
    for name, one_unit in (("blocks", False), ("whole", True)):
        model = shard_model(build_model(TINY).train(), mixed_precision="bf16", one_unit=one_unit)
        loss, _ = accumulate_gradients(model, None, micro_batches, totals=totals, config=config, temperature=1.0)
        saved[name] = (loss.item(), grads_of(model))
    for name, one_unit in (("lora_blocks", False), ("lora_whole", True)):  # frozen base and adapters in one unit
        torch.manual_seed(0)
        model = add_adapters(build_model(TINY), LoRAConfig(rank=4)).train()
        with torch.no_grad():  # B starts at zero: move it, so every adapter gets a gradient
            for parameter_name, parameter in model.named_parameters():
                if "lora_B" in parameter_name:
                    parameter.normal_(0, 0.1)
        model = shard_model(model, mixed_precision="bf16", one_unit=one_unit)
        loss, _ = accumulate_gradients(model, None, micro_batches, totals=totals, config=config, temperature=1.0)
        saved[name] = (loss.item(), {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.requires_grad})
    torch.save(saved, out)
    dist.destroy_process_group()


def test_units_and_one_ranks_gradients(tmp_path: Path) -> None:
    out = str(tmp_path / "saved.pt")
    mp.spawn(one_rank, args=(free_port(), out), nprocs=1, join=True)
    saved = torch.load(out, weights_only=False)
    assert saved["units"] == ["", *(f"model.layers.{i}" for i in range(TINY.num_layers))]
    assert saved["one_unit"] == [""] and saved["per_block"] == saved["units"]
    assert saved["micro_batches"] >= 3
    for cut in ("blocks", "whole"):
        loss, grads = saved[cut]
        assert loss == pytest.approx(saved["reference_loss"], rel=1e-6), cut
        assert set(grads) == set(saved["reference_grads"])
        for name, grad in grads.items():
            assert grad.dtype == torch.float32, name
            torch.testing.assert_close(grad, saved["reference_grads"][name], rtol=1e-5, atol=1e-7, msg=f"{cut} {name}")
            assert grad.abs().sum() > 0, name
    (blocks_loss, blocks), (whole_loss, whole) = saved["lora_blocks"], saved["lora_whole"]
    assert whole_loss == pytest.approx(blocks_loss, rel=1e-6)
    assert blocks and set(whole) == set(blocks) and all("lora_" in name for name in blocks)
    for name, grad in blocks.items():
        torch.testing.assert_close(whole[name], grad, rtol=1e-5, atol=1e-7, msg=name)
        assert grad.abs().sum() > 0, name


def test_trainer_overhead_benchmark_runs(tmp_path: Path) -> None:
    """benchmarks/trainer_overhead.py, one timed round at its 4-block smoke shape: its five loops run
    and its keys are there (the 28-block launch shape's compilation took 115 s of CI's budget)."""
    root = Path(__file__).parents[2]
    done = subprocess.run(
        [sys.executable, str(root / "benchmarks" / "trainer_overhead.py"), "--rounds", "1", "--shape", "smoke"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    for key in ("step_s", "each_micro_step_s", "one_unit_step_s", "bare_step_s", "trainer_vs_bare", "once_vs_each_micro",
                "one_unit_vs_per_block", "compiled_step_s", "compiled_vs_eager", "compiled_vs_bare"):
        assert result[key] > 0, key
    assert (result["shape"], result["mixed_precision"], result["rounds"]) == ("smoke", "fp32", 1)


def test_one_cuda_rank_takes_the_whole_model_as_one_unit() -> None:
    """Measured on an H100 (2026-11-27): one unit was 1.25x a 1-rank step of the 135M shape; on
    the CPU a unit a block stays (glibc maps the whole model's buffers fresh each step)."""
    assert one_unit_here(1, "cuda")
    assert not one_unit_here(1, "cpu") and not one_unit_here(2, "cuda") and not one_unit_here(4, "cpu")
