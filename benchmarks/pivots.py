"""Pivots with partial steps scored mid-generation (issue 47): three arms at the same budget of
generated tokens, on the chained-sums task (decentrl/tasks/chain.py, one step per '='):

- `root`: root-only GRPO groups (`group_size` samples a prompt, no scoring mid-generation);
- `random`: chains stopped at a step the scorer judges wrong, `pivots` pivots chosen at random,
  `k` continuations each (the control: branching without the scorer's pick);
- `prm`: the same, pivots at the last step judged right (the scorer's pick, `last_right`).

Every arm runs the real parts on loopback: the orchestrator app (tree leases, POST /v1/steps,
the verdict long-poll, the node checks on the whole unit), a `decentrl scorer` loop judging each
step with the task's exact checker (workers/scorers/chain.py), and the worker's step-wise hf
generation (workers/tree.py). The model is a tiny model fine-tuned here on right answers for
`--sft-steps` steps, so that it starts with a signal (some steps right, some wrong).

Measured, per arm and seed, until the arm has generated `--budget` tokens (tokens kept in samples
plus those decoded after a wrong step before its verdict came): units, units solved (a right
sample anywhere in the unit), units that give no gradient (every advantage of the unit 0), failed
roots recovered by a branch; the tokens saved by stopping (exact: a stopped row keeps decoding
unposted until it would have ended); step-post waits; decode time keeping the prefix's KV cache
against rebuilding it at each step boundary; generation throughput with mid-generation scoring
against without it. No policy is trained here: `tokens_to_target_pivot_vs_root` (held-out accuracy
after training) is reported as null, not measured.

    python benchmarks/pivots.py --budget 6000 --seeds 2 --sft-steps 600

The last line is one JSON object with the issue's keys.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SHAPE = {"hidden_size": 64, "num_layers": 2, "num_heads": 2, "intermediate_size": 128}
ARMS = {
    "root": {"pivots": 0, "stop_below": None, "rule": "random"},
    "random": {"pivots": 1, "stop_below": 0.5, "rule": "random"},
    "prm": {"pivots": 1, "stop_below": 0.5, "rule": "last_right"},
}


def finetune(directory: str, steps: int, seed: int) -> float:
    """A tiny model trained on right chained sums (teacher forcing), written as an HF directory;
    returns the final loss."""
    import torch

    from decentrl.config import ChainTaskConfig, TinyModelConfig
    from decentrl.model.build import build_model, build_tiny_tokenizer
    from decentrl.store.weights import write_hf_dir
    from decentrl.tasks.chain import ChainTask, running_sums

    torch.manual_seed(seed)
    tokenizer = build_tiny_tokenizer()
    model = build_model(TinyModelConfig(**SHAPE, seed=seed))
    task = ChainTask(ChainTaskConfig(num_digits=4, num_prompts=4096, seed=1000 + seed))  # not the arms' prompts
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    rng = random.Random(seed)
    loss = torch.tensor(0.0)
    model.train()
    for _ in range(steps):
        batch = []
        for prompt_id in rng.sample(range(task.num_prompts), 64):
            text = task.prompt(prompt_id).text
            answer = "".join(f"{total}=" for total in running_sums(text))
            prompt_ids = tokenizer(text).input_ids
            ids = prompt_ids + tokenizer(answer, add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
            batch.append((ids, len(prompt_ids)))
        width = max(len(ids) for ids, _ in batch)
        inputs = torch.tensor([ids + [tokenizer.pad_token_id] * (width - len(ids)) for ids, _ in batch])
        labels = torch.tensor([[-100] * n + ids[n:] + [-100] * (width - len(ids)) for ids, n in batch])
        loss = model(input_ids=inputs, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    os.makedirs(directory, exist_ok=True)
    tokenizer.save_pretrained(directory)
    model.generation_config.save_pretrained(directory)
    write_hf_dir(directory, model.state_dict(), model.config, extras_from=directory)
    return float(loss)


def pace(backend: Any, token_s: float) -> None:
    """Makes each forward pass of `backend`'s loaded model take `token_s` seconds longer. The tiny
    model decodes a 24-token chain in milliseconds, faster than any verdict can come back over
    HTTP; a real model takes 10-50 ms a token, which is what gives a mid-generation verdict the
    time to act. Without pacing, the figures measure the race, not the method."""
    forward = backend.model.forward

    def paced(*args: Any, **kwargs: Any) -> Any:
        time.sleep(token_s)
        return forward(*args, **kwargs)

    backend.model.forward = paced


def run_arm(
    arm: str, seed: int, checkpoint: str, budget: int, group_size: int, k: int, *, keep_cache: bool = True,
    post_steps: bool = True, token_s: float = 0.0, verdict_wait_s: float = 5.0,
) -> dict[str, Any]:
    """One arm at one seed on a fresh orchestrator, scorer and backend: units until `budget` tokens.
    `token_s`: each decoding step takes at least this long (`pace`), as a real model's does."""
    from decentrl.api.client import OrchestratorClient
    from decentrl.api.wire import LeaseRequest, RolloutBatch
    from decentrl.config import PythonScorerConfig, parse_config
    from decentrl.model.build import build_tiny_tokenizer
    from decentrl.rl.advantages import tree_advantages
    from decentrl.rl.pivots import RecoveryEstimate
    from decentrl.tasks import build_task
    from decentrl.tasks.chain import chain_reward
    from orchestrator.app import create_app
    from orchestrator.auth import TokenRegistry
    from orchestrator.state import RunState
    from tests.openai_server import Loopback
    from workers.backends.hf import HFBackend
    from workers.scorer import Scorer
    from workers.scorers import build_scorer_backend
    from workers.tree import TreeCounts, VerdictFeed, generate_tree

    options = ARMS[arm]
    config = parse_config({
        "run_name": f"pivots-{arm}-{seed}", "group_size": group_size, "max_staleness": 1, "num_workers": 1, "trainer_ranks": 1,
        "model": {"type": "tiny", **SHAPE}, "task": {"type": "chain", "num_digits": 4, "num_prompts": 4096, "seed": seed},
        "sampling": {"temperature": 1.0, "max_tokens": 24},
        "orchestrator": {"host": "127.0.0.1", "port": 0, "journal": False, "lease_wait_s": 0.0, "lease_timeout_s": 120.0,
                         "rewards": {"lease_timeout_s": 30.0},
                         "tree": {"k": k, "marker": "=", **options}},
        "trainer": {"groups_per_step": 1024, "steps": 10},
    })
    tokenizer = build_tiny_tokenizer()
    state = RunState(config=config, task=build_task(config.task), tokenizer=tokenizer)
    state.announce(0)
    tokens = [{"name": "vol", "role": "worker", "token": "w"}, {"name": "judge", "role": "scorer", "token": "s"}]
    server = Loopback(create_app(state=state, tokens=TokenRegistry(tokens), store_url="memory://pivots"))
    scorer_config = PythonScorerConfig(function="workers.scorers.chain:judge", max_items=64, min_wait_s=0.005)
    scorer = Scorer(scorer_config, scorer_id="s0", client=OrchestratorClient(server.url, "s"), backend=build_scorer_backend(scorer_config))
    scoring = threading.Thread(target=scorer.run, daemon=True)
    scoring.start()
    client = OrchestratorClient(server.url, "w")
    feed = VerdictFeed(client, "w0", wait_s=1.0).start()
    backend = HFBackend(seed=seed)
    backend.load(checkpoint, 0)
    if token_s:
        pace(backend, token_s)
    rng, estimate, counts = random.Random(seed), RecoveryEstimate(), TreeCounts()
    units = solved = no_gradient = failed_roots = recovered = 0
    roots = roots_right = branches = branches_right = pivots_on_failed = 0
    started = time.perf_counter()
    try:
        while counts.generated + counts.discarded < budget:
            answer = client.lease(LeaseRequest(worker_id="w0", max_groups=1))
            (lease,) = answer.leases
            samples = generate_tree(backend, client if post_steps else _Silent(), lease, answer.sampling,  # type: ignore[arg-type]
                                    run_name=config.run_name, worker_id="w0", feed=feed, rng=rng, estimate=estimate,
                                    counts=counts, keep_cache=keep_cache, verdict_wait_s=verdict_wait_s)
            ingest = client.post_rollouts(RolloutBatch(rollouts=samples))
            if ingest.rejected:
                raise RuntimeError(f"the orchestrator refused samples of a {arm} unit: {ingest.rejected}")
            prompt = state.task.prompt(lease.prompt_id).text
            rewards = [chain_reward(prompt, tokenizer.decode(s.completion_token_ids, skip_special_tokens=True)) if s.node is None
                       else chain_reward(prompt, tokenizer.decode(list(s.prompt_token_ids[len(lease.prompt_token_ids):])
                                                                  + list(s.completion_token_ids), skip_special_tokens=True))
                       for s in samples]
            pivots = [None if s.node is None else (s.node.parent.rollout_id, s.node.parent.at) for s in samples]  # type: ignore[union-attr]
            units += 1
            by_id = {s.rollout_id: r for s, r in zip(samples, rewards, strict=True)}
            roots += sum(p is None for p in pivots)
            roots_right += sum(r for r, p in zip(rewards, pivots, strict=True) if p is None)
            branches += sum(p is not None for p in pivots)
            branches_right += sum(r for r, p in zip(rewards, pivots, strict=True) if p is not None)
            pivots_on_failed += sum(not by_id[parent] for parent, _ in {p for p in pivots if p is not None})
            solved += any(rewards)
            no_gradient += not any(tree_advantages(rewards, pivots, 1.0))
            roots_failed = not any(r for r, p in zip(rewards, pivots, strict=True) if p is None)
            failed_roots += roots_failed
            recovered += roots_failed and any(rewards)
    finally:
        elapsed = time.perf_counter() - started
        scorer.request_stop()
        feed.close()
        scoring.join(timeout=30)
        server.close()
    spent = counts.generated + counts.discarded
    return {
        "arm": arm, "seed": seed, "units": units, "tokens": spent, "tokens_kept": counts.generated,
        "tokens_discarded": counts.discarded, "tokens_saved": counts.saved, "solved": solved,
        "solved_per_1k_tokens": 1000 * solved / spent, "recovered": recovered, "failed_roots": failed_roots,
        "recovered_per_1k_tokens": 1000 * recovered / spent, "no_gradient_units": no_gradient,
        "no_gradient_fraction": no_gradient / units, "steps_posted": counts.steps_posted, "verdicts_used": counts.verdicts_used,
        "root_success": roots_right / roots if roots else None, "branch_success": branches_right / branches if branches else None,
        "pivots": branches // k, "pivots_on_failed_roots": pivots_on_failed,
        "verdict_wait_s": round(counts.verdict_wait_s, 3), "verdict_timeouts": counts.verdict_timeouts,
        "step_post_wait_s": round(counts.step_post_wait_s, 4), "decode_s": round(counts.decode_s, 3),
        "cache_rebuild_s": round(counts.cache_rebuild_s, 3), "tokens_per_decode_s": spent / counts.decode_s if counts.decode_s else None,
        "wall_s": round(elapsed, 2), "keep_cache": keep_cache, "post_steps": post_steps,
    }


class _Silent:
    """Step posts that go nowhere (the throughput baseline without mid-generation scoring)."""

    def post_steps(self, post: Any) -> None:
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget", type=int, default=6000, help="Generated tokens per arm and seed.")
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--token-ms", type=float, default=10.0,
                        help="Each decoding step takes this much longer (a real model's pace; 0: the tiny model's own).")
    parser.add_argument("--verdict-wait-s", type=float, default=5.0,
                        help="Most seconds a unit waits for its roots' last verdicts before choosing pivots (0: chosen on those in).")
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--k", type=int, default=4, help="Continuations of each pivot.")
    parser.add_argument("--sft-steps", type=int, default=600, help="Fine-tuning steps that give the model a signal.")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = os.path.join(tmp, "v0")
        sft_loss = finetune(checkpoint, args.sft_steps, seed=0)
        for seed in range(args.seeds):
            for arm in ARMS:
                runs.append(run_arm(arm, seed, checkpoint, args.budget, args.group_size, args.k, token_s=args.token_ms / 1000,
                                    verdict_wait_s=args.verdict_wait_s))
                print(json.dumps(runs[-1]), flush=True)
        # The measures of the worker's side, on seed 0: the KV cache rebuilt at each step's end
        # (prm arm), and the root arm's throughput without posting its steps for scoring.
        rebuilt = run_arm("prm", 0, checkpoint, args.budget, args.group_size, args.k, keep_cache=False, token_s=args.token_ms / 1000,
                          verdict_wait_s=args.verdict_wait_s)
        silent = run_arm("root", 0, checkpoint, args.budget, args.group_size, args.k, post_steps=False, token_s=args.token_ms / 1000)
        print(json.dumps(rebuilt), flush=True)
        print(json.dumps(silent), flush=True)

    def mean(arm: str, key: str) -> float:
        return statistics.fmean(r[key] for r in runs if r["arm"] == arm)

    def ratio(a: float, b: float) -> float | None:
        return a / b if b else None  # None: the root arm had none to compare with

    kept = next(r for r in runs if r["arm"] == "prm" and r["seed"] == 0)
    posted_root = next(r for r in runs if r["arm"] == "root" and r["seed"] == 0)
    print(json.dumps({
        "tokens_to_target_pivot_vs_root": None,  # needs training runs: not measured here
        # A root-only group recovers no failed root (it has no branch): the ratio is to its solved
        # units per 1k tokens, failed roots recovered by a branch counted for the pivot arms.
        "recovered_per_1k_tokens_pivot_vs_root": ratio(mean("prm", "solved_per_1k_tokens"), mean("root", "solved_per_1k_tokens")),
        "recovered_per_1k_tokens_random_vs_root": ratio(mean("random", "solved_per_1k_tokens"), mean("root", "solved_per_1k_tokens")),
        "recovered_per_1k_tokens": {arm: mean(arm, "recovered_per_1k_tokens") for arm in ARMS},
        "all_fail_groups_pivot": mean("prm", "no_gradient_fraction"),
        "all_fail_groups_random": mean("random", "no_gradient_fraction"),
        "all_fail_groups_root": mean("root", "no_gradient_fraction"),
        "tokens_saved_by_early_stop": sum(r["tokens_saved"] for r in runs if r["arm"] == "prm"),
        "tokens_saved_by_early_stop_random": sum(r["tokens_saved"] for r in runs if r["arm"] == "random"),
        # Decoding reads verdicts between tokens and never waits for one; a unit with pivots waits
        # for its roots' last verdicts before choosing where to branch (workers/tree.py).
        "worker_wait_for_verdicts_s": sum(r["verdict_wait_s"] for r in runs),
        "branch_success": {arm: mean(arm, "branch_success") for arm in ("random", "prm")},
        "root_success": {arm: mean(arm, "root_success") for arm in ARMS},
        "worker_wait_for_step_posts_s": sum(r["step_post_wait_s"] for r in runs),
        "throughput_with_scoring_vs_without": ratio(posted_root["tokens_per_decode_s"], silent["tokens_per_decode_s"]),
        "kv_keep_decode_s": kept["decode_s"], "kv_rebuild_decode_s": rebuilt["decode_s"],
        "kv_rebuild_s": rebuilt["cache_rebuild_s"],
        "verdict_wait_s": args.verdict_wait_s, "token_ms": args.token_ms,
        "budget_tokens": args.budget, "seeds": args.seeds, "group_size": args.group_size, "k": args.k,
        "sft_steps": args.sft_steps, "sft_loss": round(sft_loss, 4),
    }))


if __name__ == "__main__":
    main()
