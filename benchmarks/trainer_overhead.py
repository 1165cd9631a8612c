"""The trainer's overhead on one rank: one full step of the training loop's code against a bare loop,
with the ways FSDP2 can be laid over one rank side by side.

One FSDP2 rank (gloo on the CPU, NCCL on a GPU), 4 micro-batches a step. Four loops over the same
batch and micro-batches, timed in turns (round-robin, so a change of load hits each alike):

  ours        `training_step` of benchmarks/gpu_check.py on `shard_model` as the trainer calls it
              on the CPU: each block its own FSDP2 unit (on one CUDA rank the trainer takes
              one_unit's cut since 2026-11-27: `one_unit_here`), the step's gradients reduced
              once, after its last micro-batch (`reduce_gradients_after`)
  each_micro  the same with the gradients reduced after every micro-batch (FSDP2's default; the
              trainer's before 2026-11-27)
  one_unit    ours with the whole model one FSDP2 unit (`shard_model(one_unit=True)`)
  compiled    ours with `[trainer] compile` (each block's forward and the loss's statistics
              compiled; its compilation is in the warm-up steps)
  bare        gpu_check's bare policy-gradient loop on the unsharded model

Two regimes (--shape): `launch` (default), the Qwen3 architecture at 28 blocks of width 32 and 8
rows of 32 tokens, a step that is all launching ops (as an H100 step of a small model partly is,
docs/benchmarks.md "The GPU path"); `smollm2-135m`, that shape at 8 rows of 128 tokens, a step
that is all arithmetic on the CPU; `smoke`, `launch` cut to 4 blocks, for the test that the five
loops run (its compilation is most of the time: 28 blocks compile 7 times as long).

    .venv/bin/python benchmarks/trainer_overhead.py [--shape launch|smollm2-135m|smoke] [--rounds 15] [--bf16]

The last stdout line is one JSON object: `step_s`, `each_micro_step_s`, `one_unit_step_s`,
`compiled_step_s`, `bare_step_s` (medians), `trainer_vs_bare` (bare step time / ours),
`once_vs_each_micro` (each_micro step time / ours), `one_unit_vs_per_block` (our step time /
one_unit's), `compiled_vs_eager` (our step time / compiled's) and `compiled_vs_bare` (bare step
time / compiled's).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from collections.abc import Callable
from unittest import mock

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import gpu_check  # noqa: E402  (the step, the bare loop and the batch the GPU check times)
from real_model import alternate, timed_step  # noqa: E402  (its round-robin timing)

# shape -> (shape_config overrides, rows, prompt tokens, completion tokens, torch threads)
SHAPES = {
    "launch": (dict(num_hidden_layers=28, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                    num_key_value_heads=1, head_dim=16, vocab_size=256), 8, 8, 24, 1),
    "smollm2-135m": ({}, 8, 32, 96, 2),
    "smoke": (dict(num_hidden_layers=4, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                   num_key_value_heads=1, head_dim=16, vocab_size=256), 8, 8, 24, 1),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="launch")
    parser.add_argument("--rounds", type=int, default=15, help="Timed steps of each loop, after 2 warm-up steps.")
    parser.add_argument("--bf16", action="store_true", help="bf16 compute (FSDP2's mixed precision; autocast in the bare loop).")
    args = parser.parse_args()

    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from decentrl.config import TrainerConfig
    from decentrl.model.chat_model import shape_config
    from decentrl.trainer.distributed import init_distributed

    overrides, rows, prompt_len, completion_len, threads = SHAPES[args.shape]
    torch.set_num_threads(threads)
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(gpu_check.free_port()))
    _, _, device = init_distributed()
    config = shape_config("qwen3-0.6b" if args.shape in ("launch", "smoke") else args.shape, **overrides)
    mixed_precision = "bf16" if args.bf16 else "fp32"
    # 2 rows a micro-batch: 4 micro-batches a step.
    trainer = TrainerConfig(micro_batch_tokens=2 * (prompt_len + completion_len), mixed_precision=mixed_precision, lr=1e-6)
    batch = gpu_check.synthetic_batch(rows, prompt_len, completion_len, config.vocab_size, seed=0)

    def model() -> torch.nn.Module:
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32).to(device).train()

    def step_of(compiled: bool = False, one_unit: bool = False):  # noqa: ANN202
        return gpu_check.decentrl_step(config, trainer.model_copy(update={"compile": compiled}), batch, device, one_unit)

    ours, each, plain = step_of(), step_of(), model()
    optimizer = torch.optim.AdamW(plain.parameters(), lr=1e-6, fused=device.type == "cuda")

    def each_micro() -> None:
        with mock.patch("decentrl.trainer.step.reduce_gradients_after", lambda model, last: None):
            each()

    steps = {
        "ours": ours,
        "each_micro": each_micro,
        "one_unit": step_of(one_unit=True),
        "compiled": step_of(compiled=True),
        "bare": lambda: gpu_check.bare_step(plain, optimizer, batch.samples, trainer.micro_batch_tokens, device, args.bf16),
    }
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def timed(step: Callable[[], None]) -> Callable[[], float]:
        return lambda: timed_step(lambda: (step(), sync()))

    runs = {name: timed(step) for name, step in steps.items()}
    alternate(runs, 2)  # warm-up
    times = alternate(runs, args.rounds)
    dist.destroy_process_group()
    median = {name: statistics.median(values) for name, values in times.items()}
    print(json.dumps({
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "shape": args.shape,
        "mixed_precision": mixed_precision, "rounds": args.rounds, "torch_threads": threads,
        "step_s": median["ours"], "each_micro_step_s": median["each_micro"], "one_unit_step_s": median["one_unit"],
        "compiled_step_s": median["compiled"],
        "bare_step_s": median["bare"], "trainer_vs_bare": median["bare"] / median["ours"],
        "once_vs_each_micro": median["each_micro"] / median["ours"],
        "one_unit_vs_per_block": median["ours"] / median["one_unit"],
        "compiled_vs_eager": median["ours"] / median["compiled"], "compiled_vs_bare": median["bare"] / median["compiled"],
    }))


if __name__ == "__main__":
    main()
