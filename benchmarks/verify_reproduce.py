"""The verifier's seeded re-draw (deterministic runs, docs/reproducibility.md) against the logprob
check alone, on the same rollouts: cost and what each catches.

The demo's model (configs/local.toml, version 0 as the trainer publishes it) in a file:// store;
the real HF backend generates --groups groups as a deterministic worker does (sample j of a group
seeded with decentrl/rl/determinism.py `sample_seed`), and as many "chosen" groups: the policy's own
samples with honest logprobs, but drawn from other seeds (a worker keeping the best of several
tries). `Verifier.check` judges every rollout, --repeats times, once without the re-draw (a run
that is not deterministic) and once with it. Last line: one JSON object.
  check_s_logprob / check_s_reproduce   wall seconds of one check of all rollouts (median)
  overhead                              check_s_reproduce / check_s_logprob - 1
  caught_logprob / caught_reproduce     share of chosen rollouts rejected
  false_positives_*                     honest rollouts rejected
Usage: python benchmarks/verify_reproduce.py [--groups 32 --repeats 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--groups", type=int, default=32, help="Honest groups, and as many chosen ones.")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    import torch

    from decentrl.api.wire import Rollout, SamplingParams
    from decentrl.config import load_config
    from decentrl.model.build import build_model, build_tiny_tokenizer
    from decentrl.rl.determinism import sample_seed, use_deterministic_torch
    from decentrl.store.checkpoints import CheckpointStore
    from decentrl.store.weights import write_hf_dir
    from decentrl.tasks import build_task
    from orchestrator.verify import Verifier
    from workers.backends.hf import HFBackend

    config = load_config(str(ROOT / "configs" / "local.toml"), ["deterministic=true", "seed=3"])
    use_deterministic_torch(config.worker.torch_threads)
    tmp = tempfile.mkdtemp(prefix="decentrl-verify-reproduce-")
    model = build_model(config.model)
    source = os.path.join(tmp, "v0")
    os.makedirs(source)
    build_tiny_tokenizer().save_pretrained(source)
    model.generation_config.save_pretrained(source)
    write_hf_dir(source, model.state_dict(), model.config, extras_from=source)
    store = CheckpointStore(f"file://{tmp}/store")
    store.publish(0, source, parent=None)
    worker = HFBackend(seed=0)
    worker.load(store.pull(0, os.path.join(tmp, "worker-cache")), 0)

    task = build_task(config.task)
    tokenizer = build_tiny_tokenizer()
    sampling = SamplingParams(temperature=config.sampling.temperature, max_tokens=config.sampling.max_tokens)
    size = config.group_size

    def group(prompt_id: int, seed: int) -> list[Rollout]:
        prompt = tokenizer(task.prompt(prompt_id).text, add_special_tokens=False).input_ids
        seeds = [sample_seed(seed, prompt_id, j, 0) for j in range(size)]
        completions = worker.generate([prompt] * size, sampling, seeds=seeds)
        lease = uuid.uuid4().hex
        return [
            Rollout(
                rollout_id=uuid.uuid4().hex, run_name=config.run_name, lease_id=lease, prompt_id=prompt_id,
                worker_id="w0", sample_index=j, policy_version=0, prompt_token_ids=prompt,
                completion_token_ids=c.token_ids, logprobs=c.logprobs, finish_reason=c.finish_reason, sampling=sampling,
            )
            for j, c in enumerate(completions)
        ]

    honest = [r for g in range(args.groups) for r in group(g, config.seed)]
    chosen = [r for g in range(args.groups) for r in group(g, config.seed + 1)]
    report: dict[str, object] = {"rollouts": len(honest) + len(chosen), "group_size": size, "model": config.model.model_dump()}
    for name, run_seed in (("logprob", None), ("reproduce", config.seed)):
        verifier = Verifier(
            config.orchestrator.verification, store=store, cache_dir=os.path.join(tmp, "vcache"),
            build=lambda: build_model(config.model), run_seed=run_seed,
        )
        verifier.warm_up()
        verifier.check(honest[:size])  # loads the version: not counted below
        times = []
        for _ in range(args.repeats):
            started = time.perf_counter()
            failed = verifier.check(honest + chosen)
            times.append(time.perf_counter() - started)
        report[f"check_s_{name}"] = statistics.median(times)
        report[f"caught_{name}"] = sum(r.rollout_id in failed for r in chosen) / len(chosen)
        report[f"false_positives_{name}"] = sum(r.rollout_id in failed for r in honest)
        report[f"draw_s_{name}"] = verifier.draw_s / (args.repeats + 1)
    report["overhead"] = report["check_s_reproduce"] / report["check_s_logprob"] - 1
    report["threads"] = torch.get_num_threads()
    print(json.dumps(report))


if __name__ == "__main__":
    main()
