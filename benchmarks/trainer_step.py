"""Trainer step throughput and how long a step waits on publishing.

Runs the training loop's step on synthetic batches shaped like the demo's (--groups prompt
groups of --group-size samples, 6-token prompts, 1..6-token completions) with the tiny model on
--ranks FSDP2 ranks (gloo on CPU, NCCL on a GPU where there is one), publishing every version to
a temporary file:// store through the real background Publisher, the way decentrl/trainer/train.py
does. Two publishing modes are timed, --steps steps each after --warmup:

  background  the loop's: snapshot this rank's shards, gather to rank 0 on a thread (WeightGather)
  sync        gather the full state dict inside the step (get_model_state_dict), then hand it off

Every figure comes from this run. The last stdout line is one JSON object: tokens_per_s (prompt +
completion tokens trained per second of step time), step_s and compute_s means, and for each mode
publish_wait_s (mean time a step waited on publishing) and publish_wait_fraction (its share of
step time; the goal is < 0.05), plus the background publisher's own publish_s.

    .venv/bin/python benchmarks/trainer_step.py [--ranks 2] [--steps 30] [--hidden 128 --layers 2]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import socket
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from decentrl.api.wire import TrainBatch, TrainSample  # noqa: E402
from decentrl.config import TinyModelConfig, TrainerConfig  # noqa: E402
from decentrl.model.build import build_model, build_tiny_tokenizer  # noqa: E402
from decentrl.store.checkpoints import CheckpointStore  # noqa: E402
from decentrl.trainer.batching import rank_share  # noqa: E402
from decentrl.trainer.distributed import full_state_dict, init_distributed, shard_model  # noqa: E402
from decentrl.trainer.gather import WeightGather  # noqa: E402
from decentrl.trainer.publisher import Publisher  # noqa: E402
from decentrl.trainer.step import accumulate_gradients, reduce_over_ranks  # noqa: E402

MAX_TOKENS = 6


def synthetic_batch(groups: int, group_size: int, seed: int) -> TrainBatch:
    rng = random.Random(seed)
    samples = []
    for group in range(groups):
        prompt = [1] + [rng.randint(4, 13) for _ in range(4)] + [3]
        rewards = [rng.random() for _ in range(group_size)]
        mean = statistics.fmean(rewards)
        for reward in rewards:
            completion = [rng.randint(3, 13) for _ in range(rng.randint(1, MAX_TOKENS))]
            samples.append(TrainSample(
                prompt_token_ids=prompt, completion_token_ids=completion,
                logprobs=[-rng.uniform(1.0, 3.0) for _ in completion], advantage=reward - mean,
                reward=reward, policy_version=0, group_id=str(group),
            ))
    return TrainBatch(trainer_version=0, samples=samples, staleness_histogram={"0": len(samples)}, rollouts_accepted=0, stale_dropped=0)


def run_rank(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(args.threads)
    _, _, device = init_distributed()
    config = TrainerConfig(micro_batch_tokens=args.micro_batch_tokens)
    model_config = TinyModelConfig(hidden_size=args.hidden, num_layers=args.layers, num_heads=4, intermediate_size=2 * args.hidden)
    model = shard_model(build_model(model_config).to(device).train())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    with tempfile.TemporaryDirectory(prefix="decentrl-bench-") as directory:
        publisher = None
        if rank == 0:
            build_tiny_tokenizer().save_pretrained(directory + "/extras")
            store = CheckpointStore(directory + "/store")
            publisher = Publisher(store=store, model_config=model.config, extras_from=directory + "/extras",
                                  keep_last=4, on_published=lambda version: None)
        gather = WeightGather(model, deliver=publisher.submit if publisher else None)
        results = {}
        version = 0
        for mode in ("background", "sync"):
            steps, compute, waits, tokens = [], [], [], 0
            for i in range(args.warmup + args.steps):
                version += 1
                batch = synthetic_batch(args.groups, args.group_size, seed=version)
                started = time.perf_counter()
                samples, totals, micro = rank_share(
                    batch, rank=rank, world=world, config=config, max_tokens=MAX_TOKENS, pad_id=0, device=device
                )
                loss, sums = accumulate_gradients(model, None, micro, totals=totals, config=config, temperature=1.0)
                torch.nn.utils.clip_grad_norm_(model.parameters(), config.max_grad_norm)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                computed = time.perf_counter()
                if mode == "background":
                    gather.submit(version)
                else:
                    weights = full_state_dict(model)
                    if publisher is not None:
                        publisher.submit(version, weights)
                published = time.perf_counter()
                reduce_over_ranks(loss, sums, device)  # the loop's per-step metrics collective
                if device.type == "cuda":
                    torch.cuda.synchronize()
                ended = time.perf_counter()
                if i >= args.warmup:
                    steps.append(ended - started)
                    compute.append(computed - started)
                    waits.append(published - computed)
                    tokens += sum(len(s.prompt_token_ids) + len(s.completion_token_ids) for s in samples)
            gather.wait_idle()
            if publisher is not None:
                publisher.wait_idle()
            results[mode] = {
                "step_s": statistics.fmean(steps),
                "compute_s": statistics.fmean(compute),
                "tokens_per_s": tokens / sum(steps),
                "publish_wait_s": statistics.fmean(waits),
                "publish_wait_fraction": sum(waits) / sum(steps),
            }
        gather.close()
        if publisher is not None:
            publisher.close()
            results["publish_s"] = statistics.fmean(publisher.publish_seconds)
            results["versions_skipped"] = len(publisher.skipped)
            results["versions_published"] = len(publisher.publish_seconds)
            results["device"] = str(device)
            results["parameters"] = sum(p.numel() for p in build_model(model_config).parameters())
            with open(out, "w") as file:
                json.dump(results, file)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=2, help="FSDP2 ranks (processes)")
    parser.add_argument("--steps", type=int, default=30, help="timed steps per publishing mode")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--groups", type=int, default=32)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--micro-batch-tokens", type=int, default=16384)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as directory:
        out = os.path.join(directory, "result.json")
        mp.spawn(run_rank, args=(args.ranks, port, args, out), nprocs=args.ranks, join=True)
        with open(out) as file:
            results = json.load(file)
    background, sync = results["background"], results["sync"]
    print(f"{args.ranks} rank(s) on {results['device']}, {results['parameters']} parameters, "
          f"{args.groups}x{args.group_size} samples a step, {args.steps} timed steps per mode")
    for mode, r in (("background", background), ("sync", sync)):
        print(f"  {mode:10s} step {1000 * r['step_s']:.1f} ms (compute {1000 * r['compute_s']:.1f} ms), "
              f"{r['tokens_per_s']:.0f} tokens/s, publish wait {1000 * r['publish_wait_s']:.2f} ms "
              f"= {100 * r['publish_wait_fraction']:.1f}% of the step")
    print(f"  background publish (write + store + retention) {1000 * results['publish_s']:.1f} ms; "
          f"{results['versions_skipped']} versions skipped because uploads fell behind")
    print(json.dumps({
        "benchmark": "trainer_step",
        "device": results["device"],
        "ranks": args.ranks,
        "parameters": results["parameters"],
        "samples_per_step": args.groups * args.group_size,
        "tokens_per_s": round(background["tokens_per_s"], 1),
        "step_s": round(background["step_s"], 5),
        "compute_s": round(background["compute_s"], 5),
        "publish_wait_s": round(background["publish_wait_s"], 6),
        "publish_wait_fraction": round(background["publish_wait_fraction"], 4),
        "sync_gather_publish_wait_fraction": round(sync["publish_wait_fraction"], 4),
        "sync_gather_tokens_per_s": round(sync["tokens_per_s"], 1),
        "publish_s": round(results["publish_s"], 4),
        "versions_skipped": results["versions_skipped"],
    }))


if __name__ == "__main__":
    main()
