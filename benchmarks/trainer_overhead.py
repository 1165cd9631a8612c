"""The trainer's host overhead: one full step of the training loop's code against a bare loop, on a
model so small that the step is all launching (deep, narrow, a few tokens), the regime where an
H100 step of a small model is bound too (docs/benchmarks.md, "The GPU path").

One FSDP2 rank (gloo on the CPU, NCCL on a GPU). Three loops over the same batch and micro-batches,
timed in turns (round-robin, so a change of load hits each alike):

  ours        `training_step` of benchmarks/gpu_check.py on `shard_model` as the trainer calls it
  per_block   the same with every block its own FSDP2 unit, as several ranks shard it
  bare        gpu_check's bare policy-gradient loop on the unsharded model

    .venv/bin/python benchmarks/trainer_overhead.py [--layers 28] [--rounds 15] [--bf16]

The last stdout line is one JSON object: `step_s`, `per_block_step_s`, `bare_step_s` (medians),
`trainer_vs_bare` and `per_block_vs_bare` (bare step time / the other's) and
`one_unit_vs_per_block` (per-block step time / ours).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import gpu_check  # noqa: E402  (the step, the bare loop and the batch the GPU check times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=28, help="Transformer blocks (Qwen3-0.6B has 28).")
    parser.add_argument("--rounds", type=int, default=15, help="Timed steps of each loop, after 3 warm-up steps.")
    parser.add_argument("--bf16", action="store_true", help="bf16 compute (FSDP2's mixed precision; autocast in the bare loop).")
    args = parser.parse_args()

    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from decentrl.config import TrainerConfig
    from decentrl.model.chat_model import shape_config
    from decentrl.trainer.distributed import init_distributed, shard_model

    torch.set_num_threads(1)
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(gpu_check.free_port()))
    _, _, device = init_distributed()
    config = shape_config(
        "qwen3-0.6b", num_hidden_layers=args.layers, hidden_size=32, intermediate_size=64, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, vocab_size=256,
    )
    mixed_precision = "bf16" if args.bf16 else "fp32"
    trainer = TrainerConfig(micro_batch_tokens=64, mixed_precision=mixed_precision, lr=1e-6)
    batch = gpu_check.synthetic_batch(8, 8, 24, config.vocab_size, seed=0)  # 4 micro-batches of 2 rows

    def model() -> torch.nn.Module:
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32).to(device).train()

    plain = model()
    optimizer = torch.optim.AdamW(plain.parameters(), lr=1e-6, fused=device.type == "cuda")
    steps = {
        "ours": gpu_check.training_step(shard_model(model(), mixed_precision=mixed_precision), trainer, batch, device),
        "per_block": gpu_check.training_step(
            shard_model(model(), mixed_precision=mixed_precision, per_block=True), trainer, batch, device
        ),
        "bare": lambda: gpu_check.bare_step(plain, optimizer, batch.samples, trainer.micro_batch_tokens, device, args.bf16),
    }
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times: dict[str, list[float]] = {name: [] for name in steps}
    for round_ in range(3 + args.rounds):
        for name, step in steps.items():
            sync()
            started = time.perf_counter()
            step()
            sync()
            if round_ >= 3:
                times[name].append(time.perf_counter() - started)
    dist.destroy_process_group()
    ours, per_block, bare = (statistics.median(times[name]) for name in ("ours", "per_block", "bare"))
    print(json.dumps({
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "layers": args.layers,
        "mixed_precision": mixed_precision, "rounds": args.rounds,
        "step_s": ours, "per_block_step_s": per_block, "bare_step_s": bare,
        "trainer_vs_bare": bare / ours, "per_block_vs_bare": bare / per_block, "one_unit_vs_per_block": per_block / ours,
    }))


if __name__ == "__main__":
    main()
