"""The faults of a real deployment (issue 46), each made for real and measured: on one host, and
across the spread testbed (benchmarks/spread.py: namespaces, shaped links, nginx's TLS front, moto's
S3 behind a fault front, a two-node trainer).

    .venv/bin/python benchmarks/faults.py                              # one host: F3 F5 F9 F10 (about 3 min; root for F9 tmpfs)
    sudo flock /tmp/spread.lock .venv/bin/python benchmarks/faults.py --only F1 F4 F6   # the testbed (about 7 min)
    ... --only F2 (about 4 min), --only F8 (about 7 min); --merge A.json B.json: keep the faults of earlier runs
    .venv/bin/python benchmarks/faults.py --only F7                    # the real model's trainer killed mid-publish (about 8 min, 12 GB)

One host. Worker threads post through the real OrchestratorClient to a real `decentrl orchestrator`
process and remember every rollout id it acknowledged; a trainer thread takes batches and remembers
every rollout id served. `lost` counts acknowledged rollouts of complete groups never served, and
`trained_twice` rollouts served in two batches.

- F3 (the publisher's part): moto's S3 in its own process behind the testbed's fault front
  (benchmarks/spread_services.py) answers 503 SlowDown to everything for `--slowdown-s`; the
  trainer's Publisher publishes a version meanwhile and a reader lists and pulls as a worker does.
  `bytes_vs_ideal`: bytes the front received for the version's weights over their size (uploads)
  and bytes it served to the pull over their size. With it, F1's one-host twin (`one_host_twin`):
  a pull whose range stalls (headers and part of the body, then silence) and one whose range is cut.
- F5: a version's weight file in the store truncated, then corrupted: the pull is refused and no
  cache directory appears (`half_versions_loaded`); repaired, it is fetched again and loads.
- F9: the orchestrator's run dir on a 16 MiB tmpfs (root only; skipped, saying why, otherwise),
  filled by a file for `--full-s` under load: requests that change the run get 503 saying why, the process stays up,
  and `recovered_s` is from freeing the space to the first rollout acknowledged again.
- F10: `Content-Length: 10^12` with 2 bytes sent (seconds to the 413); a body sent at 1 byte a
  second (seconds to its 408, places in flight meanwhile); SIGTERM to every role of a live
  `decentrl run` (seconds each takes to end; tracebacks, "Task was destroyed" and temporary files).

The testbed (root, `flock /tmp/spread.lock`: one testbed a machine). The CPU demo (configs/local.toml)
runs across it with its workers on L1 and L2 (F2: two on L1); a fault is made under load (after
`--warm-steps` trainer steps), by spreadnet's partitions (iptables DROP: silent, no reset). The
ledger (`journal_ledger`) comes from the orchestrator's own journal, which commits every rollout
before its answer and, with TESTBED_OVERRIDES, keeps every batch under the trainer's request id
"step-N": `lost` = rollouts of completed groups passed over (still complete while a later group
was served, or ready in the journal but not in memory at the end) plus rollouts a worker counted as
acknowledged that the journal lacks; `trained_twice` = rollouts of groups in two batches of different
steps.

- F1: a worker's host (L2) partitioned from the store's for `--link-cut-s` once the front has
  served `--cut-at` of a 24 MiB version: the worker's pull (CheckpointStore.pull, retried as its
  swapper does) in that namespace: the stall seen, the bytes the front served, the bytes loaded.
- F2: one of two L1 workers isolated from every host for `--f2-cut-s`, past its leases and the
  store's retention of what it held: what its spooled rollouts got, the version it loaded, when it posted.
- F4: both workers' hosts partitioned from the orchestrator's for `--cut-s` (leases of `--f4-lease-s`):
  the first rollout acknowledged after the heal, the trainer's wait and resumption.
- F6: kill -9 of the orchestrator behind nginx, restarted on the same run dir `--down-s` later.
- F8: the trainer nodes' interconnect cut (`--peer-timeout-s`): each node's stop and its error,
  the workers meanwhile; healed and started again, the resumption and the versions published.

F7 (one host, `--only F7`): configs/smollm2.toml (the real model; `--f7-config configs/local.toml`
for the tiny one) reduced to 5 steps of 2 groups, a checkpoint every 2 steps and a key version at
4 (store.full_every 3), as `decentrl run` starts its roles, the store moto's S3 behind the fault
front on loopback; the trainer's process group killed (-9) while the front has received part of the
key version's weights and no manifest, the same command started again: its resume (checkpoint,
replay, replay difference), the versions' manifests before and after (no gap, none written twice),
the worker's loads and cache (each version verified against the store's manifest), the ledger from
the journal as on the testbed, and the times from the kill to the next version published.

The last line of stdout is one JSON object; each fault says when it was measured and the load;
docs/deploy.md, "What happens when ...", has the figures.
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
NEEDS_TESTBED = {  # made here only by their own runs (--only F1 F2 F4 F6 F8, root) or not at all (F7)
    "F1": "the spread testbed: `--only F1` (root, flock /tmp/spread.lock)",
    "F2": "the spread testbed: `--only F2` (root, flock /tmp/spread.lock)",
    "F4": "the spread testbed: `--only F4` (root, flock /tmp/spread.lock)",
    "F6": "the spread testbed: `--only F6` (root, flock /tmp/spread.lock)",
    "F7": "the real model's trainer (about 12 GB, configs/smollm2.toml): `--only F7` (about 7 min on 2 cores; "
          "`--f7-config configs/local.toml`: the same with the tiny model, about 3 min)",
    "F8": "the spread testbed: `--only F8` (root, flock /tmp/spread.lock)",
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
    found: dict[str, Any] = {"made": "one-host twin: the fault front stalls or cuts a range"}
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
        problems = store().verify(0)  # the version as stored, every byte against its manifest
        f1 = f1_stall(store, control, work)
        return f1, {
            "made": True, "slowdown_s": slowdown_s, "publish_retries": publisher.retries,
            "published_after_s": round(announced[0][1] - started, 1) if announced else None,
            "half_versions_seen": len(seen - {0}) + int(0 in seen and not announced),
            "half_versions_loaded": 0 if pulled.is_dir() and problems == [] else 1, "verify_problems": problems,
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


# -- F7: the trainer killed mid-publish of a key version (one host: moto behind the fault front) ------


F7_LOADED = re.compile(r"^(\S+ \S+) worker INFO decentrl\.worker: loaded version (\d+):")
F7_PUBLISHED = re.compile(r"^(\S+ \S+) .*published version (\d+) in ")


def _log_times(pattern: re.Pattern[str], text: str) -> list[tuple[float, int]]:
    spread, _ = load_spread()

    return [(spread.log_time(m[1]), int(m[2])) for m in map(pattern.match, text.splitlines()) if m]


def f7_trainer_kill_mid_publish(work: Path, args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    """F7: `args.f7_config` (configs/smollm2.toml: the real model) run as `decentrl run` starts it
    (orchestrator, one trainer, one worker) on one host, its store moto's S3 in its own process
    behind the testbed's fault front on loopback. Key version K = 1 + `--f7-full-every` (version 1 is
    whole, then full_every - 1 deltas, then a key version stored whole and as deltas); checkpoints
    every `--f7-checkpoint-every` steps (the one at K waits for K's publish: the restart resumes from
    an earlier one and replays). While the front has received part of K's weights and K's manifest
    is not written, kill -9 of the trainer's process group and every process below it (torchrun runs
    its ranks in sessions of their own); `--f7-down-s` later, the same trainer command again. The
    front holds K's first weight upload at `--f7-kill-at` of the file (a stall: it stops reading), so
    the kill lands mid-upload whatever the upload's speed; the kill comes at the first of the stall
    or that share received."""
    import boto3

    spread, _ = load_spread()
    from decentrl.cli import launch
    from decentrl.config import load_config
    from tests.pipeline.test_spread_services import ss

    key = 1 + args.f7_full_every
    short = tempfile.mkdtemp(prefix="faults-f7-")  # the control socket's path must be short
    moto = ss.start_moto(short, host="127.0.0.1", port=0)
    front, control = ss.start_s3_front(short, host="127.0.0.1", port=0, upstream=moto.url)
    creds = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}
    roles: list[Any] = []
    try:
        boto3.client("s3", endpoint_url=moto.url, aws_access_key_id="testing", aws_secret_access_key="testing",
                     region_name="us-east-1").create_bucket(Bucket="faults")
        config = load_config(str(ROOT / args.f7_config), [
            f"trainer.steps={args.f7_steps}", f"trainer.groups_per_step={args.f7_groups_per_step}",
            f"trainer.checkpoint_every={args.f7_checkpoint_every}", f"store.full_every={args.f7_full_every}",
            "store.retention_grace_s=86400",  # every version stays: the check reads each one's manifest at the end
            f"store.parallel_reads={args.f7_parallel_reads}",
            "num_workers=1", *TESTBED_OVERRIDES])
        store_config = config.store.model_copy(update={"url": "s3://faults/f7", "endpoint": front.url, "region": "us-east-1"})
        port = free_port()
        config = config.model_copy(update={"store": store_config, "run_name": "f7",
                                           "orchestrator": config.orchestrator.model_copy(update={"port": port})})
        run_dir = work / "f7"
        (run_dir / "logs").mkdir(parents=True)
        config_path = run_dir / "config.json"
        config_path.write_text(config.model_dump_json(indent=2))
        tokens = {name: add_token(str(run_dir / "tokens.json"), name=name, role="trainer" if name == "trainer" else "worker")
                  for name in ("trainer", "worker-0")}
        run = spread.SpreadRun(run_dir, config, config_path, tokens, store_config.url)
        url = f"http://127.0.0.1:{port}"
        env = {**creds, "PYTHONPATH": str(ROOT)}
        roles.append(launch._start("orchestrator", launch.orchestrator_command(config_path, run_dir), run_dir, env))
        roles.append(launch._start("monitor", [sys.executable, spread.SCRIPT, "monitor", url, tokens["trainer"],
                                               str(run_dir / "monitor.jsonl")], run_dir, env))
        deadline = time.monotonic() + 120
        while not run.statuses():
            if roles[0].process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the orchestrator did not start: {launch._tail(roles[0].log_path)}")
            time.sleep(0.2)
        starts = launch.role_starts(config, config_path, run_dir, url, tokens)
        trainer_start, worker_start = starts[0], starts[1]
        # The observer reads moto directly: its reads do not count at the front.
        observer = CheckpointStore.from_config(store_config.model_copy(update={
            "endpoint": moto.url, "access_key_id": "testing", "secret_access_key": "testing"}))
        manifests: dict[int, bytes] = {}  # each version's manifest as first seen
        changed: set[int] = set()

        def observe() -> None:
            for version in observer.versions():
                raw = observer._manifest_bytes(version)
                if version not in manifests:
                    manifests[version] = raw
                elif raw != manifests[version]:
                    changed.add(version)

        trainer = launch._start("trainer", trainer_start.argv, run_dir, {**trainer_start.env, **env})
        roles.append(trainer)
        roles.append(launch._start("worker-0", worker_start.argv, run_dir, {**worker_start.env, **env}))
        deadline = time.monotonic() + args.f7_timeout_s
        while 0 not in manifests:
            if trainer.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the trainer did not publish version 0: {launch._tail(trainer.log_path)}")
            observe()
            time.sleep(0.5)
        weights = {f.path: f.size for f in observer.manifest(0).files if f.path.endswith(".safetensors")}
        first = sorted(weights)[0]
        control.set("stall", count=1, match=f"/v{key:06d}/{first}", methods=["PUT"],
                    after_bytes=int(args.f7_kill_at * weights[first]))
        prefix = f"/faults/f7/v{key:06d}/"
        polls, last_observed = 0, 0.0
        while True:
            stats = control.stats()
            received = {p.removeprefix(prefix): n for p, n in stats["received"]["by_object"].items() if p.startswith(prefix)}
            got = sum(n for p, n in received.items() if ".safetensors" in p)
            if got and (stats["stalled_now"] or got >= args.f7_kill_at * weights[first]):
                break
            if trainer.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the trainer ended (or the run timed out) before v{key}'s upload: {launch._tail(trainer.log_path)}")
            if time.monotonic() - last_observed > 1.0:
                observe()
                last_observed = time.monotonic()
            polls += 1
            time.sleep(0.02)
        tree = launch.descendants(trainer.process.pid)
        os.killpg(trainer.process.pid, signal.SIGKILL)
        launch.kill_all(tree)
        killed = time.time()
        trainer.process.wait()
        trainer.log.close()
        roles.remove(trainer)
        at_kill = {"received_bytes": received, "stalled": bool(stats["stalled_now"]),
                   "weight_file_bytes": weights[first], "trainer_processes_killed": 1 + len(tree)}
        with contextlib.suppress(OSError):
            at_kill["key_manifest_in_store"] = observer.fs.exists(observer._manifest_path(key))
            at_kill["objects_under_key_version"] = sorted(p.rsplit("/", 1)[-1] for p in observer.fs.ls(observer._vdir(key), refresh=True))
        control.clear()
        observe()
        at_kill["versions_in_store"] = sorted(manifests)
        at_kill["checkpoints"] = sorted(p.name for p in (run_dir / "trainer" / "checkpoints").iterdir())
        at_kill["journaled_steps"] = sorted(p.name for p in (run_dir / "trainer" / "batches").iterdir())
        before_restart = dict(manifests)
        time.sleep(args.f7_down_s)
        restarted = time.time()
        trainer = launch._start("trainer", trainer_start.argv, run_dir, {**trainer_start.env, **env})
        roles.insert(2, trainer)
        deadline = time.monotonic() + args.f7_timeout_s
        while trainer.process.poll() is None and time.monotonic() < deadline:
            observe()
            time.sleep(0.5)
        trainer_exit = trainer.process.poll()
        observe()
        worker = next(role for role in roles if role.name == "worker-0")
        launch._stop([worker])  # it posts what it generated and says how many were acknowledged
        roles.remove(worker)
        time.sleep(1.5)
        final = run.statuses()[-1]
        launch._stop(roles)
        roles = []
        cache = run_dir / "cache" / "worker-0"
        cached = {p.name: p for p in cache.iterdir()} if cache.is_dir() else {}
        cache_problems = {}
        for name, path in cached.items():
            if match := re.fullmatch(r"v(\d{6})", name):
                version = int(match[1])
                problem = (observer._cached_problem(str(path), observer.manifest(version))
                           if version in manifests else "not in the store")
                if (path / "manifest.json").read_bytes() != manifests.get(version):
                    problem = problem or "its manifest is not the store's"
                if problem:
                    cache_problems[name] = problem
        logs = run_logs(run)
        trainer_log = (run_dir / "logs" / "trainer.log").read_text(errors="replace")
        worker_log = (run_dir / "logs" / "worker-0.log").read_text(errors="replace")
    finally:
        launch._stop(roles)
        front.stop()
        moto.stop()
        shutil.rmtree(short, ignore_errors=True)
    resumed = re.search(r"resuming from checkpoint step (\d+); replaying steps (\d+)\.\.(\d+)", trainer_log)
    diff = re.search(r"replayed up to v(\d+): largest \|weight - published\| = (\S+)", trainer_log)
    published = _log_times(F7_PUBLISHED, trainer_log)
    by_version = Counter(v for _, v in published)
    skipped = {int(v) for group in re.findall(r"skipped publishing versions \[([\d, ]+)\]", trainer_log) for v in group.split(",")}
    loads = _log_times(F7_LOADED, worker_log)
    written = {v: json.loads(raw)["created_at"] for v, raw in manifests.items()}
    metrics = run.metrics()
    after = [m for m in metrics if m["time"] > restarted]
    first_new = min((at for at, v in published if at > restarted), default=None)
    found = {
        "made": "one host: moto's S3 in its own process behind the fault front on loopback as the store; the "
                f"orchestrator, the trainer and a worker as `decentrl run` starts them ({args.f7_config})",
        "config": {"steps": args.f7_steps, "groups_per_step": args.f7_groups_per_step, "parallel_reads": args.f7_parallel_reads,
                   "checkpoint_every": args.f7_checkpoint_every, "full_every": args.f7_full_every, "key_version": key},
        "at_kill": at_kill,
        "trainer_exit_after_restart": trainer_exit,
        "resumed_from": {"checkpoint": int(resumed[1]), "replayed": [int(resumed[2]), int(resumed[3])]} if resumed else None,
        "replay_difference": {"version": int(diff[1]), "max_abs": float(diff[2])} if diff else None,
        "versions": {
            "in_store": sorted(manifests),
            "gaps": sorted(set(range(args.f7_steps + 1)) - set(manifests)),
            # A version the store held at the kill must keep its manifest (not published again).
            "held_at_kill_changed": sorted(v for v in before_restart if manifests.get(v) != before_restart[v]) + sorted(changed),
            "published_twice": sorted(v for v, n in by_version.items() if n > 1),
            "published_by_restarted": sorted(v for at, v in published if at > restarted),
            "skipped_by_design": sorted(skipped),
            # The restarted publisher holds no version before it on disk: its first is stored whole alone.
            "key_version_stored": None if key not in manifests else (
                "whole" if json.loads(manifests[key]).get("delta_base") is None
                else "whole and as deltas" if json.loads(manifests[key]).get("whole") else "as deltas"),
        },
        "worker": {
            "loaded": [v for _, v in loads],
            # Loaded before the restarted trainer wrote the key version's manifest (its created_at): a half version.
            "loaded_key_before_its_manifest": sum(1 for at, v in loads if v == key and at < written.get(key, float("inf"))),
            "cached_versions": sorted(n for n in cached if re.fullmatch(r"v\d{6}", n)),
            "cache_problems": cache_problems,
            "partial_dirs_left": sorted(n for n in cached if n.endswith(".partial")),
        },
        "kill_to_restart_s": round(restarted - killed, 1),
        "restart_to_first_step_s": round(after[0]["time"] - restarted, 1) if after else None,
        "restart_to_next_version_published_s": round(first_new - restarted, 1) if first_new else None,
        "steps": len({m["step"] for m in metrics}),
        **journal_ledger(run, final),
    }
    found["half_versions_loaded"] = len(cache_problems) + found["worker"]["loaded_key_before_its_manifest"]
    found["recovered_s"] = round(first_new - killed, 1) if first_new else None
    return found, logs


# -- on the spread testbed (root, namespaces): F4, F6, F1, F8 ----------------------------------


TESTBED_FAULTS = ("F1", "F2", "F3S", "F4", "F6", "F8")  # F3S: F3 across the spread (its "spread" part)
TESTBED_OVERRIDES = [
    # The ledger's record: every batch served stays in the journal under its request id (the trainer's
    # "step-N"), and every lease with its rollout ids (a run here is shorter than the window).
    "orchestrator.batches_kept=100000", "orchestrator.dedupe_window_s=86400",
]
WORKER_STOPPED = re.compile(r"worker (\S+) stopping after (\d+) rollouts")


def load_spread() -> tuple[Any, Any]:
    """benchmarks/spread.py and spreadnet.py (benchmarks/ is not a package)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import spread
    import spreadnet

    return spread, spreadnet


def journal_ledger(run: Any, final: dict[str, Any]) -> dict[str, Any]:
    """The acknowledged-rollout ledger of a finished run on the testbed, from the orchestrator's
    journal (journal.sqlite, read-only) and the workers' own counts.

    - acknowledged: the journal's rollout rows. The journal commits a rollout before its answer goes
      out, so a row is a rollout the orchestrator acknowledged (or whose answer was lost on the way,
      which a resend then gets as a duplicate); the workers' own counts of rollouts acknowledged to
      them (their "stopping after N rollouts" line) must not exceed the rows of their leases.
    - served: every batch kept under its request id (TESTBED_OVERRIDES keeps all); the trainer asks
      step N's batch as "step-N", so these batches are what it trained on.
    - lost: rollouts of groups that completed (a ready place in line) and were passed over: still
      complete while a group later in line was served, or counted ready in the journal but not in
      the orchestrator's memory at the end (`final`: its last /v1/status), or acknowledged to a worker
      and absent from the journal.
    - trained_twice: rollouts whose group is in two batches of different request ids."""
    import sqlite3

    conn = sqlite3.connect(f"file:{run.run_dir / 'journal.sqlite'}?mode=ro", uri=True)
    try:
        rows = conn.execute(
            "SELECT r.rollout_id, l.lease_id, l.holder, l.status, l.ready_seq FROM rollouts r JOIN leases l USING (lease_id)"
        ).fetchall()
        batches = [(request_id, json.loads(body)) for request_id, body in conn.execute("SELECT request_id, body FROM batches")]
    finally:
        conn.close()
    per_lease: dict[str, list[str]] = {}
    status: dict[str, tuple[str, int | None]] = {}
    held_by: Counter[str] = Counter()
    for rollout_id, lease_id, holder, lease_status, ready_seq in rows:
        per_lease.setdefault(lease_id, []).append(rollout_id)
        status[lease_id] = (lease_status, ready_seq)
        held_by[holder.rsplit("/", 1)[-1]] += 1  # "token name/worker id"
    in_batches: dict[str, set[str]] = {}
    for request_id, body in batches:
        for lease_id in body["lease_ids"]:
            in_batches.setdefault(lease_id, set()).add(request_id)
    served_seq = [seq for lease_id, (_, seq) in status.items() if lease_id in in_batches and seq is not None]
    last_served = max(served_seq, default=0)
    complete = {lease_id for lease_id, (s, _) in status.items() if s == "complete"}
    passed_over = {lease_id for lease_id in complete if (status[lease_id][1] or 0) < last_served}
    unaccounted_groups = max(0, len(complete) - int(final.get("groups_ready", 0)))
    told: dict[str, int] = {}
    for path in (run.run_dir / "logs").glob("worker-*.log"):
        for match in WORKER_STOPPED.finditer(path.read_text(errors="replace")):
            told[match[1]] = told.get(match[1], 0) + int(match[2])
    group_size = run.config.group_size
    trained_twice = sum(len(per_lease.get(lease_id, [])) for lease_id, ids in in_batches.items()
                        if len({i for i in ids if i.startswith("step-")}) > 1)
    return {
        "acknowledged": len(rows),
        "acknowledged_to_workers": told,
        "journal_rows_by_holder": dict(held_by),
        "lost": sum(len(per_lease[lease_id]) for lease_id in passed_over) + unaccounted_groups * group_size
        + sum(max(0, n - held_by.get(name, 0)) for name, n in told.items()),
        "trained_twice": trained_twice,
        "served_twice": sum(len(per_lease.get(lease_id, [])) for lease_id, ids in in_batches.items() if len(ids) > 1),
        "batches_served": len(batches),
        "groups_served": len(in_batches),
        "groups_waiting_at_end": len(complete),
        "groups_ready_in_memory_at_end": final.get("groups_ready"),
        "closed_untrained": dict(Counter(s for lease_id, (s, _) in status.items() if s not in ("served", "complete", "open"))),
        "how_counted": "journal.sqlite: rollout rows (committed before each answer) against the batches served "
                       "(kept by request id, step-N); workers' own acknowledged counts from their logs",
    }


def testbed_config(steps: int, lease_s: float, extra: list[str] | None = None) -> Any:
    from decentrl.config import load_config

    return load_config(str(ROOT / "configs" / "local.toml"), [
        f"trainer.steps={steps}", f"orchestrator.lease_timeout_s={lease_s}", *TESTBED_OVERRIDES, *(extra or [])])


def first_after(statuses: list[dict[str, Any]], at: float, worker: str) -> float | None:
    """Seconds from `at` to the first status (the monitor's, every 0.25 s) showing a rollout of
    `worker` acknowledged after `at`. The counts per worker are the dashboard's, kept in memory:
    after a restart they start again from 0 (then the first status after `at` is the base)."""
    before = max((s["accepted"].get(worker, 0) for s in statuses if s["t"] <= at), default=0)
    after = [s for s in statuses if s["t"] > at]
    if after and after[0]["accepted"].get(worker, 0) < before:
        before = after[0]["accepted"].get(worker, 0)
    return next((round(s["t"] - at, 2) for s in after if s["accepted"].get(worker, 0) > before), None)


def finish(net: Any, run: Any, timeout_s: float) -> dict[str, Any]:
    """Wait for the trainer to end; stop the workers (each posts what it generated), let the monitor
    see it, take the final status, stop the rest. The final /v1/status."""
    from decentrl.cli import launch

    net.wait_trainer(run, timeout_s=timeout_s)
    workers = [role for role in run.roles if role.name.startswith("worker-")]
    launch._stop(workers)
    run.roles = [role for role in run.roles if role not in workers]
    time.sleep(1.5)
    final = run.statuses()[-1]
    net.stop_run(run)
    return final


def run_logs(run: Any) -> str:
    return "\n".join(p.read_text(errors="replace") for p in sorted((run.run_dir / "logs").glob("*.log")))


def wait_steps(net: Any, run: Any, steps: int, timeout_s: float = 300.0) -> None:
    net.wait_trainer(run, timeout_s=timeout_s, until=lambda: len(run.metrics()) >= steps)


def f4_orchestrator_cut(net: Any, args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    """F4: the workers' hosts partitioned (silent DROP) from the orchestrator's for `--cut-s`, under
    load, then healed; the trainer's host is not cut (it waits for batches)."""
    run = net.start_run(testbed_config(args.testbed_steps, args.f4_lease_s), run_name="f4", worker_hosts=["l1", "l2"])
    workers = {"worker-0": net.workers["l1"], "worker-1": net.workers["l2"]}
    try:
        wait_steps(net, run, args.warm_steps)
        cut = time.time()
        for host in workers.values():
            net.net.partition(host, net.orch)
        time.sleep(args.cut_s)
        net.net.heal()
        healed = time.time()
        final = finish(net, run, timeout_s=args.testbed_timeout_s)
    finally:
        net.stop_run(run)
    statuses, metrics = run.statuses(), run.metrics()
    resumed = next((m["time"] - healed for m in metrics if m["time"] > healed), None)
    logs = run_logs(run)
    found = {
        "made": True, "cut_s": args.cut_s, "lease_timeout_s": args.f4_lease_s, "workers": {"worker-0": "L1", "worker-1": "L2"},
        "first_post_after_heal_s": {name: first_after(statuses, healed, name) for name in workers},
        "trainer_steps_during_cut": sum(1 for m in metrics if cut < m["time"] <= healed),
        "trainer_resumed_s": round(resumed, 2) if resumed is not None else None,
        "steps": len(metrics), "rejected": final.get("rollouts_rejected"), "duplicates": final.get("rollouts_duplicate"),
        "leases_expired": final.get("leases_expired"),
        "workers_unreachable_warnings": logs.count("orchestrator unreachable"),
        "half_versions_loaded": 0,  # the store is not cut: versions load as before
        **journal_ledger(run, final),
    }
    # The first rollout acknowledged after the heal: the workers' way back (a worker whose rollouts
    # are refused as stale before and after the cut alike, as the L2 one here, says nothing of it).
    found["recovered_s"] = min((v for v in found["first_post_after_heal_s"].values() if v is not None), default=None)
    return found, logs


def f6_kill9_behind_tls(net: Any, args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    """F6: kill -9 of the orchestrator process (behind nginx's TLS front on its host) under load;
    `--down-s` later it is started again on the same run dir, as an operator or systemd would."""
    from decentrl.cli import launch

    run = net.start_run(testbed_config(args.testbed_steps, 30.0), run_name="f6", worker_hosts=["l1", "l2"])
    try:
        wait_steps(net, run, args.warm_steps)
        before = run.statuses()[-1]
        old = run.roles[0]
        assert old.name == "orchestrator"
        os.kill(old.process.pid, signal.SIGKILL)  # `ip netns exec` execs: this is the orchestrator's pid
        old.process.wait()
        old.log.close()
        killed = time.time()
        time.sleep(args.down_s)
        run.roles[0] = launch._start("orchestrator", net._in(net.orch, launch.orchestrator_command(run.config_path, run.run_dir)),
                                     run.run_dir, net.env())
        restarted = time.time()
        final = finish(net, run, timeout_s=args.testbed_timeout_s)
    finally:
        net.stop_run(run)
    statuses, metrics = run.statuses(), run.metrics()
    up = next((s["t"] for s in statuses if s["t"] > restarted), None)
    resumed = next((m["time"] - restarted for m in metrics if m["time"] > restarted), None)
    logs = run_logs(run)
    found = {
        "made": True, "down_s": args.down_s, "workers": {"worker-0": "L1", "worker-1": "L2"},
        "accepted_before_kill": before.get("rollouts_accepted"),
        "orchestrator_up_after_restart_s": round(up - restarted, 2) if up else None,
        "first_post_after_restart_s": {name: first_after(statuses, restarted, name) for name in ("worker-0", "worker-1")},
        "trainer_resumed_s": round(resumed, 2) if resumed is not None else None,
        "trainer_steps_during_outage": sum(1 for m in metrics if killed < m["time"] <= restarted),
        "steps": len(metrics), "recoveries": final.get("recoveries"), "rejected": final.get("rollouts_rejected"),
        "duplicates": final.get("rollouts_duplicate"), "half_versions_loaded": 0,
        **journal_ledger(run, final),
    }
    found["recovered_s"] = max((v for v in found["first_post_after_restart_s"].values() if v is not None), default=None)
    return found, logs


def f3_store_outage(net: Any, args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    """F3 across the spread: the store's host cut off from every host (silent DROP) for
    `--store-cut-s` under load, then `--slowdown-s` of 503 SlowDown to half its requests. The
    workers keep generating with the version they hold while it is fresh and then wait, saying
    why; the trainer's publishes are retried; what the store serves each worker after the heal is
    held against what the versions it loaded then needed (`spread.fetch_bytes`)."""
    spread, _ = load_spread()
    run = net.start_run(testbed_config(args.testbed_steps, 30.0), run_name="f3", worker_hosts=["l1", "l2"])
    workers = {"worker-0": net.workers["l1"], "worker-1": net.workers["l2"]}
    try:
        wait_steps(net, run, args.warm_steps)
        cut = time.time()
        net.net.isolate(net.store)
        time.sleep(args.store_cut_s)
        served_at_heal = dict(net.control.stats()["served"]["by_client"])
        net.net.heal()
        healed = time.time()
        slowdowns_before = net.control.stats()["hits"].get("slowdown", 0)
        net.control.set("slowdown", share=0.5, seconds=args.slowdown_s)
        net.manifests(run)
        final = finish(net, run, timeout_s=args.testbed_timeout_s)
        net.manifests(run)
    finally:
        net.stop_run(run)
    statuses, metrics, logs = run.statuses(), run.metrics(), run_logs(run)
    served = net.control.stats()["served"]["by_client"]
    loads = spread.loaded_versions(run)
    after: dict[str, Any] = {}
    for name, host in workers.items():
        held = {e.version for e in loads.get(name, []) if e.loaded_at <= healed}
        held |= {0} if not held else set()
        need = 0
        for event in (e for e in loads.get(name, []) if e.loaded_at > healed):
            size, chain, _ = spread.fetch_bytes(run.manifests, event.version, held)
            need += size
            held |= {event.version, *chain}
        got = served.get(host.ip, 0) - served_at_heal.get(host.ip, 0)
        after[name] = {"served": got, "ideal": need, "ratio": round(got / need, 3) if need else None}

    def accepted_at(t: float) -> int:
        return max((st["rollouts_accepted"] for st in statuses if st["t"] <= t), default=0)

    loaded_during = {name: [e.version for e in events if cut < e.loaded_at <= healed] for name, events in loads.items()}
    served_total, ideal_total = sum(a["served"] for a in after.values()), sum(a["ideal"] for a in after.values())
    found = {
        "made": True, "store_cut_s": args.store_cut_s, "slowdown_s": args.slowdown_s, "slowdown_share": 0.5,
        "workers": {"worker-0": "L1", "worker-1": "L2"},
        # Rollouts acknowledged while no host could reach the store: generated with held versions.
        "accepted_during_cut": accepted_at(healed) - accepted_at(cut),
        "trainer_steps_during_cut": sum(1 for m in metrics if cut < m["time"] <= healed),
        "versions_loaded_during_cut": loaded_during,
        "worker_pull_failures_logged": logs.count("failed ("),
        "workers_waiting_said_why": logs.count("more than max_staleness"),
        "trainer_publish_retries": logs.count("the store failed"),
        "versions_refused": logs.count("refused version"),
        "steps": len(metrics), "versions_continuous": [m["policy_version"] for m in metrics] == list(range(1, len(metrics) + 1)),
        "store_after_heal_vs_ideal": round(served_total / ideal_total, 3) if ideal_total else None,
        "bytes_vs_ideal": round(served_total / ideal_total, 3) if ideal_total else None,  # the goal's name for it
        "store_after_heal_by_worker": after,
        "slowdowns_answered": net.control.stats()["hits"].get("slowdown", 0) - slowdowns_before,
        **journal_ledger(run, final),
    }
    # No host sees a version before its manifest, written last; a version that fails its checks is refused, never loaded.
    found["half_versions_loaded"] = found["versions_refused"]
    found["recovered_s"] = min((v for v in (first_after(statuses, healed, n) for n in workers) if v is not None), default=None)
    return found, logs


def _testbed_store(url: str, endpoint: str) -> CheckpointStore:
    from decentrl.config import StoreConfig

    return CheckpointStore.from_config(StoreConfig(url=url, endpoint=endpoint, region="us-east-1"))


def _helper_publish(url: str, endpoint: str, size: int, version: int) -> None:
    """On the store's host: a version of `size` random bytes (and a config.json), published."""
    import hashlib

    weights = os.urandom(size)
    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "model.safetensors").write_bytes(weights)
        Path(tmp, "config.json").write_text("{}")
        _testbed_store(url, endpoint).publish(version, tmp)
    print(json.dumps({"published": version, "sha256": hashlib.sha256(weights).hexdigest()}), flush=True)


def _helper_pull(url: str, endpoint: str, version: int, cache: str) -> None:
    """On a worker's host: the worker's pull (CheckpointStore.pull, tried again after a jittered
    back-off while it fails, as the worker's swapper does), its log lines timed on stderr; the
    result on stdout."""
    import hashlib
    import logging

    from decentrl.backoff import backoff

    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(created).3f %(name)s %(levelname)s %(message)s")
    store = _testbed_store(url, endpoint)
    started, failures = time.time(), 0
    while True:
        try:
            path = Path(store.pull(version, cache))
            break
        except (StoreError, OSError) as exc:
            failures += 1
            delay = backoff(failures, cap_s=10.0)
            print(f"{time.time():.3f} pull failed ({type(exc).__name__}: {exc}); again in {delay:.1f}s", file=sys.stderr, flush=True)
            time.sleep(delay)
    loaded = time.time()
    digest = hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()
    print(json.dumps({"started": started, "loaded": loaded, "pull_failures": failures, "sha256": digest}), flush=True)


def f1_link_cut(net: Any, args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    """F1: a worker's host (L2) partitioned from the store's (silent DROP, both ways) for `--link-cut-s`
    once the front has served it `--cut-at` of a version's weights, then healed."""
    import spread

    size, version, url = args.f1_mb * 2**20, 1, f"s3://{spread.BUCKET}/f1"
    env = {**os.environ, **spread.CREDENTIALS, "PYTHONPATH": str(ROOT)}
    done = net.store.run([sys.executable, __file__, "helper", "publish", url, net.moto.url, str(size), str(version)],
                         capture_output=True, text=True, env=env, timeout=300)
    if done.returncode != 0:
        raise RuntimeError(f"publishing F1's version failed: {done.stderr[-2000:]}")
    published = json.loads(done.stdout.strip().splitlines()[-1])
    worker = net.workers["l2"]

    def received() -> tuple[int, int]:
        """(bytes, packets) in at the worker's interface: what crossed its link, frames whole."""
        counts = worker.run(["cat", "/sys/class/net/eth0/statistics/rx_bytes", "/sys/class/net/eth0/statistics/rx_packets"],
                            capture_output=True, text=True, check=True).stdout.split()
        return int(counts[0]), int(counts[1])

    def dropped() -> dict[str, tuple[int, int]]:
        """Per chain, (bytes, packets) the worker's DROP rules took after its interface counted
        them: the emulated loss (INPUT) and the partition (PARTITION), which on a real link never
        reach the host."""
        listing = worker.run(["iptables", "-w", "-L", "-v", "-x", "-n"], capture_output=True, text=True, check=True).stdout
        found: dict[str, tuple[int, int]] = {}
        chain = ""
        for row in (line.split() for line in listing.splitlines()):
            if row[:1] == ["Chain"]:
                chain = row[1]
            elif len(row) > 2 and row[2] == "DROP" and row[0].isdigit():
                before = found.get(chain, (0, 0))
                found[chain] = (before[0] + int(row[1]), before[1] + int(row[0]))
        return found

    net.control.reset()
    received_before, dropped_before = received(), dropped()
    dropped_at_heal = dropped_before
    log_path = Path(net.workdir) / "f1-pull.log"
    with open(log_path, "w") as log:
        pull = worker.popen([sys.executable, __file__, "helper", "pull", url, net.endpoint, str(version),
                             str(Path(net.workdir) / "f1-cache")], stdout=subprocess.PIPE, stderr=log, text=True, env=env)
        cut = healed = None
        served_at_cut = served_at_heal = 0
        try:
            deadline = time.monotonic() + 300
            while cut is None and pull.poll() is None and time.monotonic() < deadline:
                served_at_cut = net.control.stats()["served"]["by_client"].get(worker.ip, 0)
                if served_at_cut >= args.cut_at * size:
                    net.net.partition(worker, net.store)
                    cut = time.time()
                time.sleep(0.02)
            if cut is None:
                raise RuntimeError(f"the pull ended (or stalled) before {args.cut_at:.0%} of it was served")
            time.sleep(args.link_cut_s)
            served_at_heal = net.control.stats()["served"]["by_client"].get(worker.ip, 0)
            dropped_at_heal = dropped()  # the partition's rules go with the heal, their counts too
            net.net.heal()
            healed = time.time()
            out, _ = pull.communicate(timeout=300)
        finally:
            if pull.poll() is None:
                pull.kill()
                pull.wait()
            net.net.heal()
    (rx_bytes, rx_packets), dropped_after = received(), dropped()

    def took(chain: str, at: dict[str, tuple[int, int]]) -> tuple[int, int]:
        now, then = at.get(chain, (0, 0)), dropped_before.get(chain, (0, 0))
        return now[0] - then[0], now[1] - then[1]

    # The partition's rules go with the heal (their counts read just before); the loss's stay.
    partition, loss = took("PARTITION", dropped_at_heal), took("INPUT", dropped_after)
    received_s = rx_bytes - received_before[0]
    in_bytes = received_s - partition[0] - loss[0] - 14 * (partition[1] + loss[1])  # iptables counts IP bytes, no Ethernet header
    in_packets = rx_packets - received_before[1] - partition[1] - loss[1]
    # TCP payload: each frame's Ethernet, IP and TCP (with timestamps) headers off, 1514 - 1448 bytes.
    payload = in_bytes - in_packets * (1514 - 1448)
    result = json.loads(out.strip().splitlines()[-1])
    text = log_path.read_text(errors="replace")
    stalls = [float(line.split()[0]) for line in text.splitlines() if "Stalled" in line]
    served = net.control.stats()["served"]["by_object"]
    weights = f"/{spread.BUCKET}/f1/v{version:06d}/model.safetensors"
    found = {
        "made": True, "profile": "L2", "mb": args.f1_mb, "cut_s": args.link_cut_s, "cut_at_fraction": round(served_at_cut / size, 3),
        "stall_seen_s": round(min(stalls, default=float("nan")) - cut, 1) if stalls else None,
        "stall_timeout_s": 8.0, "stall_warnings": len(stalls), "pull_failures": result["pull_failures"],
        "pull_s": round(result["loaded"] - result["started"], 1),
        "recovered_s": round(result["loaded"] - healed, 1),
        # The pull checks every file's size and digest against the manifest before it answers;
        # and the bytes it loaded are those published.
        "loaded_verified": result["sha256"] == published["sha256"],
        # The goal's figure: the bytes the worker fetched, `payload_at_worker_vs_ideal` below. The
        # front counts what it wrote into its sockets, some of which never left the store's host.
        "bytes_vs_ideal": round(payload / size, 3),
        "served_at_front_vs_ideal": round(served.get(weights, 0) / size, 3),
        # Fetched, at the worker: every byte in at its interface during the pull (every file, the
        # manifest, IP and TCP headers), over the weights' size; what the front sent into the drop is not in it.
        "received_at_worker_vs_ideal": round(received_s / size, 3),
        # The same less what a real link would not have delivered (the frames the emulated loss and
        # the partition dropped after the interface counted them) and less the frames' headers:
        # the TCP payload that reached the worker, requests' answers and what was in flight when
        # a connection was abandoned.
        "payload_at_worker_vs_ideal": round(payload / size, 3),
        # What the front sent while the link was cut (into the drop), and after the heal.
        "served_during_cut_vs_ideal": round((served_at_heal - served_at_cut) / size, 3),
        "served_after_heal_vs_ideal": round((served.get(weights, 0) - served_at_heal) / size, 3),
        "lost": 0, "trained_twice": 0,
        "how": "the worker's pull (CheckpointStore.pull, retried as its swapper does) in the L2 worker's namespace, "
               "through the store's fault front, which counts the bytes it served",
    }
    found["half_versions_loaded"] = 0 if found["loaded_verified"] else 1
    return found, text


def f2_worker_cut_past_lease_and_retention(net: Any, args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    """F2: one of two L1 workers' hosts isolated (silent DROP from every host) for `--f2-cut-s`,
    longer than its leases (30 s) and than the store's retention of the versions it would need
    (keep_last 4, retention_grace_s `--f2-grace-s`), while the other worker keeps the trainer going.
    On return: what its spooled rollouts got (accepted, or refused with a reason), which version it
    loaded and how, and when it posted again."""
    import spread

    config = testbed_config(args.f2_steps, 30.0, [f"store.retention_grace_s={args.f2_grace_s}"])
    run = net.start_run(config, run_name="f2", worker_hosts=["l1", "l1b"])
    host, name = net.workers["l1b"], "worker-1"
    try:
        wait_steps(net, run, args.warm_steps)
        held_at_cut = max((e.version for e in spread.loaded_versions(run).get(name, [])), default=None)
        version_at_cut = run.version()
        net.net.isolate(host)
        time.sleep(args.f2_cut_s)
        in_store = store_versions(net, run.store_url)
        version_at_heal = run.version()
        net.net.heal()
        healed = time.time()
        final = finish(net, run, timeout_s=args.testbed_timeout_s)
    finally:
        net.stop_run(run)
    statuses, logs = run.statuses(), run_logs(run)
    text = (run.run_dir / "logs" / f"{name}.log").read_text(errors="replace")
    after = [line for line in text.splitlines() if line[:23] >= time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(healed))]
    rejections = Counter()
    for line in after:
        if match := re.search(r"orchestrator rejected \d+ rollouts: (\{.*\})", line):
            rejections.update(json.loads(match[1].replace("'", '"')))
    loads = [e for e in spread.loaded_versions(run).get(name, []) if e.loaded_at > healed]
    first_load = loads[0] if loads else None
    found = {
        "made": True, "cut_s": args.f2_cut_s, "lease_timeout_s": 30.0, "retention_grace_s": args.f2_grace_s, "keep_last": 4,
        "worker": "worker-1 (L1; worker-0 on L1 kept generating)",
        "held_at_cut": held_at_cut, "version_at_cut": version_at_cut, "version_at_heal": version_at_heal,
        "store_at_heal": in_store,  # the version after the one it held gone: its chain of deltas is broken
        "versions_it_needed_deleted": held_at_cut is not None and held_at_cut + 1 not in in_store,
        "rejected_after_heal": dict(rejections),
        "first_load_after_heal": None if first_load is None else {
            "version": first_load.version, "after_heal_s": round(first_load.loaded_at - healed, 1), "pull_s": first_load.pull_s},
        "first_post_after_heal_s": first_after(statuses, healed, name),
        "duplicates": final.get("rollouts_duplicate"), "rejected": final.get("rollouts_rejected"),
        "leases_expired": final.get("leases_expired"),
        "steps": len(run.metrics()), "half_versions_loaded": 0,
        **journal_ledger(run, final),
    }
    found["recovered_s"] = found["first_post_after_heal_s"]
    return found, logs


def store_versions(net: Any, url: str) -> list[int]:
    """The versions the run's store holds now (read from moto on the store's host)."""
    import spread

    done = net.store.run([sys.executable, spread.SCRIPT, "manifests", url, net.moto.url], capture_output=True, text=True,
                         env={**os.environ, **spread.CREDENTIALS}, timeout=120)
    if done.returncode != 0:
        raise RuntimeError(f"reading the manifests failed: {done.stderr[-2000:]}")
    return sorted(int(v) for v in json.loads(done.stdout))


def f8_trainer_nodes_cut(net: Any, args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    """F8: the two trainer nodes' interconnect (ic0, the gloo link between them) cut silently
    (DROP both ways) under load, after a checkpoint; the trainer must stop, each node saying why,
    within trainer.peer_timeout_s (`--peer-timeout-s`); the workers keep generating meanwhile. Then
    the link is healed and the same trainer command started again: it resumes from its checkpoint."""
    config = testbed_config(args.testbed_steps, 30.0, [f"trainer.peer_timeout_s={args.peer_timeout_s}",
                                                       f"trainer.checkpoint_every={args.checkpoint_every}"])
    run = net.start_run(config, run_name="f8", worker_hosts=["l1", "l2"])
    try:
        wait_steps(net, run, args.checkpoint_every + 2)
        net.cut_interconnect()
        cut = time.time()
        stopped: dict[str, float] = {}
        deadline = time.monotonic() + args.peer_timeout_s + 180
        while len(stopped) < len(run.trainer_nodes) and time.monotonic() < deadline:
            for role in run.trainer_nodes:
                if role.name not in stopped and role.process.poll() is not None:
                    stopped[role.name] = round(time.time() - cut, 1)
            time.sleep(0.2)
        codes = {role.name: role.process.poll() for role in run.trainer_nodes}
        hung = [role.name for role in run.trainer_nodes if role.process.poll() is None]
        from decentrl.cli import launch

        launch._stop(run.trainer_nodes, grace_s=5.0)  # any node still up is a hang: ended here, counted above
        run.roles = [role for role in run.roles if role not in run.trainer_nodes]
        time.sleep(max(0.0, args.trainer_down_s - (time.time() - cut)))
        net.cut_interconnect(False)
        restarted = time.time()
        down = [s for s in run.statuses() if cut < s["t"] <= restarted]
        workers_alive = [role.name for role in run.roles if role.name.startswith("worker-") and role.process.poll() is None]
        net.start_trainer(run)
        final = finish(net, run, timeout_s=args.testbed_timeout_s)
        manifests = net.manifests(run)
    finally:
        net.stop_run(run)
    logs = run_logs(run)
    errors = [line.split("error: ", 1)[1][:400] for line in logs.splitlines() if "error: trainer rank" in line]
    resumed = re.search(r"resuming from checkpoint step (\d+); replaying steps (\d+)\.\.(\d+)", logs)
    published = Counter(int(v) for v in re.findall(r"publisher: published version (\d+) in", logs))
    skipped = {int(v) for group in re.findall(r"skipped publishing versions \[([\d, ]+)\]", logs) for v in group.split(",")}
    metrics = run.metrics()
    found = {
        "made": True, "peer_timeout_s": args.peer_timeout_s, "checkpoint_every": args.checkpoint_every,
        # Each node's torchrun, from the cut to its exit; `hung`: still up when given up on (then ended).
        "stopped_after_cut_s": stopped, "exit_codes": codes, "hung": hung, "given_up_after_s": args.peer_timeout_s + 180,
        "errors": errors,
        "workers_alive_while_stopped": workers_alive,
        "accepted_while_stopped": (down[-1]["rollouts_accepted"] - down[0]["rollouts_accepted"]) if len(down) > 1 else 0,
        "resumed_from": {"checkpoint": int(resumed[1]), "replayed": [int(resumed[2]), int(resumed[3])]} if resumed else None,
        "steps": len(metrics),
        # Every version 1..steps published once, by the first trainer or the restarted one (which
        # publishes none the store holds), but those the publisher skipped by design (a newer one
        # was ready before it started: it logs them): no gap, no number published twice.
        "versions_published": {"gaps": sorted(set(range(1, args.testbed_steps + 1)) - set(published) - skipped),
                               "skipped_by_design": sorted(skipped), "twice": sorted(v for v, n in published.items() if n > 1),
                               "newest_in_store": max(manifests)},
        "trainer_resumed_s": round(min((m["time"] for m in metrics if m["time"] > restarted), default=float("nan")) - restarted, 1),
        "half_versions_loaded": 0,
        **journal_ledger(run, final),
    }
    found["recovered_s"] = max(stopped.values(), default=None)
    return found, logs


def testbed_faults(args: argparse.Namespace, wanted: set[str]) -> tuple[dict[str, Any], list[str]]:
    """The faults of `wanted` that need the spread testbed, on one testbed (its hosts: the
    orchestrator behind TLS, the store behind the fault front, two trainer nodes, workers on L1, L2)."""
    spread, spreadnet = load_spread()
    if reason := spreadnet.unavailable_reason():
        return {name: {"made": False, "why_not": f"the spread testbed: {reason}"} for name in wanted}, []
    workdir = tempfile.mkdtemp(prefix="faults-", dir="/tmp")  # short: the fault front's Unix socket path
    found: dict[str, Any] = {}
    logs: list[str] = []
    try:
        with spread.Spread(workdir, {"l1": "L1", "l2": "L2", "l1b": "L1"}) as net:
            for name, make in (("F1", f1_link_cut), ("F2", f2_worker_cut_past_lease_and_retention), ("F3S", f3_store_outage),
                               ("F4", f4_orchestrator_cut), ("F6", f6_kill9_behind_tls), ("F8", f8_trainer_nodes_cut)):
                if name in wanted:
                    started = time.time()
                    found[name], log = make(net, args)
                    found[name].update(measured_at=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(started)),
                                       wall_s=round(time.time() - started), load_1m=round(os.getloadavg()[0], 2),
                                       tracebacks_in_logs=traceback_lines(log))
                    logs.append(log)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return found, logs


def main() -> None:
    if sys.argv[1:2] == ["helper"]:  # (internal) run inside a testbed host by the testbed faults
        what, rest = sys.argv[2], sys.argv[3:]
        if what == "publish":
            _helper_publish(rest[0], rest[1], int(rest[2]), int(rest[3]))
        else:
            _helper_pull(rest[0], rest[1], int(rest[2]), rest[3])
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="*", default=["F3", "F5", "F9", "F10"],
                        help="faults to make (default: the one-host ones; the testbed's by name: F1 F2 F4 F6 F8)")
    parser.add_argument("--full-s", type=float, default=5.0, help="F9: how long the journal's disk stays full")
    parser.add_argument("--slowdown-s", type=float, default=12.0, help="F3: how long the store answers 503 SlowDown")
    parser.add_argument("--logs", help="copy the roles' logs into this directory")
    parser.add_argument("--testbed-steps", type=int, default=40, help="F4, F6: the demo's trainer steps on the testbed")
    parser.add_argument("--warm-steps", type=int, default=6, help="F4, F6: trainer steps done before the fault")
    parser.add_argument("--cut-s", type=float, default=60.0, help="F4: how long the workers cannot reach the orchestrator")
    parser.add_argument("--f4-lease-s", type=float, default=120.0, help="F4: orchestrator.lease_timeout_s of its run")
    parser.add_argument("--down-s", type=float, default=5.0, help="F6: seconds between the kill and the restart")
    parser.add_argument("--link-cut-s", type=float, default=30.0, help="F1: how long the worker's link is cut")
    parser.add_argument("--store-cut-s", type=float, default=60.0, help="F3S: how long the store's host is cut off from every host")
    parser.add_argument("--cut-at", type=float, default=0.3, help="F1: the share of the version served when it is cut")
    parser.add_argument("--f1-mb", type=int, default=24, help="F1: the version's size in MiB")
    parser.add_argument("--peer-timeout-s", type=float, default=30.0, help="F8: trainer.peer_timeout_s of its run")
    parser.add_argument("--checkpoint-every", type=int, default=5, help="F8: trainer.checkpoint_every of its run")
    parser.add_argument("--trainer-down-s", type=float, default=60.0, help="F8: seconds from the cut to the restart")
    parser.add_argument("--f2-cut-s", type=float, default=90.0, help="F2: how long the worker's host is isolated")
    parser.add_argument("--f2-grace-s", type=float, default=20.0, help="F2: store.retention_grace_s of its run")
    parser.add_argument("--f2-steps", type=int, default=80, help="F2: the demo's trainer steps")
    parser.add_argument("--testbed-timeout-s", type=float, default=420.0, help="F4, F6: most seconds for a run's end")
    parser.add_argument("--f7-config", default="configs/smollm2.toml", help="F7: the run's config (the real model)")
    parser.add_argument("--f7-steps", type=int, default=5, help="F7: trainer steps")
    parser.add_argument("--f7-groups-per-step", type=int, default=2, help="F7: trainer.groups_per_step")
    parser.add_argument("--f7-checkpoint-every", type=int, default=2, help="F7: trainer.checkpoint_every")
    parser.add_argument("--f7-full-every", type=int, default=3, help="F7: store.full_every (the key version: 1 + this)")
    parser.add_argument("--f7-kill-at", type=float, default=0.3, help="F7: share of the key version's first weight file "
                        "received when the trainer is killed")
    parser.add_argument("--f7-parallel-reads", type=int, default=4,
                        help="F7: store.parallel_reads (moto is one Python process: at the default 32, the trainer's "
                             "and the worker's pulls of SmolLM2's version 0 at once stalled for minutes at load 9)")
    parser.add_argument("--f7-down-s", type=float, default=5.0, help="F7: seconds from the kill to the restart")
    parser.add_argument("--f7-timeout-s", type=float, default=1800.0, help="F7: most seconds for each trainer's part")
    parser.add_argument("--merge", nargs="*", default=[], metavar="JSON",
                        help="files holding an earlier run's last line: its faults not run now are kept (each says "
                             "when it was measured)")
    args = parser.parse_args()
    faults: dict[str, Any] = {name: {"made": False, "why_not": why} for name, why in NEEDS_TESTBED.items()}
    tracebacks = 0
    for path in args.merge:
        earlier = json.loads(Path(path).read_text().strip().splitlines()[-1])
        for name, fault in earlier["faults"].items():
            # (F1's one-host twin alone, `made` a sentence, does not replace F1 made on the testbed.)
            if name not in args.only and fault.get("made") and (fault["made"] is True or faults.get(name, {}).get("made") is not True):
                # A fault of a whole run's line carries that run's date, load and traceback count.
                whole = {"measured_at": earlier["date"], "load_1m": round(earlier["load_1m"], 2),
                         "tracebacks_in_logs": earlier["tracebacks_in_logs"]}
                faults[name] = {**whole, **fault}
                tracebacks += faults[name]["tracebacks_in_logs"]
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
        if "F7" in args.only:
            started = time.time()
            (work / "f7").mkdir()
            faults["F7"], log = f7_trainer_kill_mid_publish(work / "f7", args)
            faults["F7"].update(measured_at=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(started)),
                                wall_s=round(time.time() - started), load_1m=round(os.getloadavg()[0], 2),
                                tracebacks_in_logs=traceback_lines(log))
            logs.append(log)
        twin = None
        if "F3" in args.only:  # with F1's one-host twin, through the same front
            (work / "f3").mkdir()
            twin, faults["F3"] = store_faults(work / "f3", args.slowdown_s)
        if wanted := set(args.only) & set(TESTBED_FAULTS):
            found, testbed_logs = testbed_faults(args, wanted)
            faults.update(found)
            logs += testbed_logs
        if "F3S" in faults:  # F3 across the spread, beside the one-host run of F3's publisher part (or a merged one)
            faults["F3"] = {**faults.get("F3", {"made": False, "why_not": "the one-host part: `--only F3`"}), "spread": faults.pop("F3S")}
        if twin is not None:
            faults["F1"] = {**faults["F1"], "one_host_twin": twin} if faults["F1"].get("made") is True else twin
        if args.logs:
            os.makedirs(args.logs, exist_ok=True)
            for i, text in enumerate(logs):
                Path(args.logs, f"log-{i}.txt").write_text(text)
    print(json.dumps({"faults": faults, "tracebacks_in_logs": traceback_lines(*logs) + tracebacks, "date": time.strftime("%Y-%m-%d"),
                      "load_1m": os.getloadavg()[0]}))


if __name__ == "__main__":
    main()
