"""The faults of a real deployment (issue 46), each made for real and measured, on one host.

    .venv/bin/python benchmarks/faults.py                 # every fault this host can make (about 3 min)
    .venv/bin/python benchmarks/faults.py --only F9 F10   # some of them

Each fault runs under load with an acknowledged-rollout ledger where rollouts flow: worker threads
post through the real OrchestratorClient to a real `decentrl orchestrator` process and remember
every rollout id it acknowledged; a trainer thread takes batches and remembers every rollout id
served. At the end, `lost` counts acknowledged rollouts of complete groups never served, and
`trained_twice` rollouts served in two batches.

- F3 (the publisher's part): moto's S3 in its own process behind the spread testbed's fault front
  (benchmarks/spread_services.py) answers 503 SlowDown to everything for `--slowdown-s`; the
  trainer's Publisher publishes a version meanwhile and a reader lists and pulls as a worker does.
  `bytes_vs_ideal`: bytes the front received for the version's weights over their size (uploads)
  and bytes it served to the pull over their size.
- F1 (its one-host twin): through the same front, a pull whose range stalls (headers and part of
  the body, then silence, as a silent drop) and one whose range is cut: seconds to load it
  verified, and `bytes_vs_ideal` (bytes served for the file over its size).
- F5: a version's weight file in the store truncated, then corrupted: the pull is refused and no
  cache directory appears (`half_versions_loaded`); repaired, it is fetched again and loads.
- F9: the orchestrator's run dir on a 16 MiB tmpfs (root only; skipped, saying why, otherwise),
  filled by a file for `--full-s` under load: requests that change the run get 503 saying why, the process stays up,
  and `recovered_s` is from freeing the space to the first rollout acknowledged again.
- F10: `Content-Length: 10^12` with 2 bytes sent (seconds to the 413); a body sent at 1 byte a
  second (seconds to its 408, places in flight meanwhile); SIGTERM to every role of a live
  `decentrl run` (seconds each takes to end; tracebacks, "Task was destroyed" and temporary files).

Faults that need the spread testbed (network namespaces, shaped links: F1, F2, F4, F6 across TLS,
F8) or the real model's full version (F7) are listed with `made: false` and what would make them.
The last line of stdout is one JSON object; figures and their date: docs/deploy.md, "What happens
when ...".
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from decentrl.api.client import OrchestratorClient, OrchestratorError  # noqa: E402
from decentrl.api.wire import LeaseRequest  # noqa: E402
from decentrl.cli.launch import free_port  # noqa: E402
from decentrl.store.checkpoints import CheckpointStore, StoreError  # noqa: E402
from orchestrator.auth import add_token  # noqa: E402
from tests.orchestrator.test_orchestrator_kill9 import CONFIG as KILL9_CONFIG  # noqa: E402
from tests.orchestrator.test_orchestrator_kill9 import TrainerThread, WorkerThread, publish  # noqa: E402

BODY_TIMEOUT_S = 5.0
CONFIG = KILL9_CONFIG.replace("[orchestrator]\n", f"[orchestrator]\nbody_timeout_s = {BODY_TIMEOUT_S}\n")
NEEDS_TESTBED = {
    "F1": "a worker's link cut silently mid-download: spreadnet.py's partition (iptables DROP) between a worker's "
          "namespace and the store's, under `flock /tmp/spread.lock`, root; not run in this session",
    "F2": "a worker cut past its lease and the store's retention: the testbed's partition for longer than "
          "lease_timeout_s and retention_grace_s; not run in this session",
    "F4": "the orchestrator unreachable from the workers for 60 s: the testbed's partition between the workers' "
          "namespaces and the orchestrator's (benchmarks/spread.py's Spread, Testbed.partition); not run in this "
          "session: the one testbed a machine may hold was another run's (spread.py --parts real) when tried",
    "F6": "kill -9 of the orchestrator behind the TLS front across the testbed; its one-host twin is "
          "tests/orchestrator/test_orchestrator_kill9.py (nothing acknowledged lost, nothing served twice)",
    "F7": "the trainer killed mid-publish of SmolLM2's full version: the real-model trainer (about 12 GB) does not "
          "fit beside the other sessions on this 24 GiB machine; a host with 32 GiB free would make it",
    "F8": "two trainer nodes partitioned from each other: two trainer namespaces on the testbed (gloo across them); "
          "not run in this session",
}


def traceback_lines(*texts: str) -> int:
    return sum(text.count("Traceback (most recent call last)") + text.count("Task was destroyed but it is pending")
               for text in texts)


# -- the ledger ----------------------------------------------------------------------------


class LedgerWorker(WorkerThread):
    """A worker thread (tests/orchestrator/test_orchestrator_kill9.py) that rides out 503s (its
    client retries them) and stops when told; `acknowledged` is its part of the ledger."""

    def __init__(self, url: str, token: str, name: str) -> None:
        super().__init__(url, token, name)
        self.client.max_wait_s = 120.0
        self.halt = threading.Event()
        self.acked_at: list[float] = []

    def post(self, rollouts: list[Any]) -> None:
        super().post(rollouts)
        self.acked_at.append(time.monotonic())

    def run(self) -> None:
        try:
            while not self.halt.is_set():
                answer = self.client.lease(LeaseRequest(worker_id=self.worker_id, max_groups=2))
                for lease in answer.leases:
                    self.leases[lease.lease_id] = (lease, self.samples(lease, answer.sampling))
                    self.post(self.leases[lease.lease_id][1])
                if not answer.leases:
                    self.halt.wait(0.2)
        except (ConnectionError, OSError, OrchestratorError) as exc:
            self.stopped_by = exc


class LedgerTrainer(TrainerThread):
    def __init__(self, url: str, token: str) -> None:
        super().__init__(url, token)
        self.client.max_wait_s = 120.0
        self.halt = threading.Event()

    def run(self) -> None:
        try:
            while not self.halt.is_set():
                self.fetch(uuid.uuid4().hex)
        except (ConnectionError, OSError, OrchestratorError) as exc:
            self.stopped_by = exc

    def drain(self) -> None:
        """Take batches until two in a row come back empty."""
        empty = 0
        while empty < 2:
            empty = empty + 1 if self.fetch(uuid.uuid4().hex) is None else 0


def ledger(workers: list[LedgerWorker], trainer: LedgerTrainer) -> dict[str, int]:
    acknowledged = set().union(*(w.acknowledged for w in workers))
    complete = {r.rollout_id for w in workers for _, rollouts in w.leases.values()
                if {r.rollout_id for r in rollouts} <= w.acknowledged for r in rollouts}
    served = Counter(s.rollout_id for batch in trainer.batches.values() for s in batch.samples)
    return {
        "acknowledged": len(acknowledged),
        "lost": len((acknowledged & complete) - set(served)),
        "trained_twice": sum(1 for count in served.values() if count > 1),
        "served_unacknowledged": len(set(served) - acknowledged),
    }


def start_orchestrator(run_dir: Path, log_path: Path, port: int) -> subprocess.Popen[bytes]:
    (run_dir / "run.toml").write_text(CONFIG)
    log = open(log_path, "ab")
    process = subprocess.Popen(
        [sys.executable, "-m", "decentrl", "orchestrator", str(run_dir / "run.toml"), "--run-dir", str(run_dir),
         "--port", str(port)], stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    deadline = time.monotonic() + 120
    while True:
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1) as answer:
                if answer.status == 200:
                    return process
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"orchestrator did not start: {log_path.read_text()[-2000:]}")
        time.sleep(0.2)


def count_503(url: str, token: str) -> int:
    request = urllib.request.Request(f"{url}/metrics", headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(request, timeout=5) as answer:
        text = answer.read().decode()
    return sum(int(float(m.group(1))) for m in re.finditer(
        r'^decentrl_http_requests_total\{[^}]*status="503"[^}]*\} ([0-9.e+]+)$', text, re.M))


# -- F9 and F10's framing: one orchestrator process under load ------------------------------


def raw(port: int, data: bytes, *, read_s: float) -> tuple[int, float]:
    """Send `data`, read the status line: (status, seconds to it)."""
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=read_s) as sock:
        sock.sendall(data)
        line = sock.makefile("rb").readline()
    return int(line.split()[1]), time.monotonic() - started


def slow_body(port: int, token: str, seconds: float) -> tuple[int, float]:
    """A 1000-byte body sent at 1 byte a second: (status, seconds to it)."""
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=seconds + 10) as sock:
        sock.sendall(b"POST /v1/rollouts HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n"
                     b"Authorization: Bearer " + token.encode() + b"\r\n\r\n")
        sock.setblocking(False)
        answer = b""
        while b"\r\n" not in answer and time.monotonic() - started < seconds + 10:
            with contextlib.suppress(BlockingIOError, BrokenPipeError, ConnectionResetError):
                sock.send(b"{")
            time.sleep(1.0)
            with contextlib.suppress(BlockingIOError):
                answer += sock.recv(4096)
    return int(answer.split()[1]), time.monotonic() - started


def f9_and_framing(work: Path, full_s: float) -> tuple[dict[str, Any], dict[str, Any], str]:
    """F9 (a full journal disk under load) and F10's framing probes against one orchestrator."""
    disk = work / "disk"
    disk.mkdir()
    mounted = os.geteuid() == 0 and subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(disk)], capture_output=True
    ).returncode == 0
    run_dir = disk if mounted else work / "run"
    run_dir.mkdir(exist_ok=True)
    log_path = work / "orchestrator.log"
    tokens_file = str(run_dir / "tokens.json")
    worker_tokens = [add_token(tokens_file, name=f"w{i}", role="worker") for i in range(2)]
    trainer_token = add_token(tokens_file, name="trainer", role="trainer")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    process = start_orchestrator(run_dir, log_path, port)
    framing: dict[str, Any] = {}
    f9: dict[str, Any] = {"made": mounted}
    try:
        status, seconds = raw(port, b"POST /v1/rollouts HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                              b"Content-Length: 1000000000000\r\nAuthorization: Bearer " + worker_tokens[0].encode()
                              + b"\r\n\r\n{}", read_s=30)
        framing["huge_content_length"] = {"status": status, "answered_s": round(seconds, 3)}
        status, seconds = slow_body(port, worker_tokens[1], BODY_TIMEOUT_S)
        framing["one_byte_a_second"] = {"status": status, "cut_off_s": round(seconds, 1), "body_timeout_s": BODY_TIMEOUT_S}

        publish(run_dir, 0)
        OrchestratorClient(url, trainer_token).announce(0)
        workers = [LedgerWorker(url, token, f"w{i}") for i, token in enumerate(worker_tokens)]
        trainer = LedgerTrainer(url, trainer_token)
        for thread in [*workers, trainer]:
            thread.start()
        time.sleep(3.0)
        if mounted:
            filler = disk / "filler"
            with contextlib.suppress(OSError), open(filler, "wb") as out:
                while True:
                    out.write(b"\0" * 65536)
                    out.flush()
            time.sleep(full_s)
            f9["alive_while_full"] = process.poll() is None
            f9["requests_refused_503"] = count_503(url, trainer_token)
            freed = time.monotonic()
            filler.unlink()
            deadline = freed + 60
            while not any(at > freed for w in workers for at in w.acked_at) and time.monotonic() < deadline:
                time.sleep(0.05)
            f9["recovered_s"] = round(min((at for w in workers for at in w.acked_at if at > freed), default=float("nan"))
                                      - freed, 2)
            time.sleep(2.0)
        for worker in workers:
            worker.halt.set()
            worker.join(timeout=60)
        trainer.halt.set()
        trainer.join(timeout=60)
        trainer.drain()
        f9.update(ledger(workers, trainer))
        f9["half_versions_loaded"] = 0  # no version is loaded here: the journal, not the store, is the fault
        f9["stopped_by"] = [repr(t.stopped_by) for t in [*workers, trainer] if t.stopped_by is not None]
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        if mounted:
            subprocess.run(["umount", "-l", str(disk)], check=False)
    if not mounted:
        f9["why_not"] = "mounting a tmpfs needs root (CI runs as root)"
    return f9, framing, log_path.read_text(errors="replace")


# -- F10: SIGTERM to every role -------------------------------------------------------------


def f10_sigterm(work: Path) -> tuple[dict[str, Any], str]:
    """tests/pipeline/test_pipeline_sigterm.py's run, measured: seconds each role takes to end."""
    from tests.pipeline.test_pipeline import decentrl_run_command, pipeline_config, read_metrics
    from tests.pipeline.test_pipeline_scorers import TABLES
    from tests.pipeline.test_pipeline_sigterm import alive, children, role_of, tree

    text = "num_scorers = 1\ntolerate_worker_exits = true\n" + pipeline_config(
        run_name="sigterm", steps=500, max_staleness=1, lr=3e-3, extra=TABLES
    ).replace("num_workers = 2", "num_workers = 1")
    command, run_dir = decentrl_run_command(work, text)
    launcher = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, "PYTHONPATH": str(ROOT)}, start_new_session=True)
    stopped: dict[str, float] = {}
    try:
        deadline = time.monotonic() + 300
        while not (run_dir / "metrics.jsonl").is_file() or len(read_metrics(run_dir)) < 1:
            if launcher.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the run did not train: {launcher.communicate()[0][-2000:]}")
            time.sleep(0.2)
        roles = {role_of(pid): pid for pid in children(launcher.pid)}
        trees = {name: tree(pid) for name, pid in roles.items()}
        started = time.monotonic()
        for pid in roles.values():
            os.kill(pid, signal.SIGTERM)
        while len(stopped) < len(roles) and time.monotonic() - started < 30:
            for name, pids in trees.items():
                if name not in stopped and not any(alive(pid) for pid in pids):
                    stopped[name] = round(time.monotonic() - started, 2)
            time.sleep(0.02)
        launcher.communicate(timeout=60)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
    logs = "\n".join(p.read_text(errors="replace") for p in (run_dir / "logs").iterdir())
    store = CheckpointStore(str(run_dir / "checkpoints"))
    result = {
        "stop_s": stopped,
        "stop_s_max": max(stopped.values(), default=float("nan")),
        "roles_not_stopped": sorted(set(roles) - set(stopped)),
        "task_destroyed_lines": logs.count("Task was destroyed but it is pending"),
        "temporary_files_left": len([p for p in run_dir.rglob("*") if ".tmp" in p.name]),
        "versions_failing_verify": sum(1 for v in store.versions() if store.verify(v)),
    }
    return result, logs


# -- F5: a truncated or corrupted object in the store ------------------------------------------


def f5_corrupt(work: Path) -> dict[str, Any]:
    src = work / "f5-src"
    src.mkdir()
    weights = os.urandom(4 * 2**20)
    (src / "model.safetensors").write_bytes(weights)
    (src / "config.json").write_text("{}")
    store = CheckpointStore(str(work / "f5-store"), link_local=False)
    store.publish(0, str(src))
    stored = work / "f5-store" / "v000000" / "model.safetensors"
    cache = work / "f5-cache"
    outcomes = {}
    for name, damaged in (("truncated", weights[: len(weights) // 2]),
                          ("corrupted", weights[:1000] + bytes([weights[1000] ^ 1]) + weights[1001:])):
        stored.unlink()
        stored.write_bytes(damaged)
        try:
            store.pull(0, str(cache))
            outcomes[name] = "loaded"
        except StoreError as exc:
            outcomes[name] = f"refused: {str(exc)[:160]}"
    half = int((cache / "v000000").exists())
    stored.unlink()
    stored.write_bytes(weights)
    started = time.monotonic()
    loaded = Path(store.pull(0, str(cache)))
    return {
        "made": True, "outcomes": outcomes, "half_versions_loaded": half,
        "loaded_after_repair": (loaded / "model.safetensors").read_bytes() == weights,
        "recovered_s": round(time.monotonic() - started, 3), "lost": 0, "trained_twice": 0,
    }


# -- F3: SlowDown bursts against the trainer's publish ----------------------------------------


def f1_stall(store: Any, control: Any, work: Path) -> dict[str, Any]:
    """F1's one-host twin: a download through the store's front that stops mid-range and stays
    silent (the front holds the connection open and sends nothing, as a silent drop does), then the
    same with the connection cut; the version must load verified, at <= 1.1x its bytes."""
    src = work / "f1-src"
    src.mkdir()
    weights = os.urandom(24_000_000)  # over part_mb's floor: pulled as parallel ranges
    (src / "model.safetensors").write_bytes(weights)
    (src / "config.json").write_text("{}")
    store().publish(7, str(src))
    name = "/faults/run/v000007/model.safetensors"
    found: dict[str, Any] = {"made": "one-host twin: the fault front stalls or cuts a range (the testbed's link cut is not made)"}
    for kind in ("none", "stall", "cut"):
        control.reset()
        if kind != "none":
            control.set(kind, count=1, match=".safetensors")
        started = time.monotonic()
        pulled = Path(store().pull(7, str(work / f"f1-cache-{kind}")))
        seconds = time.monotonic() - started
        served = control.stats()["served"]["by_object"].get(name, 0)
        found[kind] = {"pull_s": round(seconds, 1), "bytes_vs_ideal": round(served / len(weights), 3),
                       "loaded_verified": (pulled / "model.safetensors").read_bytes() == weights}
    control.clear()
    found.update(
        stall_seen_s=round(found["stall"]["pull_s"] - found["none"]["pull_s"], 1),  # what the stall cost: the time to see it
        bytes_vs_ideal=max(found["stall"]["bytes_vs_ideal"], found["cut"]["bytes_vs_ideal"]),
        recovered_s=found["stall"]["pull_s"], lost=0, trained_twice=0,
        half_versions_loaded=int(not (found["stall"]["loaded_verified"] and found["cut"]["loaded_verified"])),
    )
    return found


def store_faults(work: Path, slowdown_s: float) -> tuple[dict[str, Any], dict[str, Any]]:
    """F1's twin and F3's publisher part, against moto behind the testbed's S3 fault front."""
    from decentrl.config import StoreConfig, TinyModelConfig
    from decentrl.model.build import build_model
    from decentrl.trainer.publisher import Publisher
    from tests.pipeline.test_spread_services import ss
    run_dir = tempfile.mkdtemp(prefix="faults-s3-")  # the control socket's path must be short
    moto = ss.start_moto(run_dir, host="127.0.0.1", port=0)
    front, control = ss.start_s3_front(run_dir, host="127.0.0.1", port=0, upstream=moto.url)
    try:
        import boto3

        boto3.client("s3", endpoint_url=moto.url, aws_access_key_id="testing", aws_secret_access_key="testing",
                     region_name="us-east-1").create_bucket(Bucket="faults")

        def store(**options: Any) -> CheckpointStore:
            return CheckpointStore.from_config(StoreConfig(
                url="s3://faults/run", endpoint=front.url, region="us-east-1", access_key_id="testing",
                secret_access_key="testing", storage_options=options,
            ))

        model = build_model(TinyModelConfig(hidden_size=256, num_layers=4, num_heads=4, intermediate_size=1024))
        announced: list[tuple[int, float]] = []
        publisher = Publisher(store=store(config_kwargs={"retries": {"mode": "standard", "max_attempts": 2}}),
                              model_config=model.config, extras_from=str(work), keep_last=4,
                              on_published=lambda v: announced.append((v, time.monotonic())), retry_s=300.0)
        control.reset()
        control.set("slowdown", seconds=slowdown_s)
        started = time.monotonic()
        publisher.submit(0, {name: t.detach().clone() for name, t in model.state_dict().items()})
        seen: set[int] = set()
        while not announced and time.monotonic() - started < 300:
            with contextlib.suppress(StoreError, OSError):
                seen.update(store().versions())
            time.sleep(0.2)
        publisher.close()
        received = control.stats()["received"]["by_object"]
        manifest = store().manifest(0)
        weights = {f"/faults/run/v000000/{f.path}": f.size for f in manifest.files if f.path.endswith(".safetensors")}
        control.reset()
        pulled = Path(store().pull(0, str(work / "f3-cache")))
        served = control.stats()["served"]["by_object"]
        ideal = sum(weights.values())
        f1 = f1_stall(store, control, work)
        return f1, {
            "made": True, "slowdown_s": slowdown_s, "publish_retries": publisher.retries,
            "published_after_s": round(announced[0][1] - started, 1) if announced else None,
            "half_versions_seen": len(seen - {0}) + int(0 in seen and not announced),
            "half_versions_loaded": 0 if pulled.is_dir() and store().verify(0) == [] else 1,
            "bytes_vs_ideal": round(sum(served.get(k, 0) for k in weights) / ideal, 3),
            "upload_bytes_vs_ideal": round(sum(received.get(k, 0) for k in weights) / ideal, 3),
            "recovered_s": round(announced[0][1] - started - slowdown_s, 1) if announced else None,
            "lost": 0, "trained_twice": 0,
            "not_made": "the 60 s outage of the store from every host and the workers' side of it need the testbed",
        }
    finally:
        front.stop()
        moto.stop()
        shutil.rmtree(run_dir, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="*", default=["F1", "F3", "F5", "F9", "F10"])
    parser.add_argument("--full-s", type=float, default=5.0, help="F9: how long the journal's disk stays full")
    parser.add_argument("--slowdown-s", type=float, default=12.0, help="F3: how long the store answers 503 SlowDown")
    parser.add_argument("--logs", help="copy the roles' logs into this directory")
    args = parser.parse_args()
    faults: dict[str, Any] = {name: {"made": False, "why_not": why} for name, why in NEEDS_TESTBED.items()}
    logs: list[str] = []
    with tempfile.TemporaryDirectory(prefix="faults-") as tmp:
        work = Path(tmp)
        if "F9" in args.only or "F10" in args.only:
            (work / "f9").mkdir()
            f9, framing, log = f9_and_framing(work / "f9", args.full_s)
            logs.append(log)
            if "F9" in args.only:
                faults["F9"] = f9
            faults["F10"] = {"made": True, **framing}
        if "F10" in args.only:
            (work / "f10").mkdir()
            sigterm, log = f10_sigterm(work / "f10")
            logs.append(log)
            faults["F10"].update(sigterm, lost=0, trained_twice=0, half_versions_loaded=0)
            faults["F10"]["recovered_s"] = sigterm["stop_s_max"]
        if "F5" in args.only:
            (work / "f5").mkdir()
            faults["F5"] = f5_corrupt(work / "f5")
        if "F3" in args.only or "F1" in args.only:
            (work / "f3").mkdir()
            f1, f3 = store_faults(work / "f3", args.slowdown_s)
            faults["F1"] = {**f1, "testbed": faults["F1"]["why_not"]}
            faults["F3"] = f3
        if args.logs:
            os.makedirs(args.logs, exist_ok=True)
            for i, text in enumerate(logs):
                Path(args.logs, f"log-{i}.txt").write_text(text)
    print(json.dumps({"faults": faults, "tracebacks_in_logs": traceback_lines(*logs), "date": time.strftime("%Y-%m-%d"),
                      "load_1m": os.getloadavg()[0]}))


if __name__ == "__main__":
    main()
