"""Keep Routing (issue 15): what replaying the workers' MoE routes changes in the trainer.

A tiny Qwen3-MoE (`[model.moe]`, its experts scaled by --expert-scale so that, as in a trained
model, which experts run matters) samples completions on the real hf worker backend, which
records every fed token's experts. The trainer's forward (fp32, `token_logprobs`, exactly as
decentrl/trainer/step.py runs it) then recomputes each completion token's logprob twice: with
the recorded routes replayed and with its own routers choosing. Two worker settings:

  equal     the worker in fp32 with the trainer's weights: replay must reproduce its logprobs
  mismatch  the worker in bf16 (--worker-dtype) with Gaussian noise of --router-noise on its
            router logits: the inference/training numeric mismatch the issue describes

For `mismatch` the last stdout line (one JSON object) reports, under `replay` and `no_replay`:
expert_set_differs (share of (token, sparse layer) pairs whose top-k set in the trainer's
forward differs from the worker's; 0 by construction with replay), logprob_abs_diff_mean / _max
(|trainer - worker| over completion tokens), is_ratio_var (variance of exp(trainer - worker))
and masked_fraction (share of tokens IcePop [0.5, 2] masks); plus route_bytes_per_token (msgpack
bytes of the routes per fed token) and equal_replay_logprob_abs_diff_max.

With --runs N, it also trains configs/moe.toml (`decentrl run`, every role a process, the workers'
routers noisy by `--set simulation.router_noise=<--router-noise>`) N times with replay and N times with
`--set model.keep_routing=false` (model seeds 0..N-1), scores each final version with `decentrl eval`
(held-out prompts) and adds `run_replay` and `run_no_replay`: the eval reward (mean and stderr
over runs; each run's own mean +- stderr over prompts), the batch reward of the last 10 steps, and
sampler_kl (the trainer's k3 KL(sampler || trainer), metrics.jsonl) averaged over all steps and
over the last 50.

    .venv/bin/python benchmarks/routing_replay.py [--prompts 64] [--max-tokens 16] [--runs 2 --staleness 0]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from decentrl.api.encoding import MEDIA_MSGPACK, encode_model
from decentrl.api.wire import SamplingParams, TrainSample
from decentrl.config import TinyModelConfig
from decentrl.model.build import build_model, build_tiny_tokenizer
from decentrl.model.routers import RouteRecorder
from decentrl.trainer.batching import collate
from decentrl.trainer.step import token_logprobs
from workers.backends.hf import HFBackend

ROOT = Path(__file__).resolve().parent.parent


def sample(backend: HFBackend, prompts: list[list[int]], max_tokens: int) -> list[TrainSample]:
    sampling = SamplingParams(temperature=1.0, max_tokens=max_tokens)
    completions = backend.generate(prompts, sampling)
    return [
        TrainSample(prompt_token_ids=p, completion_token_ids=c.token_ids, logprobs=c.logprobs, advantage=0.0, reward=0.0,
                    policy_version=0, expert_routing=c.routes)
        for p, c in zip(prompts, completions, strict=True)
    ]


def compare(trainer: torch.nn.Module, samples: list[TrainSample], replay: bool) -> dict[str, float]:
    recorded = collate(samples, pad_id=0)
    batch = recorded if replay else dataclasses.replace(recorded, routes=None)
    assert recorded.routes is not None
    with torch.no_grad(), RouteRecorder(trainer) as own:  # hooked first: sees each router's own choice
        logprobs = token_logprobs(trainer, batch, temperature=1.0)
        chosen = own.take().view(recorded.routes.shape)  # (B, T, layers, K)
    ran = recorded.routes if replay else chosen
    fed = recorded.routes[..., 0] >= 0  # (B, T, layers)
    differs = (ran.sort(-1).values != recorded.routes.sort(-1).values).any(-1) & fed
    mask = batch.completion_mask.bool()
    diff = logprobs[mask] - batch.sampler_logprobs[mask]
    ratio = diff.exp()
    return {
        "expert_set_differs": (differs.sum() / fed.sum()).item(),
        "logprob_abs_diff_mean": diff.abs().mean().item(),
        "logprob_abs_diff_max": diff.abs().max().item(),
        "is_ratio_var": ratio.var().item(),
        "masked_fraction": ((ratio < 0.5) | (ratio > 2.0)).float().mean().item(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--expert-scale", type=float, default=30.0)
    parser.add_argument("--worker-dtype", default="bfloat16")
    parser.add_argument("--router-noise", type=float, default=0.05)
    parser.add_argument("--runs", type=int, default=0, help="Also train configs/moe.toml this many times each way.")
    parser.add_argument("--staleness", type=int, default=0, help="max_staleness of those runs (0: sampler_kl is all mismatch).")
    parser.add_argument("--eval-prompts", type=int, default=512)
    parser.add_argument("--work", default="", help="Directory of the runs; default a temporary one.")
    args = parser.parse_args()
    torch.manual_seed(0)
    config = TinyModelConfig(hidden_size=64, num_layers=2, num_heads=4, intermediate_size=128,
                             moe={"num_experts": args.experts, "top_k": args.top_k, "expert_intermediate_size": 32})
    model = build_model(config)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if ".experts." in name:
                parameter.mul_(args.expert_scale)
    rng = random.Random(0)
    prompts = [[1] + [rng.randint(3, 13) for _ in range(rng.randint(4, 10))] for _ in range(args.prompts)]
    with tempfile.TemporaryDirectory() as directory:
        model.save_pretrained(directory)
        build_tiny_tokenizer().save_pretrained(directory)
        worker = HFBackend(seed=0)
        worker.load(directory, 0)
    trainer = model.eval()
    assert worker.model is not None
    equal = compare(trainer, sample(worker, prompts, args.max_tokens), replay=True)
    worker.model.to(getattr(torch, args.worker_dtype))
    worker.router_noise = args.router_noise  # [simulation] router_noise (workers/simulation.py)
    samples = sample(worker, prompts, args.max_tokens)
    fed = sum(len(s.prompt_token_ids) + len(s.completion_token_ids) - 1 for s in samples)
    route_bytes = sum(len(encode_model(s.expert_routing, MEDIA_MSGPACK)) for s in samples if s.expert_routing is not None)
    result = {
        "replay": compare(trainer, samples, replay=True),
        "no_replay": compare(trainer, samples, replay=False),
        "route_bytes_per_token": route_bytes / fed,
        "equal_replay_logprob_abs_diff_max": equal["logprob_abs_diff_max"],
        "settings": vars(args) | {"tokens_fed": fed, "completion_tokens": sum(len(s.completion_token_ids) for s in samples)},
    }
    if args.runs:
        with tempfile.TemporaryDirectory() as scratch:
            work = Path(args.work or scratch)
            for keep, key in ((True, "run_replay"), (False, "run_no_replay")):
                result[key] = summarize_runs([train_and_eval(args, work, keep, seed) for seed in range(args.runs)])
    print(json.dumps(result))


def decentrl(*argv: str, log: Path) -> str:
    """Run a `decentrl` command to completion; its stdout (its log on failure: SystemExit)."""
    done = subprocess.run([sys.executable, "-m", "decentrl", *argv], cwd=ROOT, capture_output=True, text=True)
    log.write_text(done.stdout + done.stderr)
    if done.returncode:
        raise SystemExit(f"decentrl {' '.join(argv)} failed ({done.returncode}): see {log}")
    return done.stdout


def train_and_eval(args: argparse.Namespace, work: Path, keep: bool, seed: int) -> dict[str, float]:
    """One `decentrl run configs/moe.toml` (replayed or not), then `decentrl eval` of its final version."""
    run_dir = work / f"{'replay' if keep else 'no_replay'}-seed{seed}"
    overrides = [f"model.keep_routing={str(keep).lower()}", f"max_staleness={args.staleness}", f"model.seed={seed}",
                 f"simulation.router_noise={args.router_noise}"]
    sets = [arg for value in overrides for arg in ("--set", value)]
    decentrl("run", "configs/moe.toml", *sets, "--run-dir", str(run_dir), log=work / f"{run_dir.name}.run.log")
    evaluated = json.loads(decentrl(
        "eval", str(run_dir / "config.json"), "--run-dir", str(run_dir), "--prompts", str(args.eval_prompts),
        "--cache-dir", str(work / "cache"), log=work / f"{run_dir.name}.eval.log",
    ).strip().splitlines()[-1])
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {
        "eval_reward": evaluated["reward_mean"],
        "eval_reward_stderr": evaluated["reward_stderr"],
        "reward_last10": statistics.fmean(m["reward_mean"] for m in metrics[-10:]),
        "sampler_kl": statistics.fmean(m["sampler_kl"] for m in metrics),
        "sampler_kl_last50": statistics.fmean(m["sampler_kl"] for m in metrics[-50:]),
        "is_ratio_max": max(m["is_ratio_max"] for m in metrics),
    }


def summarize_runs(runs: list[dict[str, float]]) -> dict[str, object]:
    """Means over runs, the eval reward's stderr over runs, and every run's figures."""
    means = {key: statistics.fmean(run[key] for run in runs) for key in runs[0]}
    spread = statistics.stdev(run["eval_reward"] for run in runs) / len(runs) ** 0.5 if len(runs) > 1 else None
    return means | {"eval_reward_stderr_over_runs": spread, "runs": runs}


if __name__ == "__main__":
    main()
