"""Ingest throughput of the orchestrator on loopback, against a bare aiohttp echo endpoint.

    .venv/bin/python benchmarks/ingest.py                 # defaults: 32 clients, 8 rollouts a post
    .venv/bin/python benchmarks/ingest.py --cpus 0,1      # pin every process to two cores

Each rollout is realistic in size: a 512-token prompt, 1024 completion tokens and 1024 logprobs
(float32 values, as a worker computes them), posted as msgpack like a worker does. The
orchestrator runs in its own process exactly as `decentrl orchestrator` builds it (RunState,
SQLite journal in WAL mode with synchronous=FULL, uvloop when installed), except that its task
is the sorting task with 511-digit prompts (the config schema caps num_digits at 16), so prompts
are 512 tokens of the 14-token vocabulary of the tiny tokenizer and every completion token is a
real id of it. `--clients` concurrent workers each lease groups and post each group's samples
in one request; the orchestrator validates, checks the lease, journals (commit before the
answer) and scores every group with the verifier. A trainer-like consumer fetches batches so
the buffer stays bounded, as in a run.

The echo server is a bare aiohttp app (same event loop kind) whose handler only reads the body;
the same clients post the same bodies to it. Echo and orchestrator rounds alternate (--rounds
each) and the medians are compared, so both see the same machine load.

The last line of stdout is one JSON object: rollouts_per_s, tokens_per_s, p50_ms, p99_ms (of
POST /v1/rollouts), ratio_to_echo, plus the echo figures and the settings.

    .venv/bin/python benchmarks/ingest.py --dashboard    # the dashboard's cost to ingest

With --dashboard a third kind of round joins the alternation: the orchestrator with a dashboard
client attached, which polls GET /v1/dashboard?since=... every --dashboard-poll-s seconds as the
page does (orchestrator/static/dashboard.html). The summary adds dashboard_rollouts_per_s and
dashboard_ingest_ratio (with / without; the goal is at least 0.95).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from array import array
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PROMPT_TOKENS, COMPLETION_TOKENS = 512, 1024
RUN_NAME = "ingest-bench"


def _pin(cpus: list[int] | None) -> None:
    if cpus:
        os.sched_setaffinity(0, cpus)


def _loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop

        return uvloop.new_event_loop()
    except ImportError:
        return asyncio.new_event_loop()


# -- servers (child processes) -------------------------------------------------------------


def serve_orchestrator(port: int, run_dir: str, cpus: list[int] | None, group_size: int, sync: str) -> None:
    _pin(cpus)
    import logging

    from aiohttp import web

    from decentrl.config import SortingTaskConfig, parse_config
    from decentrl.model.build import build_tiny_tokenizer
    from decentrl.tasks.sorting import SortingTask
    from orchestrator.app import create_app, tune_gc
    from orchestrator.auth import TokenRegistry
    from orchestrator.journal import Journal
    from orchestrator.state import RunState

    logging.basicConfig(level=logging.WARNING)
    config = parse_config(
        {
            "run_name": RUN_NAME,
            "max_staleness": 1024,
            "group_size": group_size,
            "trainer_ranks": 1,
            "sampling": {"temperature": 1.0, "max_tokens": COMPLETION_TOKENS},
            "orchestrator": {
                "lease_timeout_s": 600.0, "journal_sync": sync, "max_buffer_groups": 4096,
                "rate_limit_per_s": 0, "max_inflight_requests": 1024, "max_inflight_per_token": 1024, "batch_wait_s": 1.0,
                "max_request_bytes": 64 * 1024 * 1024,
            },
            "trainer": {"groups_per_step": 32},
        },
        source="benchmark",
    )
    # 511 digits + "=" ... the tiny tokenizer adds <s>: 512 prompt tokens. Built past the
    # config schema (num_digits <= 16) on purpose: same task code, realistic length.
    task = SortingTask(SortingTaskConfig.model_construct(type="sorting", num_digits=PROMPT_TOKENS - 2, num_prompts=4096, seed=0))
    journal = Journal(os.path.join(run_dir, "journal.sqlite"), run_name=RUN_NAME, sync=sync)
    state = RunState(config=config, task=task, tokenizer=build_tiny_tokenizer(), journal=journal)
    state.announce(0)
    tokens = TokenRegistry(path=os.path.join(run_dir, "tokens.json"))
    app = create_app(state=state, tokens=tokens, store_url="memory://bench")
    tune_gc()  # as `decentrl orchestrator` does
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None, loop=_loop(), handle_signals=True)


def serve_echo(port: int, cpus: list[int] | None) -> None:
    _pin(cpus)
    from aiohttp import web

    async def echo(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(text='{"accepted": 0}', content_type="application/json")

    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_post("/v1/rollouts", echo)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None, loop=_loop(), handle_signals=True)


# -- clients -------------------------------------------------------------------------------


class Bodies:
    """msgpack bodies built the way OrchestratorClient builds them, with the arrays packed once."""

    def __init__(self, seed: int) -> None:
        import msgpack

        from decentrl.api.encoding import EXT_FLOAT32, EXT_INT32

        rng = random.Random(seed)
        self.msgpack = msgpack
        self.completions = []
        for _ in range(16):
            ids = [rng.randrange(3, 14) for _ in range(COMPLETION_TOKENS - 1)] + [2]  # digits/"=" then </s>
            logprobs = array("f", [-rng.expovariate(1.0) for _ in range(COMPLETION_TOKENS)])
            self.completions.append(
                (msgpack.ExtType(EXT_INT32, array("i", ids).tobytes()), msgpack.ExtType(EXT_FLOAT32, logprobs.tobytes()))
            )
        self.int32 = EXT_INT32

    def rollouts(
        self, lease: dict[str, Any], worker_id: str, sampling: dict[str, Any], rng: random.Random, per_post: int
    ) -> list[bytes]:
        """The lease's whole group, in posts of `per_post` rollouts."""
        prompt = self.msgpack.ExtType(self.int32, array("i", lease["prompt_token_ids"]).tobytes())
        rollouts = []
        for _ in range(lease["group_size"]):
            ids, logprobs = rng.choice(self.completions)
            rollouts.append({
                "rollout_id": uuid.uuid4().hex, "run_name": RUN_NAME, "lease_id": lease["lease_id"],
                "prompt_id": lease["prompt_id"], "worker_id": worker_id, "policy_version": 0,
                "prompt_token_ids": prompt, "completion_token_ids": ids, "logprobs": logprobs,
                "finish_reason": "length", "sampling": sampling,
            })
        return [
            self.msgpack.packb({"rollouts": rollouts[i : i + per_post]}, use_bin_type=True)
            for i in range(0, len(rollouts), per_post)
        ]


async def _client_main(
    url: str, token: str, *, echo: bool, clients: int, duration: float, groups_per_lease: int, group_size: int,
    per_post: int, seed: int, fake_prompt: list[int],
) -> dict[str, Any]:
    import aiohttp

    from decentrl.api.encoding import MEDIA_MSGPACK, unpack_msgpack

    bodies = Bodies(seed)
    headers = {"Authorization": f"Bearer {token}", "Content-Type": MEDIA_MSGPACK, "Accept": MEDIA_MSGPACK}
    sampling = {"temperature": 1.0, "max_tokens": COMPLETION_TOKENS, "top_k": 0, "top_p": 1.0}
    latencies: list[float] = []
    counts = {"rollouts": 0, "posts": 0, "errors": 0}
    started = time.perf_counter()
    stop_at = started + duration

    async def worker(index: int, session: aiohttp.ClientSession) -> None:
        rng = random.Random(f"{seed}/{index}")
        worker_id = f"w{seed}-{index}"
        while time.perf_counter() < stop_at:
            if echo:
                leases = [
                    {"lease_id": uuid.uuid4().hex, "prompt_id": 0, "prompt_token_ids": fake_prompt, "group_size": group_size}
                    for _ in range(groups_per_lease)
                ]
            else:
                body = bodies.msgpack.packb({"worker_id": worker_id, "max_groups": groups_per_lease})
                async with session.post(f"{url}/v1/leases", data=body, headers=headers) as response:
                    answer = unpack_msgpack(await response.read())
                leases = answer["leases"]
                if not leases:
                    await asyncio.sleep(answer["retry_after_s"])
                    continue
            for lease in leases:
                for body in bodies.rollouts(lease, worker_id, sampling, rng, per_post):
                    sent = time.perf_counter()
                    async with session.post(f"{url}/v1/rollouts", data=body, headers=headers) as response:
                        payload = await response.read()
                        ok = response.status == 200
                    done = time.perf_counter()
                    if done > stop_at:
                        return
                    if not ok:
                        counts["errors"] += 1
                        continue
                    accepted = min(per_post, lease["group_size"]) if echo else unpack_msgpack(payload)["accepted"]
                    counts["rollouts"] += accepted
                    counts["posts"] += 1
                    latencies.append(done - sent)

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=120)) as session:
        await asyncio.gather(*(worker(i, session) for i in range(clients)))
    return {**counts, "latencies": latencies, "elapsed": time.perf_counter() - started}


def client_process(args: dict[str, Any], out: Any) -> None:
    _pin(args.pop("cpus"))
    loop = _loop()
    try:
        out.send(loop.run_until_complete(_client_main(**args)))
    finally:
        loop.close()


async def _poll_dashboard(session: Any, url: str, token: str, stop_at: float, every_s: float) -> None:
    """What an open dashboard page does: GET /v1/dashboard?since=<its last answer> every `every_s`."""
    since = 0.0
    while time.perf_counter() < stop_at:
        async with session.get(f"{url}/v1/dashboard?since={since}", headers={"Authorization": f"Bearer {token}"}) as response:
            since = (await response.json())["now"]
        await asyncio.sleep(every_s)


async def _consume(url: str, token: str, stop_at: float, dashboard_poll_s: float = 0.0) -> int:
    """The trainer's side: fetch batches (msgpack) as they form, so the buffer stays bounded."""
    import aiohttp

    from decentrl.api.encoding import MEDIA_MSGPACK

    served, version = 0, 0
    headers = {"Authorization": f"Bearer {token}", "Accept": MEDIA_MSGPACK}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        if dashboard_poll_s:
            poller = asyncio.create_task(_poll_dashboard(session, url, token, stop_at, dashboard_poll_s))
        while time.perf_counter() < stop_at:
            async with session.get(f"{url}/v1/batch?trainer_version={version}", headers=headers) as response:
                await response.read()
                served += response.status == 200
        if dashboard_poll_s:
            await poller
    return served


def consumer_process(url: str, token: str, duration: float, cpus: list[int] | None, out: Any, dashboard_poll_s: float) -> None:
    _pin(cpus)
    out.send(asyncio.run(_consume(url, token, time.perf_counter() + duration, dashboard_poll_s)))


# -- the driver ----------------------------------------------------------------------------


def _wait_up(port: int, timeout: float = 60.0) -> None:
    import socket

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"server on port {port} did not start in {timeout}s")


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux /proc), all its threads."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_round(kind: str, options: argparse.Namespace, cpus: list[int] | None) -> dict[str, Any]:
    from decentrl.cli.launch import free_port

    ctx = multiprocessing.get_context("spawn")
    port = free_port()
    run_dir = tempfile.mkdtemp(prefix="decentrl-ingest-", dir=options.dir)
    tokens = {}
    if kind in ("orchestrator", "dashboard"):
        from orchestrator.auth import add_token

        tokens = {f"c{i}": add_token(os.path.join(run_dir, "tokens.json"), name=f"c{i}", role="worker")
                  for i in range(options.client_procs)}
        tokens["trainer"] = add_token(os.path.join(run_dir, "tokens.json"), name="trainer", role="trainer")
        server = ctx.Process(target=serve_orchestrator, args=(port, run_dir, cpus, options.group_size, options.journal_sync))
    else:
        server = ctx.Process(target=serve_echo, args=(port, cpus))
    server.start()
    try:
        _wait_up(port)
        url = f"http://127.0.0.1:{port}"
        fake_prompt = [1] + [random.randrange(3, 14) for _ in range(PROMPT_TOKENS - 1)]
        pipes, procs = [], []
        per_proc = max(1, options.clients // options.client_procs)
        for i in range(options.client_procs):
            receive, send = ctx.Pipe(duplex=False)
            args = {
                "url": url, "token": tokens.get(f"c{i}", "none"), "echo": kind == "echo", "clients": per_proc,
                "duration": options.duration, "groups_per_lease": options.groups_per_lease,
                "group_size": options.group_size, "per_post": options.rollouts_per_post or options.group_size,
                "seed": i, "fake_prompt": fake_prompt, "cpus": cpus,
            }
            procs.append(ctx.Process(target=client_process, args=(args, send)))
            pipes.append(receive)
        consumer = None
        if kind in ("orchestrator", "dashboard"):
            receive, send = ctx.Pipe(duplex=False)
            poll_s = options.dashboard_poll_s if kind == "dashboard" else 0.0
            consumer = (ctx.Process(target=consumer_process, args=(url, tokens["trainer"], options.duration, cpus, send, poll_s)), receive)
        cpu_before = _cpu_seconds(server.pid)  # type: ignore[arg-type]
        for proc in procs:
            proc.start()
        if consumer is not None:
            consumer[0].start()
        results = [pipe.recv() for pipe in pipes]
        server_cpu = _cpu_seconds(server.pid) - cpu_before  # type: ignore[arg-type]
        for proc in procs:
            proc.join()
        batches = 0
        if consumer is not None:
            batches = consumer[1].recv()
            consumer[0].join()
    finally:
        server.terminate()
        server.join()
        shutil.rmtree(run_dir, ignore_errors=True)
    latencies = sorted(x for r in results for x in r["latencies"])
    elapsed = max(r["elapsed"] for r in results)
    rollouts = sum(r["rollouts"] for r in results)
    return {
        "kind": kind,
        "rollouts_per_s": rollouts / elapsed,
        "posts": sum(r["posts"] for r in results),
        "errors": sum(r["errors"] for r in results),
        "p50_ms": 1000 * latencies[len(latencies) // 2] if latencies else None,
        "p99_ms": 1000 * latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))] if latencies else None,
        "batches_served": batches,
        "server_cpu_s": server_cpu,
        "server_cpu_us_per_rollout": 1e6 * server_cpu / rollouts if rollouts else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=32, help="Concurrent workers (asyncio tasks) in all.")
    parser.add_argument("--client-procs", type=int, default=2, help="Client processes the workers are spread over.")
    parser.add_argument("--group-size", type=int, default=8, help="Samples per group (prompt).")
    parser.add_argument("--rollouts-per-post", type=int, default=0, help="Rollouts per POST; default a whole group.")
    parser.add_argument("--groups-per-lease", type=int, default=4, help="Groups leased per lease request.")
    parser.add_argument("--duration", type=float, default=8.0, help="Seconds per round.")
    parser.add_argument("--rounds", type=int, default=3, help="Rounds of each (echo and orchestrator, alternating).")
    parser.add_argument("--journal-sync", choices=["full", "normal"], default="full")
    parser.add_argument("--cpus", default="", help="Pin every process to these CPUs, e.g. 0,1.")
    parser.add_argument("--dir", default=None, help="Where the run dirs (journal) go; default the system temp dir.")
    parser.add_argument("--dashboard", action="store_true", help="Also rounds with a dashboard client polling.")
    parser.add_argument("--dashboard-poll-s", type=float, default=2.0, help="The dashboard client's poll interval.")
    options = parser.parse_args()
    cpus = [int(c) for c in options.cpus.split(",")] if options.cpus else None
    _pin(cpus)
    kinds = ("echo", "orchestrator", "dashboard") if options.dashboard else ("echo", "orchestrator")
    rounds: dict[str, list[dict[str, Any]]] = {kind: [] for kind in kinds}
    for index in range(options.rounds):
        for kind in kinds:
            result = run_round(kind, options, cpus)
            rounds[kind].append(result)
            print(f"round {index + 1} {kind}: " + json.dumps({k: v for k, v in result.items() if k != "kind"}), flush=True)

    def median(kind: str, key: str) -> float:
        return statistics.median(r[key] for r in rounds[kind] if r[key] is not None)

    rollouts_per_s = median("orchestrator", "rollouts_per_s")
    echo_per_s = median("echo", "rollouts_per_s")
    summary = {
        "rollouts_per_s": round(rollouts_per_s, 1),
        "tokens_per_s": round(rollouts_per_s * (PROMPT_TOKENS + COMPLETION_TOKENS)),
        "p50_ms": round(median("orchestrator", "p50_ms"), 2),
        "p99_ms": round(median("orchestrator", "p99_ms"), 2),
        "ratio_to_echo": round(rollouts_per_s / echo_per_s, 3),
        "echo_rollouts_per_s": round(echo_per_s, 1),
        "echo_p50_ms": round(median("echo", "p50_ms"), 2),
        "server_cpu_us_per_rollout": round(median("orchestrator", "server_cpu_us_per_rollout"), 1),
        "echo_server_cpu_us_per_rollout": round(median("echo", "server_cpu_us_per_rollout"), 1),
        "errors": sum(r["errors"] for r in rounds["orchestrator"]),
        "settings": {
            "clients": options.clients,
            "client_procs": options.client_procs,
            "rollouts_per_post": options.rollouts_per_post or options.group_size,
            "groups_per_lease": options.groups_per_lease,
            "duration_s": options.duration,
            "rounds": options.rounds,
            "journal_sync": options.journal_sync,
            "cpus": options.cpus or f"all ({os.cpu_count()})",
            "prompt_tokens": PROMPT_TOKENS,
            "completion_tokens": COMPLETION_TOKENS,
        },
    }
    if options.dashboard:
        summary["dashboard_rollouts_per_s"] = round(median("dashboard", "rollouts_per_s"), 1)
        summary["dashboard_ingest_ratio"] = round(median("dashboard", "rollouts_per_s") / rollouts_per_s, 3)
        summary["dashboard_p50_ms"] = round(median("dashboard", "p50_ms"), 2)
        summary["settings"]["dashboard_poll_s"] = options.dashboard_poll_s
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
