"""Announce -> worker latency (issue 45): how long after the trainer's POST /v1/version a worker
hears of the version.

    .venv/bin/python benchmarks/announce_latency.py               # --announces 50 --poll-announces 20

A real `decentrl orchestrator` process on loopback (the CLI's uvloop, its journal committing each
announcement with a full fsync before it answers) and a file:// store holding every version (one
small file each: the orchestrator reads only a version's manifest before it takes the
announcement). The trainer's side is `OrchestratorClient.announce`; the worker's side is
workers/versions.py `watch_versions`, the loop a worker's `versions` thread runs. A latency runs
from just before the announcement is sent to the moment the watch hands the version on (one
clock: both sides live in this process). `long_poll`: GET /v1/version, one long-poll outstanding
(the worker now); `poll`: GET /v1/info every `version_poll_s` = 2 s (the worker before it, and
its fallback against an orchestrator without the route). Each announcement waits a random time
after the one before was heard: `gap_s` plus up to `gap_s` more with the long-poll, plus up to a
poll period with the poll (a fixed gap would meet the poll in the same phase every time).

`announce_latencies` is the measurement; benchmarks/spread.py calls it with clients across a
shaped link. The last line of stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from decentrl.api.client import OrchestratorClient  # noqa: E402
from workers.versions import watch_versions  # noqa: E402

WORKER_TOKEN, TRAINER_TOKEN = "announce-bench-worker", "announce-bench-trainer"


def announce_latencies(
    worker: OrchestratorClient, announce: Callable[[int], object], versions: Sequence[int], *,
    prepare: Callable[[int], object] | None = None, gap_s: float = 0.2, long_poll: bool = True,
    wait_s: float = 30.0, retry_s: float = 2.0, timeout_s: float = 60.0, seed: int = 0,
) -> list[float]:
    """Seconds from each announcement of `versions` (ascending, each newer than the run's newest)
    to the worker's watch hearing of it, in order. `announce(v)` sends one announcement (timed);
    `prepare(v)`, if given, runs before the clock starts (publishing v to the store). The watch
    (`watch_versions` over `worker`, long-polls of `wait_s` or, with `long_poll` False, /v1/info
    every `retry_s`) starts from the run's current version and stops before this returns."""
    heard: dict[int, float] = {}
    changed = threading.Condition()
    newest: list[int | None] = [worker.info().policy_version]

    def note(version: int | None) -> None:
        now = time.monotonic()
        with changed:
            if version is not None and (newest[0] is None or version > newest[0]):
                newest[0] = version
                heard.setdefault(version, now)
                changed.notify_all()

    stop = threading.Event()
    watch = threading.Thread(
        target=watch_versions, name="announce-bench-watch", daemon=True,
        kwargs={"client": worker, "known": lambda: newest[0], "heard": note, "stop": stop,
                "wait_s": wait_s, "retry_s": retry_s, "long_poll": long_poll},
    )
    watch.start()
    jitter = random.Random(seed)
    latencies = []
    try:
        for version in versions:
            if prepare is not None:
                prepare(version)
            time.sleep(gap_s + jitter.random() * (gap_s if long_poll else retry_s))  # the watch has asked again by now
            sent = time.monotonic()
            announce(version)
            with changed:
                if not changed.wait_for(lambda v=version: v in heard or not watch.is_alive(), timeout=timeout_s):
                    raise TimeoutError(f"version {version} was not heard of within {timeout_s:g} s of its announcement")
            if version not in heard:
                raise RuntimeError("the version watch ended; see its log")
            latencies.append(heard[version] - sent)
    finally:
        stop.set()
    return latencies


def summary(latencies: Sequence[float]) -> dict[str, Any]:
    ordered = sorted(latencies)

    def at(q: float) -> float:
        return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 6)

    return {"n": len(ordered), "p50_s": round(statistics.median(ordered), 6), "p99_s": at(0.99),
            "max_s": round(ordered[-1], 6), "mean_s": round(statistics.fmean(ordered), 6)}


def start_orchestrator(tmp: str) -> tuple[subprocess.Popen[bytes], str, str]:
    """`decentrl orchestrator` on a free loopback port over a file:// store: (process, URL, store URL)."""
    from decentrl.cli.launch import free_port

    store_url = f"file://{tmp}/store"
    config = Path(tmp) / "run.toml"
    config.write_text(
        'run_name = "announce-bench"\ngroup_size = 2\ntrainer_ranks = 1\n'
        '[model]\ntype = "tiny"\nhidden_size = 32\nnum_layers = 1\nnum_heads = 2\nintermediate_size = 64\n'
        f'[store]\nurl = "{store_url}"\n[trainer]\nsteps = 1000\n'
    )
    (Path(tmp) / "tokens.json").write_text(json.dumps({"tokens": [
        {"name": "worker", "role": "worker", "token": WORKER_TOKEN},
        {"name": "trainer", "role": "trainer", "token": TRAINER_TOKEN},
    ]}))
    port = free_port()
    log = open(Path(tmp) / "orchestrator.log", "ab")
    process = subprocess.Popen(
        [sys.executable, "-m", "decentrl", "orchestrator", str(config), "--run-dir", tmp, "--port", str(port)],
        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=ROOT,
    )
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 120
    while True:
        try:
            with urllib.request.urlopen(f"{url}/healthz", timeout=1) as response:
                if response.status == 200:
                    return process, url, store_url
        except OSError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the orchestrator did not start: {(Path(tmp) / 'orchestrator.log').read_text()[-2000:]}")
        time.sleep(0.2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--announces", type=int, default=50, help="Announcements timed with the long-poll.")
    parser.add_argument("--poll-announces", type=int, default=20, help="Announcements timed with the 2 s /v1/info poll (0: none).")
    parser.add_argument("--gap-s", type=float, default=0.2)
    args = parser.parse_args()

    from decentrl.store.checkpoints import CheckpointStore

    with tempfile.TemporaryDirectory(prefix="announce-bench-") as tmp:
        files = Path(tmp) / "version-files"
        files.mkdir()
        (files / "config.json").write_text("{}")
        process, url, store_url = start_orchestrator(tmp)
        try:
            store = CheckpointStore(store_url)
            trainer, worker = OrchestratorClient(url, TRAINER_TOKEN), OrchestratorClient(url, WORKER_TOKEN)

            def publish(version: int) -> None:
                store.publish(version, str(files), parent=version - 1 if version else None)

            def announce(version: int) -> None:
                trainer.announce(version)

            publish(0)
            announce(0)
            results: dict[str, Any] = {"announces": args.announces, "gap_s": args.gap_s}
            first = 1
            long_poll = announce_latencies(worker, announce, range(first, first + args.announces), prepare=publish, gap_s=args.gap_s)
            results["long_poll"] = summary(long_poll)
            first += args.announces
            if args.poll_announces:
                poll = announce_latencies(worker, announce, range(first, first + args.poll_announces), prepare=publish,
                                          gap_s=args.gap_s, long_poll=False, retry_s=2.0)
                results["poll_2s"] = summary(poll)
            results["load_average"] = [round(x, 2) for x in os.getloadavg()]
        finally:
            process.terminate()
            process.wait(timeout=30)
    for name in ("long_poll", "poll_2s"):
        if name in results:
            print(f"{name:10s} " + "  ".join(f"{k} {v}" for k, v in results[name].items()))
    print(json.dumps(results))


if __name__ == "__main__":
    main()
