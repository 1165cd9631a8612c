"""A run spread across network hosts (issue 45): every role on its own host with its own link, the
orchestrator behind TLS, the store an S3 server behind a fault front, a two-node trainer, workers
on the link profiles L0-L3; versions timed from publish to loaded weights against the link's bound.

    .venv/bin/python benchmarks/spread.py                      # every part; --quick: the reduced twin
    .venv/bin/python benchmarks/spread.py --parts run,versions   # run, versions, late_joiner, announce, leases

Needs root and what benchmarks/spreadnet.py needs (iproute2, iptables, ethtool, gcc), nginx and
moto. The last line of stdout is one JSON object; progress goes to stderr.

Topology (`Spread`, on a spreadnet `Testbed`; each host a network namespace on one bridge):
- `orch` (1 Gbit/s both ways, 0 ms: a data-centre host): the orchestrator on 127.0.0.1:8740 and, on
  the same host, nginx terminating TLS on its address, port 443 (configs/deploy/nginx-orchestrator.conf.template
  through spread_services.py; a throwaway CA). Every client - trainer, workers, the announce
  probe - speaks https to it and trusts the CA through SSL_CERT_FILE. A monitor on the same host
  reads /v1/status over plain HTTP on 127.0.0.1 every 0.25 s (when a worker's first rollout landed).
- `store` (PROFILES["store"], 200 Mbit/s): moto's S3 server on 127.0.0.1 there and the fault front
  on its address, port 9000, counting the bytes it serves per client and object. Every role
  reaches the store through the front (endpoint in [store]; credentials from the environment,
  as docs/store.md advises); only this benchmark's own manifest reads go to moto directly.
- `trainer0`, `trainer1` (PROFILES["trainer"]: 50 Mbit/s up): one trainer rank each, torchrun's
  c10d rendezvous hosted on trainer0 (`--rdzv-conf is_host=1`, `--local-addr`). The two talk
  over `ic0`, a veth pair between the two hosts alone and not shaped, as two nodes of one
  cluster talk over their interconnect (GLOO_SOCKET_IFNAME=ic0); their `eth0` - the 50 Mbit/s
  uplink - carries the publish to the store and the HTTP to the orchestrator. (FSDP's all-gathers
  over the uplink would make the trainer's step the link's: 3 x 4 bytes a parameter a step.)
- one host per worker with its profile (`w0`... on L1 for the versions part, `l1`/`l2` for the run
  part, `late_l0`... for late joiners).

Roles start as `decentrl run` starts them (decentrl/cli/launch.py: the resolved config.json,
`role_starts`' commands, tokens and environment, `_start`/`_stop`), each inside its host; the
trainer's torchrun command is `trainer_command`'s with the single-node `--standalone` swapped for the
two-node rendezvous.

Parts:
- run: the CPU demo (configs/local.toml, its 2 workers on L1 and L2) across the spread against
  `decentrl run` of the same on loopback: trainer busy, reward gain, time per step, bytes per version.
- versions (+ late_joiner): a larger stand-in model (the tiny type at hidden 512, 4 layers, bf16
  versions: S is reported) with 8 workers on L1, paced by the simulated generation latency so the
  two cores hold them; per version and worker the time from the version's manifest being written
  (`created_at`: the trainer's upload is done) to the worker's "loaded version" log line, against
  T* = max(sum of S over the workers pulling it / u_store, S / d_worker) + the announce delay
  measured for that pair + 3 RTTs between worker and store (rates as TCP payload of the frame
  rates: x 1448/1514). The trainer's upload (S / u_trainer) is not in the bound: the clock starts
  after it (reported as announce_s; publish_s adds the retention after the announcement). S is what that worker had to fetch: the version's
  stored bytes and those of any delta base it did not hold. Late joiners (one per profile, all
  four at once when the run is at version 20, half the L1 workers then stopped to keep memory
  under 8 GB) are timed from their first log line to their first loaded version (the newest full
  version plus the deltas since) and to their first rollout (what they loaded by then, plus one
  request's simulated generation), and less the time the orchestrator leased to no one after
  their first load (`lease_gate_s`). The store's bytes per worker come from the fault front. The
  CPU beside (`CpuClock`): the kernel's CPU pressure (PSI) and each role's CPU seconds over every
  delta's pull and each joiner's first load, and the store's and its front's CPU a request.
  `--store-set store.part_mb=1` runs the same with other [store] settings (smaller ranges).
- announce: announce -> worker latency across the shaped links (benchmarks/announce_latency.py's
  `announce_latencies`, the worker's own version watch, in a probe on each profile's host; the
  trainer's announcement sent from trainer0 by a helper process there).
- leases: 5 s leases and 20 s generations ([simulation]) from 2 workers on L2 through the front:
  leases lost, rollouts rejected.
- real (by name only: `--parts real`, about 40 min, 18 GB): configs/smollm2.toml (the model
  imported as the README says, `--real-model`) with its trainer one rank on trainer0 and a worker
  on L1 and on L2; training reward, time per step, bytes per version, trainer busy and held-out
  accuracy (`decentrl eval` of the last version; `--real-eval-before` for version 0 too) beside
  the loopback runs of docs/real_model.md.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(BENCHMARKS))

import spreadnet as sn  # noqa: E402

SCRIPT = str(Path(__file__).resolve())
DATACENTER = sn.Link(1000, 1000)  # the orchestrator's host
BUCKET = "spread"
ORCH_PORT, TLS_PORT, S3_PORT, RDZV_PORT = 8740, 443, 9000, 29400
INTERCONNECT = ("10.78.0.1", "10.78.0.2")  # trainer0, trainer1 on ic0
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}
MANIFEST_EVERY_S = 60.0  # below [store] retention_grace_s (300 s): no version is deleted unread
RTTS_IN_BOUND = 3  # "a few RTTs": the manifest, the ranged reads' requests, the TLS of a new connection
LOG_TIME = "%Y-%m-%d %H:%M:%S,%f"
LOADED = re.compile(
    r"^(\S+ \S+) worker INFO decentrl\.worker: loaded version (\d+): pull ([\d.]+)s, pause ([\d.]+)s, ([\d.]+)s after it was announced"
)
JOINED = re.compile(r"^(\S+ \S+) worker INFO decentrl\.worker: worker (\S+): ")
# The larger stand-in of the versions part: the tiny model's type at a width where a version means
# something (about 13.6M parameters, 27 MB in bf16), still light enough for 8 workers on 2 cores.
STAND_IN = ["model.hidden_size=512", "model.num_layers=4", "model.num_heads=8", "model.intermediate_size=1536",
            "store.publish_dtype=bf16"]


def say(message: str) -> None:
    print(f"[spread {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def log_time(stamp: str) -> float:
    """A log line's asctime (local time, milliseconds) as Unix time: every host shares this clock."""
    return datetime.datetime.strptime(stamp, LOG_TIME).timestamp()


# -- the topology -------------------------------------------------------------------------------


@dataclass
class SpreadRun:
    """One run on the spread: its directory, config, tokens, the roles started and the monitor."""

    run_dir: Path
    config: Any  # RunConfig
    config_path: Path
    tokens: dict[str, str]
    store_url: str
    roles: list[Any] = field(default_factory=list)  # launch.Role
    trainer_nodes: list[Any] = field(default_factory=list)
    started: float = field(default_factory=time.time)
    manifests: dict[int, dict[str, Any]] = field(default_factory=dict)  # every one seen (retention deletes)
    manifests_read: float = 0.0

    def statuses(self) -> list[dict[str, Any]]:
        """The monitor's /v1/status answers so far, each with its Unix time `t`."""
        path = self.run_dir / "monitor.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]

    def metrics(self) -> list[dict[str, Any]]:
        path = self.run_dir / "metrics.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []

    def version(self) -> int:
        statuses = self.statuses()
        return (statuses[-1].get("policy_version") or 0) if statuses else 0


class Spread:
    """The issue's topology on a spreadnet Testbed, with the services up; runs start on it one
    after another (`start_run`, `stop_run`). Use as a context manager: everything it started is
    stopped and every namespace removed on leaving, and by the testbed's reaper if killed."""

    def __init__(self, workdir: str, worker_hosts: dict[str, str]) -> None:
        """`worker_hosts`: host name -> profile name (PROFILES), the hosts workers may run on."""
        self.workdir = workdir
        self.worker_profiles = worker_hosts
        self.net = sn.Testbed()
        self.services: list[Any] = []
        self.runs: list[SpreadRun] = []

    def __enter__(self) -> Spread:
        import spread_services as ss

        from decentrl.config import OrchestratorConfig

        removed = sn.cleanup_stale()
        if removed:
            say(f"removed {len(removed)} namespaces left by dead testbeds")
        self.net.__enter__()
        try:
            self.orch = self.net.add_host("orch", DATACENTER)
            self.store = self.net.add_host("store", sn.PROFILES["store"])
            self.trainers = [self.net.add_host(f"trainer{i}", sn.PROFILES["trainer"]) for i in (0, 1)]
            self._interconnect()
            self.workers = {name: self.net.add_host(name, sn.PROFILES[p]) for name, p in self.worker_profiles.items()}
            self.certs = ss.make_certificates(os.path.join(self.workdir, "certs"), [self.orch.ip])
            self.moto = ss.start_moto(self.workdir, host="127.0.0.1", port=0, popen=self.store.popen)
            self.services.append(self.moto)
            front, self.control = ss.start_s3_front(
                self.workdir, host=self.store.ip, port=S3_PORT, upstream=self.moto.url, popen=self.store.popen
            )
            self.services.append(front)
            self.front, self.endpoint = front, front.url
            put = f"import urllib.request as u; u.urlopen(u.Request('{self.moto.url}/{BUCKET}', method='PUT'), timeout=30)"
            self.store.run([sys.executable, "-c", put], check=True)
            # One front for every run: its limits from the defaults every run here keeps.
            read_timeout_s, max_body = ss.tls_front_limits(OrchestratorConfig())
            tls = ss.start_tls_front(
                os.path.join(self.workdir, "nginx"), host=self.orch.ip, port=TLS_PORT, server_name=self.orch.ip,
                certs=self.certs, upstream=f"127.0.0.1:{ORCH_PORT}", read_timeout_s=read_timeout_s,
                max_body_bytes=max_body, popen=self.orch.popen,
            )
            self.services.append(tls)
            self.url = tls.url
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _interconnect(self) -> None:
        """ic0: a veth pair between the two trainer hosts alone, not shaped (inside their namespaces,
        so it goes with them)."""
        a, b = self.trainers
        sn._sh("ip", "-n", a.ns, "link", "add", "ic0", "type", "veth", "peer", "name", "ic0", "netns", b.ns)
        for host, ip in zip(self.trainers, INTERCONNECT):
            sn._sh("ip", "-n", host.ns, "addr", "add", f"{ip}/30", "dev", "ic0")
            sn._sh("ip", "-n", host.ns, "link", "set", "ic0", "up")

    def env(self) -> dict[str, str]:
        """What every role gets on top of `decentrl run`'s: the CA, the store's credentials."""
        return {"SSL_CERT_FILE": self.certs.ca, **CREDENTIALS}

    def configure(self, config: Any, run_name: str, workers: int) -> Any:
        """`config` (a RunConfig) resolved for the spread: its store in the bucket behind the front,
        the orchestrator on 127.0.0.1:8740 of its host, `workers` workers."""
        store = config.store.model_copy(update={"url": f"s3://{BUCKET}/{run_name}", "endpoint": self.endpoint, "region": "us-east-1"})
        orchestrator = config.orchestrator.model_copy(update={"host": "127.0.0.1", "port": ORCH_PORT})
        return config.model_copy(update={"run_name": run_name, "store": store, "orchestrator": orchestrator, "num_workers": workers})

    def start_run(
        self, config: Any, *, run_name: str, worker_hosts: list[str], extra_tokens: tuple[str, ...] = (),
        trainer: bool = True, trainer_nodes: int = 2,
    ) -> SpreadRun:
        """The orchestrator (and its monitor), the two trainer nodes and a worker on each of
        `worker_hosts` (worker-i on the i-th), as `decentrl run` would start them. `extra_tokens`:
        worker tokens for workers started later (`start_worker`). `trainer_nodes=1`: the trainer
        is one rank on trainer0 alone (`decentrl run`'s own single-node command)."""
        from decentrl.cli import launch
        from orchestrator.auth import add_token

        if any(run.roles for run in self.runs):
            raise RuntimeError("one run at a time: stop_run the one before")
        run_dir = Path(self.workdir) / run_name
        (run_dir / "logs").mkdir(parents=True)
        config = self.configure(config, run_name, max(1, len(worker_hosts)))  # a config names at least one
        config_path = run_dir / "config.json"
        config_path.write_text(config.model_dump_json(indent=2))
        tokens_path = str(run_dir / "tokens.json")
        names = ["trainer", *(f"worker-{i}" for i in range(config.num_workers)), *extra_tokens]
        tokens = {name: add_token(tokens_path, name=name, role="trainer" if name == "trainer" else "worker") for name in names}
        run = SpreadRun(run_dir, config, config_path, tokens, config.store.url)
        self.runs.append(run)
        run.roles.append(launch._start("orchestrator", self._in(self.orch, launch.orchestrator_command(config_path, run_dir)),
                                       run_dir, self.env()))
        run.roles.append(launch._start("monitor", self._in(self.orch, [
            sys.executable, SCRIPT, "monitor", f"http://127.0.0.1:{ORCH_PORT}", tokens["trainer"], str(run_dir / "monitor.jsonl"),
        ]), run_dir, {}))
        deadline = time.monotonic() + 120
        while not run.statuses():
            if run.roles[0].process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the orchestrator did not start: {launch._tail(run.roles[0].log_path)}")
            time.sleep(0.2)
        starts = launch.role_starts(config, config_path, run_dir, self.url, tokens)
        if trainer:
            self.start_trainer(run, trainer_nodes)
        for start, host in zip(starts[1:1 + len(worker_hosts)], worker_hosts, strict=True):
            run.roles.append(launch._start(start.name, self._in(self.workers[host], start.argv), run_dir, {**start.env, **self.env()}))
        return run

    def start_trainer(self, run: SpreadRun, nodes: int = 2) -> None:
        """The trainer's nodes (again, after a crash: it resumes from its checkpoint), one rank
        each on trainer0.. (`nodes=1`: `decentrl run`'s own single-node command on trainer0)."""
        from decentrl.cli import launch

        start = launch.role_starts(run.config, run.config_path, run.run_dir, self.url, run.tokens)[0]
        run.trainer_nodes = []
        for node, host in enumerate(self.trainers[:nodes]):
            argv = self.trainer_node_command(run.config_path, run.run_dir, node) if nodes > 1 else start.argv
            env = {**start.env, **self.env(), "GLOO_SOCKET_IFNAME": "ic0"}
            role = launch._start("trainer" if node == 0 else f"trainer-node{node}", self._in(host, argv), run.run_dir, env)
            run.roles.append(role)
            run.trainer_nodes.append(role)

    def cut_interconnect(self, cut: bool = True) -> None:
        """Packets on ic0 (between the trainer nodes) vanish silently, both ways (`cut=False`: they
        pass again). Not a `Testbed.partition`: that one drops on eth0, the uplink."""
        for host in self.trainers:
            sn._sh("ip", "netns", "exec", host.ns, "iptables", "-I" if cut else "-D", "INPUT", "-i", "ic0", "-j", "DROP")

    def trainer_node_command(self, config_path: Path, run_dir: Path, node: int) -> list[str]:
        """`trainer_command` for one rank on this node, its `--standalone` swapped for the two-node
        c10d rendezvous that trainer0 hosts on the interconnect."""
        from decentrl.cli.launch import trainer_command

        argv = trainer_command(config_path, run_dir, self.url, 1)
        at = argv.index("--standalone")
        rendezvous = ["--nnodes=2", "--rdzv-backend=c10d", f"--rdzv-endpoint={INTERCONNECT[0]}:{RDZV_PORT}",
                      "--rdzv-id=spread", f"--local-addr={INTERCONNECT[node]}", *(["--rdzv-conf=is_host=1"] if node == 0 else [])]
        return argv[:at] + rendezvous + argv[at + 1:]

    def start_worker(self, run: SpreadRun, name: str, host: str) -> Any:
        """A worker started later (a late joiner) under the token `name`, on `host`."""
        from decentrl.cli import launch

        argv = launch.worker_command(run.config_path, run.run_dir, self.url, name)
        env = {"DECENTRL_TOKEN": run.tokens[name], "OMP_NUM_THREADS": str(run.config.worker.torch_threads), **self.env()}
        role = launch._start(name, self._in(self.workers[host], argv), run.run_dir, env)
        run.roles.append(role)
        return role

    def wait_trainer(self, run: SpreadRun, timeout_s: float, *, until: Any = None) -> bool:
        """Until both trainer nodes exit 0 (True), or `until()` is true (False); raises if a role
        dies or time runs out, with its log's tail."""
        from decentrl.cli import launch

        deadline = time.monotonic() + timeout_s
        while not all(node.process.poll() == 0 for node in run.trainer_nodes):
            for role in run.roles:
                code = role.process.poll()
                if code is not None and not (role in run.trainer_nodes and code == 0):
                    raise RuntimeError(f"{role.name} exited with code {code}; {role.log_path}:\n{launch._tail(role.log_path, 25)}")
            if until is not None and until():
                return False
            if time.monotonic() - run.manifests_read > MANIFEST_EVERY_S:  # before retention deletes them
                try:
                    self.manifests(run)
                except RuntimeError as exc:  # read again at the next turn; the run goes on
                    say(f"reading the manifests failed: {exc}")
                    run.manifests_read = time.monotonic()
            if time.monotonic() > deadline:
                raise TimeoutError(f"the run did not end within {timeout_s:.0f} s (version {run.version()})")
            time.sleep(0.5)
        return True

    def quiesce(self, run: SpreadRun, timeout_s: float = 60.0) -> int | None:
        """Stop the trainer, then wait (up to `timeout_s`) until every worker still running has
        loaded the newest version announced, so that no pull is cut off by the end of the run (the
        store's byte counts then hold whole pulls only). The newest version, or None."""
        from decentrl.cli import launch

        launch._stop(run.trainer_nodes)
        run.roles = [role for role in run.roles if role not in run.trainer_nodes]
        newest = run.statuses()[-1].get("policy_version")
        workers = [role.name for role in run.roles if role.name not in ("orchestrator", "monitor")]
        deadline = time.monotonic() + timeout_s
        while newest is not None and time.monotonic() < deadline:
            loads = loaded_versions(run)
            if all(any(event.version >= newest for event in loads.get(name, [])) for name in workers):
                break
            time.sleep(0.5)
        return newest

    def stop_run(self, run: SpreadRun) -> None:
        """Workers, trainer, monitor, orchestrator: `decentrl run`'s stop, in reverse start order."""
        from decentrl.cli import launch

        launch._stop(run.roles)
        run.roles = []

    def manifests(self, run: SpreadRun) -> dict[int, dict[str, Any]]:
        """Per version the run's store has held: created_at, delta_base, stored bytes (what a pull
        of it fetches), full bytes - read from moto directly (the front's counts stay the workers'),
        merged with those read before (`wait_trainer` reads them every MANIFEST_EVERY_S)."""
        done = self.store.run([sys.executable, SCRIPT, "manifests", run.store_url, self.moto.url],
                              capture_output=True, text=True, env={**os.environ, **CREDENTIALS}, timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"reading the manifests failed: {done.stderr[-2000:]}")
        run.manifests.update({int(v): m for v, m in json.loads(done.stdout).items()})
        run.manifests_read = time.monotonic()
        return dict(sorted(run.manifests.items()))

    def _in(self, host: sn.Host, argv: list[str]) -> list[str]:
        return sn._in_ns(host.ns, argv)

    def close(self) -> None:
        from decentrl.cli import launch

        for run in self.runs:
            if run.roles:
                launch._stop(run.roles, grace_s=5.0)
                run.roles = []
        for service in reversed(self.services):
            service.stop()
        self.services = []
        self.net.close()


class CpuClock:
    """Where the CPU went while versions moved, sampled every `period_s` in the background: the
    machine's CPU pressure (PSI, /proc/pressure/cpu `some`: the share of time at least one task was
    runnable and waiting for a core) and each named process's CPU time (/proc/PID/stat utime +
    stime, its threads' included, those gone too). `processes()` names them at each sample (roles
    come and go). Read between two Unix times: `pressure(a, b)` in [0, 1], `cpu_s(name, a, b)`."""

    def __init__(self, processes: Any, period_s: float = 0.25) -> None:
        import threading

        self.processes, self.period_s = processes, period_s
        self.samples: list[tuple[float, float, dict[str, float]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpu-clock", daemon=True)
        self._tick = os.sysconf("SC_CLK_TCK")

    def __enter__(self) -> CpuClock:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            with contextlib.suppress(OSError, ValueError, IndexError):
                some = Path("/proc/pressure/cpu").read_text().split("\n")[0]
                stalled = int(some.rsplit("total=", 1)[1]) / 1e6
                cpu = {}
                for name, pid in self.processes().items():
                    with contextlib.suppress(OSError, ValueError, IndexError):
                        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                        cpu[name] = (int(fields[11]) + int(fields[12])) / self._tick
                self.samples.append((time.time(), stalled, cpu))

    def _at(self, t: float) -> tuple[float, float, dict[str, float]] | None:
        return min(self.samples, key=lambda sample: abs(sample[0] - t), default=None)

    def pressure(self, a: float, b: float) -> float | None:
        first, last = self._at(a), self._at(b)
        if first is None or last is None or last[0] - first[0] < self.period_s:
            return None
        return round(min(1.0, (last[1] - first[1]) / (last[0] - first[0])), 3)

    def cpu_s(self, name: str, a: float, b: float) -> float | None:
        first, last = self._at(a), self._at(b)
        if first is None or last is None or name not in first[2] or name not in last[2]:
            return None
        return round(last[2][name] - first[2][name], 3)


# -- what the logs say -------------------------------------------------------------------------


@dataclass(frozen=True)
class Loaded:
    worker: str
    version: int
    loaded_at: float
    seen_at: float  # when the worker heard of the version (loaded_at - "after it was announced")
    pull_s: float


def loaded_versions(run: SpreadRun) -> dict[str, list[Loaded]]:
    """Per worker (its log's name), the versions it loaded, in order, from its "loaded version" lines."""
    found: dict[str, list[Loaded]] = {}
    for path in sorted((run.run_dir / "logs").glob("*.log")):
        name = path.stem
        for line in path.read_text(errors="replace").splitlines():
            if match := LOADED.match(line):
                at = log_time(match[1])
                found.setdefault(name, []).append(Loaded(name, int(match[2]), at, at - float(match[5]), float(match[3])))
    return found


def joined_at(run: SpreadRun, name: str) -> float | None:
    """When a worker's process was up (its first log line, after its imports)."""
    path = run.run_dir / "logs" / f"{name}.log"
    for line in path.read_text(errors="replace").splitlines() if path.exists() else []:
        if match := JOINED.match(line):
            return log_time(match[1])
    return None


def first_rollout_at(run: SpreadRun, name: str) -> float | None:
    """When the orchestrator first counted a rollout of token `name` (the monitor's resolution)."""
    for status in run.statuses():
        if status["accepted"].get(name, 0) > 0:
            return status["t"]
    return None


def fetch_bytes(manifests: dict[int, dict[str, Any]], version: int, held: set[int]) -> tuple[int, list[int], bool]:
    """What a pull of `version` fetches by a worker whose cache holds `held`: its stored bytes and
    those of each delta base down its chain to one held, or to a key version (whose whole files
    are fetched: a whole key version by its deltas only where its base is held). (bytes,
    versions, whether any was fetched whole)."""
    total, chain = 0, []
    v: int | None = version
    while v is not None and v not in held:
        manifest = manifests[v]  # KeyError: a version deleted before it was read (MANIFEST_EVERY_S)
        chain.append(v)
        if manifest["delta_base"] is None or (manifest.get("whole") and manifest["delta_base"] not in held):
            return total + manifest["full_bytes"], chain, True
        total += manifest["stored_bytes"]
        v = manifest["delta_base"]
    return total, chain, False


def is_key(manifest: dict[str, Any]) -> bool:
    """A key version: every file stored whole (and, `whole`, as deltas too)."""
    return manifest["delta_base"] is None or bool(manifest.get("whole"))


def payload_bps(mbit: float) -> float:
    return mbit * 1e6 / 8 * sn.PAYLOAD_PER_WIRE


def version_timings(
    run: SpreadRun, manifests: dict[int, dict[str, Any]], hosts: dict[str, sn.Host], store_link: sn.Link
) -> list[dict[str, Any]]:
    """Per (worker, loaded version): S, the measured time from the manifest to the loaded weights,
    the bound T* and its parts, efficiency = T*/measured. `hosts`: worker log name -> its host."""
    loads = loaded_versions(run)
    rows: list[dict[str, Any]] = []
    for name, events in loads.items():
        held: set[int] = set()
        for event in events:
            size, chain, full = fetch_bytes(manifests, event.version, held)
            held |= {event.version, *chain}  # cached (the cap evicts only versions older than these)
            rows.append({"worker": name, "version": event.version, "bytes": size, "chain": chain, "full": full,
                         "loaded_at": event.loaded_at, "seen_at": event.seen_at, "pull_s": event.pull_s})
    by_version: dict[int, int] = {}
    for row in rows:
        by_version[row["version"]] = by_version.get(row["version"], 0) + row["bytes"]
    for row in rows:
        link = hosts[row["worker"]].link
        created = manifests[row["version"]]["created_at"]
        store_s = by_version[row["version"]] / payload_bps(store_link.up_mbit)  # the store serves on its uplink
        worker_s = row["bytes"] / payload_bps(link.down_mbit)
        announce_s = max(0.0, row["seen_at"] - created)
        rtt_s = (link.rtt_ms + link.jitter_ms / 2 + store_link.rtt_ms) / 1000
        bound = max(store_s, worker_s) + announce_s + RTTS_IN_BOUND * rtt_s
        measured = row["loaded_at"] - created
        row.update(profile=profile_of(link), measured_s=round(measured, 3), bound_s=round(bound, 3),
                   store_term_s=round(store_s, 3), link_term_s=round(worker_s, 3), announce_s=round(announce_s, 3),
                   efficiency=round(bound / measured, 3) if measured > 0 else None)
    return rows


def profile_of(link: sn.Link) -> str:
    return next((name for name, profile in sn.PROFILES.items() if profile == link), "?")


def bytes_per_version(manifests: dict[int, dict[str, Any]]) -> dict[str, Any]:
    deltas = [m["stored_bytes"] for v, m in manifests.items() if m["delta_base"] is not None]  # a whole key's too
    keys = [m["full_bytes"] for v, m in manifests.items() if is_key(m)]
    return {"versions": len(manifests), "key_versions": len(keys), "key_bytes_mean": int(statistics.fmean(keys)) if keys else None,
            "delta_bytes_mean": int(statistics.fmean(deltas)) if deltas else None,
            "delta_bytes_max": max(deltas) if deltas else None,
            # per version, to a worker holding the one before
            "mean_bytes": int(statistics.fmean(m["full_bytes"] if m["delta_base"] is None else m["stored_bytes"]
                                               for m in manifests.values())) if manifests else None}


def summarize_run(metrics: list[dict[str, Any]]) -> dict[str, Any]:
    from decentrl.cli.launch import summarize

    if not metrics:
        return {"steps": 0}
    summary = summarize(metrics)
    steps = [m["step_s"] for m in metrics]
    return {
        "steps": len(metrics), "reward_first": round(summary["reward_first"], 4), "reward_last": round(summary["reward_last"], 4),
        "reward_gain": round(summary["reward_gain"], 4), "trainer_busy": round(metrics[-1]["trainer_busy_fraction_total"], 4),
        "step_s_mean": round(statistics.fmean(steps), 3), "step_s_median": round(statistics.median(steps), 3),
        "wall_s": round(metrics[-1]["time"] - metrics[0]["time"] + steps[0], 1),
    }


def quantiles(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    ordered = sorted(values)
    return {"n": len(ordered), "min": ordered[0], "p50": round(statistics.median(ordered), 3), "max": ordered[-1]}


# -- parts -------------------------------------------------------------------------------------


def demo_overrides(steps: int) -> list[str]:
    return [f"trainer.steps={steps}"]


def l1_l2_figures(spread: Spread, run: SpreadRun) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A finished run's figures with its worker-0 on l1 and worker-1 on l2: the trainer's, bytes
    per version, the store's bytes served, each profile's publish-to-loaded times; and the rows
    of `version_timings`."""
    manifests = spread.manifests(run)
    served = spread.control.stats()["served"]
    timings = version_timings(run, manifests, {"worker-0": spread.workers["l1"], "worker-1": spread.workers["l2"]},
                              spread.store.link)
    figures = {**summarize_run(run.metrics()), "bytes_per_version": bytes_per_version(manifests),
               "store_served_bytes": served["total"],
               "version_s": {p: quantiles([r["measured_s"] for r in timings if r["profile"] == p]) for p in ("L1", "L2")}}
    return figures, timings


def part_run(spread: Spread, args: argparse.Namespace, notes: list[str]) -> dict[str, Any]:
    """The CPU demo across the spread (workers on L1 and L2) and on loopback (`decentrl run`)."""
    from decentrl.config import load_config

    overrides = demo_overrides(args.run_steps)
    config = load_config(str(ROOT / "configs" / "local.toml"), overrides)
    say(f"run: the demo ({args.run_steps} steps) across the spread, workers on L1 and L2")
    spread.control.reset()
    run = spread.start_run(config, run_name="demo", worker_hosts=["l1", "l2"])
    try:
        spread.wait_trainer(run, timeout_s=args.run_timeout_s)
    finally:
        spread.stop_run(run)
    figures, _ = l1_l2_figures(spread, run)
    result: dict[str, Any] = {"spread": figures}
    if args.loopback:
        say(f"run: the demo ({args.run_steps} steps) on loopback (decentrl run)")
        loop_dir = Path(spread.workdir) / "loopback"
        argv = [sys.executable, "-m", "decentrl", "run", str(ROOT / "configs" / "local.toml"), "--run-dir", str(loop_dir)]
        for item in overrides:
            argv += ["--set", item]
        done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=args.run_timeout_s)
        if done.returncode != 0:
            raise RuntimeError(f"decentrl run on loopback failed ({done.returncode}): {done.stdout[-3000:]}")
        metrics = [json.loads(line) for line in (loop_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
        result["loopback"] = {**summarize_run(metrics), "bytes_per_version": bytes_per_version(local_manifests(loop_dir / "checkpoints"))}
    else:
        result["loopback"] = None
        notes.append("run: loopback skipped (--no-loopback)")
    return result


def part_real(spread: Spread, args: argparse.Namespace, notes: list[str]) -> dict[str, Any]:
    """configs/smollm2.toml across the spread (issue 45 item 4): the real model, its trainer one
    rank on trainer0 (as the config's `trainer_ranks = 1`; 50 Mbit/s up), a worker on L1 and one on
    L2; held-out accuracy of the last version by `decentrl eval` on the orchestrator's host,
    beside the loopback runs of docs/real_model.md (docs/figures/smollm2_runs.json)."""
    from decentrl.config import load_config

    model = Path(args.real_model).resolve()
    if not (model / "config.json").exists():
        raise RuntimeError(f"real: no model at {model}: import it first (README, 'A real model')")
    overrides = [f"model.path={model}", f"trainer.steps={args.real_steps}", *args.real_sets]
    config = load_config(str(ROOT / "configs" / "smollm2.toml"), overrides)
    say(f"real: SmolLM2-135M-Instruct ({args.real_steps} steps) across the spread, workers on L1 and L2")
    spread.control.reset()
    run = spread.start_run(config, run_name="smollm2", worker_hosts=["l1", "l2"], trainer_nodes=1)
    try:
        spread.wait_trainer(run, timeout_s=args.real_timeout_s)
        newest = spread.quiesce(run, timeout_s=300)
    finally:
        spread.stop_run(run)
    figures, timings = l1_l2_figures(spread, run)
    figures["efficiency"] = {p: quantiles([r["efficiency"] for r in timings if r["profile"] == p and r["efficiency"]])
                             for p in ("L1", "L2")}
    result: dict[str, Any] = {"steps": args.real_steps, "overrides": overrides, "spread": figures}
    evals = {}
    for version in sorted({0, newest or 0} if args.real_eval_before else {newest or 0}):
        say(f"real: decentrl eval of version {version} ({args.real_eval_prompts} held-out prompts x 4)")
        started, load = time.time(), os.getloadavg()[0]
        done = spread.orch.run([sys.executable, "-m", "decentrl", "eval", str(run.config_path), "--version", str(version),
                                "--prompts", str(args.real_eval_prompts), "--samples", "4",
                                "--cache-dir", str(run.run_dir / "eval-cache")],
                               capture_output=True, text=True, env={**os.environ, **spread.env()}, timeout=3600, cwd=ROOT)
        if done.returncode != 0:
            raise RuntimeError(f"decentrl eval failed ({done.returncode}): {done.stderr[-3000:]}")
        evals[version] = {**json.loads(done.stdout.strip().splitlines()[-1]), "eval_s": round(time.time() - started),
                          "load": f"{load:.1f} -> {os.getloadavg()[0]:.1f}"}
    result["spread"]["heldout"] = evals
    result["loopback"] = loopback_reference(args.real_steps)
    return result


def loopback_reference(steps: int) -> dict[str, Any]:
    """The loopback runs of configs/smollm2.toml that docs/real_model.md reports (2026-11-26, full
    fine-tunes a and b): training reward first/last, time per step, bytes per version, held-out
    at version `steps` where they were evaluated there (version 30) or the nearest below."""
    from decentrl.cli.launch import summarize

    runs = json.loads((ROOT / "docs" / "figures" / "smollm2_runs.json").read_text())
    reference = {}
    for name in ("full-a", "full-b"):
        run = runs[name]
        curve = [point for point in run["curve"] if point["step"] <= steps]
        evals = [e for e in run["evals"] if not e["greedy"] and e["version"] <= steps]
        last = max(evals, key=lambda e: e["version"]) if evals else None
        sizes = [size for version, size in run["version_bytes"].items() if 0 < int(version) <= steps]
        summary = summarize(curve)
        reference[name] = {
            "reward_first": round(summary["reward_first"], 4), "reward_last": round(summary["reward_last"], 4),
            "reward_gain": round(summary["reward_gain"], 4),
            "step_s_mean": round(curve[-1]["seconds"] / len(curve), 1) if curve else None,
            "mean_bytes_per_version": int(statistics.fmean(sizes)) if sizes else None,
            "heldout": {"version": last["version"], "reward_mean": last["reward_mean"], "stderr": last["reward_stderr"]} if last else None,
        }
    return reference


def local_manifests(url: str | Path) -> dict[int, dict[str, Any]]:
    from decentrl.store.checkpoints import CheckpointStore

    return read_manifests(CheckpointStore(str(url)))


def read_manifests(store: Any) -> dict[int, dict[str, Any]]:
    from decentrl.store.checkpoints import StoreError

    found = {}
    for version in store.versions():
        try:
            manifest = store.manifest(version)
        except StoreError:  # deleted by retention since the listing
            continue
        found[version] = {
            "created_at": manifest.created_at, "delta_base": manifest.delta_base, "whole": manifest.whole,
            "stored_bytes": sum(f.delta.size if f.delta is not None else f.size for f in manifest.files),
            "full_bytes": sum(f.size for f in manifest.files),
        }
    return found


def part_versions(spread: Spread, args: argparse.Namespace, notes: list[str], *, late: bool) -> dict[str, Any]:
    """The larger stand-in with `args.workers` workers on L1; late joiners (one per profile) once at version 20."""
    from decentrl.config import load_config

    n = args.workers
    overrides = [
        *STAND_IN, f"trainer.steps={args.version_steps}", "trainer.groups_per_step=8", "group_size=4",
        "trainer.lr=1e-5",  # an RL learning rate: deltas of the size RL makes (the demo's 1e-3 rewrites half the bytes)
        *args.store_sets,
        "sampling.max_tokens=4", "worker.groups_per_request=1", "worker.concurrency=1",
        f"simulation.latency_median_s={args.generation_s}", "simulation.latency_sigma=0",
        "store.retention_grace_s=3600",  # every version stays readable for the manifests read at the end
        "store.cache_max_gb=0.25",  # each worker's cache: a few versions, not every one (8 workers, 27 MB each)
    ]
    config = load_config(str(ROOT / "configs" / "local.toml"), overrides)
    late_hosts = [f"late_{p.lower()}" for p in args.late_profiles] if late else []
    say(f"versions: stand-in model, {n} workers on L1" + (f", late joiners on L0-L3 from version {args.late_at}" if late else ""))
    spread.control.reset()
    run = spread.start_run(config, run_name="versions", worker_hosts=[f"w{i}" for i in range(n)],
                           extra_tokens=tuple(f"late-{h[5:]}" for h in late_hosts))
    joiners: list[dict[str, Any]] = []
    stayed = {f"worker-{i}" for i in range(n // 2 if late else n)}  # the workers that run from start to end
    clock = CpuClock(lambda: {role.name: role.process.pid for role in run.roles}
                     | {"store": spread.moto.process.pid, "front": spread.front.process.pid}).__enter__()
    try:
        if late:
            spread.wait_trainer(run, args.version_timeout_s, until=lambda: run.version() >= args.late_at)
            # Half the L1 workers go (memory for the joiners: 8 workers, 4 joiners, the trainer and the
            # store's objects would pass 8 GB); the others keep pulling every version beside the joiners.
            from decentrl.cli import launch

            leaving = [role for role in run.roles if role.name in {f"worker-{i}" for i in range(n // 2, n)}]
            launch._stop(leaving)
            run.roles = [role for role in run.roles if role not in leaving]
            before, version_at_join, started = spread.control.stats()["served"], run.version(), time.time()
            names = {host: f"late-{host[5:]}" for host in late_hosts}
            for host, name in names.items():  # together: each joiner's bound counts the store's share
                spread.start_worker(run, name, host)
            spread.wait_trainer(run, args.version_timeout_s, until=lambda: time.time() - started > args.late_timeout_s
                                or all(first_rollout_at(run, name) is not None for name in names.values()))
            after = spread.control.stats()["served"]
            joiners = [{"name": name, "host": host, "version_at_join": version_at_join, "started": started,
                        "served_before": before, "served_after": after} for host, name in names.items()]
        else:
            spread.wait_trainer(run, args.version_timeout_s)
        spread.quiesce(run)
    finally:
        clock.__exit__()
        spread.stop_run(run)
    manifests = spread.manifests(run)
    hosts = {f"worker-{i}": spread.workers[f"w{i}"] for i in range(n)} | {j["name"]: spread.workers[j["host"]] for j in joiners}
    rows = version_timings(run, manifests, hosts, spread.store.link)
    for row in rows:  # what the machine's CPU did meanwhile, from the manifest to the weights loaded
        created = manifests[row["version"]]["created_at"]
        row["cpu_pressure"] = clock.pressure(created, row["loaded_at"])
        row["worker_cpu_s"] = clock.cpu_s(row["worker"], created, row["loaded_at"])
    metrics = run.metrics()
    step_s = statistics.median(m["step_s"] for m in metrics) if metrics else None
    regular = [r for r in rows if r["worker"].startswith("worker-") and r["version"] > 0]
    deltas = [r for r in regular if not r["full"]]
    fulls = [r for r in regular if r["full"]]  # a new key version, pulled by every worker at once
    served = spread.control.stats()["served"]
    split = delta_split(deltas, spread.control.timings(), hosts)
    # Per worker: bytes served to its address against the sum of S over its loads. The headline counts
    # the workers that ran from start to end: a worker stopped (or a joiner given up on) mid-pull was
    # served bytes it never loaded, which says nothing of the store.
    per_worker = {
        name: {"served": served["by_client"].get(host.ip, 0), "ideal": sum(r["bytes"] for r in rows if r["worker"] == name),
               "whole_run": name in stayed}
        for name, host in hosts.items()
    }
    for entry in per_worker.values():
        entry["ratio"] = round(entry["served"] / entry["ideal"], 3) if entry["ideal"] else None
    worker_bytes = sum(e["served"] for e in per_worker.values() if e["whole_run"])
    ideal = sum(e["ideal"] for e in per_worker.values() if e["whole_run"])
    key = [m for m in manifests.values() if is_key(m)]
    result: dict[str, Any] = {
        "workers": n, "profile": "L1", "model": " ".join(STAND_IN), "versions": len(manifests),
        "S_bytes": bytes_per_version(manifests), "step_s_median": round(step_s, 3) if step_s else None,
        "publish_s": quantiles([m["publish_s"] for m in metrics if "publish_s" in m]),
        "announce_s": quantiles([m["announce_s"] for m in metrics if "announce_s" in m]),
        "delta_efficiency": quantiles([r["efficiency"] for r in deltas]),
        "delta_measured_s": quantiles([r["measured_s"] for r in deltas]),
        "delta_bound_s": quantiles([r["bound_s"] for r in deltas]),
        "delta_announce_s": quantiles([r["announce_s"] for r in deltas]),
        "delta_within_half_step": (round(sum(r["measured_s"] <= step_s / 2 for r in deltas) / len(deltas), 3)
                                   if deltas and step_s else None),
        "full_pulls": [{k: r[k] for k in ("worker", "profile", "version", "bytes", "measured_s", "bound_s", "announce_s", "efficiency")}
                       for r in fulls],
        "store_served": {"total": served["total"], "to_whole_run_workers": worker_bytes, "ideal_to_whole_run_workers": ideal,
                         "ratio": round(worker_bytes / ideal, 3) if ideal else None,
                         "trainer_and_orchestrator": served["total"] - sum(e["served"] for e in per_worker.values()),
                         "per_worker": per_worker},
        "key_version_bytes": key[0]["full_bytes"] if key else None,
        "worst": sorted(deltas, key=lambda r: r["efficiency"] or 0)[:5],
        "delta_split_s": split,
        "cpu": cpu_figures(deltas, clock, spread.control.stats()["requests"]),
    }
    # A full version's efficiency: new key versions on the workers' own profile (timed from the
    # manifest), and each late joiner's first load (timed from its start, against its fetch bound).
    full = {p: [r["efficiency"] for r in fulls if r["profile"] == p] for p in ("L0", "L1", "L2", "L3")}
    if late:
        together = sum(next((r["bytes"] for r in rows if r["worker"] == j["name"]), 0) for j in joiners)
        result["late_joiners"] = [late_joiner(run, j, manifests, spread, rows, together, args.generation_s, clock) for j in joiners]
        for joiner in result["late_joiners"]:
            if "load_vs_bound" in joiner:
                full[joiner["profile"]].append(round(1 / joiner["load_vs_bound"], 3))
    result["full_efficiency"] = {p: quantiles(values) for p, values in full.items()}
    return result


def cpu_figures(deltas: list[dict[str, Any]], clock: CpuClock, requests: int) -> dict[str, Any]:
    """What the CPU says of the deltas: the machine's pressure over each (PSI `some`), the worker's
    own CPU seconds for it, the efficiency of the deltas pulled under less and more pressure than
    the median; and what the store (moto) and its fault front spent a request over the whole run."""
    timed_rows = [r for r in deltas if r.get("cpu_pressure") is not None]
    middle = statistics.median(r["cpu_pressure"] for r in timed_rows) if timed_rows else None
    first, last = (clock.samples[0], clock.samples[-1]) if clock.samples else (None, None)
    per_request = {name: round(1000 * (last[2][name] - first[2][name]) / requests, 2)
                   for name in ("store", "front") if first and last and requests and name in first[2] and name in last[2]}
    return {
        "pressure": quantiles([r["cpu_pressure"] for r in timed_rows]),
        "worker_cpu_s": quantiles([r["worker_cpu_s"] for r in timed_rows if r.get("worker_cpu_s") is not None]),
        "efficiency_below_median_pressure": quantiles([r["efficiency"] for r in timed_rows if r["cpu_pressure"] <= middle]),
        "efficiency_above_median_pressure": quantiles([r["efficiency"] for r in timed_rows if r["cpu_pressure"] > middle]),
        "machine_pressure_whole_run": clock.pressure(first[0], last[0]) if first and last else None,
        "cpu_ms_per_request": per_request, "requests": requests,
    }


def delta_split(deltas: list[dict[str, Any]], timed: list[list[Any]], hosts: dict[str, sn.Host]) -> dict[str, Any]:
    """Where a delta's time (announce to loaded) went, from the store front's timings of that worker's
    requests for the version's files: `before_first_request` (hearing of it, asking its manifest),
    `at_the_front` (its first request's arrival to its last byte sent: the store's answers and the
    link), `after_last_byte` (the worker's rebuild, hash and load); and the store's own time to
    answer (moto's, behind the front) over every GET of a delta version's files."""
    by_client: dict[str, list[list[Any]]] = {}
    for entry in timed:
        by_client.setdefault(entry[1], []).append(entry)
    parts: dict[str, list[float]] = {"before_first_request": [], "at_the_front": [], "after_last_byte": []}
    answers: list[float] = []
    for row in deltas:
        tags = tuple(f"/v{v:06d}/" for v in row["chain"])
        # The pull's own requests: a later pull asks this version's manifest again (as its delta base).
        mine = [e for e in by_client.get(hosts[row["worker"]].ip, [])
                if any(tag in e[2] for tag in tags) and row["seen_at"] - 1.0 <= e[0] <= row["loaded_at"]]
        if not mine:
            continue
        first, end = min(e[0] for e in mine), max(e[0] + e[4] for e in mine)
        parts["before_first_request"].append(first - row["seen_at"])
        parts["at_the_front"].append(end - first)
        parts["after_last_byte"].append(row["loaded_at"] - end)
        answers += [e[3] for e in mine]
    return {**{name: quantiles(values) for name, values in parts.items()}, "store_answer_s": quantiles(answers),
            "deltas_timed": len(parts["at_the_front"])}


def late_joiner(run: SpreadRun, joiner: dict[str, Any], manifests: dict[int, dict[str, Any]], spread: Spread,
                rows: list[dict[str, Any]], together_bytes: int, generate_s: float, clock: CpuClock) -> dict[str, Any]:
    """A late joiner, from its first log line (its imports done): to its first loaded version (the
    newest full version and the deltas since), and to its first rollout (the versions it loaded by
    then and one request's generation, `generate_s`), each against the bound for the bytes it fetched:
    max(S / d_worker, `together_bytes` (every joiner's, pulled at once) / u_store) + 3 RTTs; and the
    machine's CPU pressure and the joiner's CPU seconds over its first load (`clock`)."""
    name, host = joiner["name"], spread.workers[joiner["host"]]
    joined, first = joined_at(run, name), first_rollout_at(run, name)
    mine = [r for r in rows if r["worker"] == name]
    result: dict[str, Any] = {"name": name, "profile": profile_of(host.link), "version_at_join": joiner["version_at_join"]}
    if joined is None or not mine:
        return {**result, "error": f"loaded no version within {time.time() - joiner['started']:.0f} s (see its log)"}
    store_s = together_bytes / payload_bps(spread.store.link.up_mbit)
    rtts_s = RTTS_IN_BOUND * (host.link.rtt_ms + host.link.jitter_ms / 2) / 1000

    def bound(size: int) -> float:
        return max(size / payload_bps(host.link.down_mbit), store_s) + rtts_s

    newest_key = max((v for v in manifests if is_key(manifests[v]) and v <= joiner["version_at_join"]), default=0)
    first_load = mine[0]
    result.update(
        first_version=first_load["version"], bytes=first_load["bytes"], versions_fetched=sorted(first_load["chain"]),
        newest_key_at_join=newest_key, fetched_older_than_key=[v for v in first_load["chain"] if v < newest_key],
        load_s=round(first_load["loaded_at"] - joined, 3), load_bound_s=round(bound(first_load["bytes"]), 3),
        load_vs_bound=round((first_load["loaded_at"] - joined) / bound(first_load["bytes"]), 3),
        load_cpu_pressure=clock.pressure(joined, first_load["loaded_at"]), load_cpu_s=clock.cpu_s(name, joined, first_load["loaded_at"]),
    )
    # Objects served while the joiners joined; the workers already running fetch only newer versions.
    before, after = joiner["served_before"]["by_object"], joiner["served_after"]["by_object"]
    # Weight files only: the trainer's retention reads every kept version's manifest after each publish.
    grown = [path for path, n in after.items() if n > before.get(path, 0) and ".safetensors" in path]
    versions_served = sorted({int(m[1]) for p in grown if (m := re.search(r"/v(\d{6})/", p))})
    result["weight_versions_served_while_joining"] = versions_served
    result["served_older_than_key"] = [v for v in versions_served if v < newest_key]
    if first is None:
        return {**result, "first_rollout_s": None, "vs_bound": None,
                "error": f"no rollout within {time.time() - joiner['started']:.0f} s of its start"}
    # By its first rollout it may have loaded newer versions too (a joiner more than max_staleness
    # behind cannot generate): the bound fetches all of them, then generates one request.
    fetched = sum(r["bytes"] for r in mine if r["loaded_at"] <= first)
    first_bound = bound(fetched) + generate_s
    result.update(first_rollout_s=round(first - joined, 3), bytes_by_first_rollout=fetched, generate_s=generate_s,
                  first_rollout_bound_s=round(first_bound, 3), vs_bound=round((first - joined) / first_bound, 3))
    # After its first load, time the orchestrator leased to no one (its step's groups all in, the
    # version after not yet published: the staleness bound's gate, every worker's wait, not the
    # joiner's transfer): what the ratio is without it.
    gated = leasing_gated_s(run.statuses(), first_load["loaded_at"], first)
    result.update(lease_gate_s=round(gated, 3), vs_bound_less_lease_gate=round((first - joined - gated) / first_bound, 3))
    return result


def leasing_gated_s(statuses: list[dict[str, Any]], start: float, end: float) -> float:
    """Seconds within [start, end] the monitor saw no lease held by anyone (`leases_active` 0 between
    two samples in a row): no worker was generating, the orchestrator was leasing nothing."""
    gated = 0.0
    for before, after in zip(statuses, statuses[1:]):
        a, b = max(before["t"], start), min(after["t"], end)
        if b > a and before.get("leases_active") == 0 and after.get("leases_active") == 0:
            gated += b - a
    return gated


def announce_gap_s(link: sn.Link) -> float:
    """The announcements' spacing: long enough for the watch to have asked again after the last one
    (a round trip on its kept-alive connection; 3 on a new TCP and TLS connection, more on a loss),
    as with real versions seconds apart; a shorter gap times the re-ask, not the announcement."""
    return 0.2 + 4 * (link.rtt_ms + link.jitter_ms / 2) / 1000


def part_announce(spread: Spread, args: argparse.Namespace, notes: list[str]) -> dict[str, Any] | None:
    """announce_latencies from a probe on each profile's host; the announcements from trainer0."""
    if not (BENCHMARKS / "announce_latency.py").exists():
        notes.append("announce: benchmarks/announce_latency.py (the version long-poll's measurement) is not here yet")
        return None
    from decentrl.config import load_config

    config = load_config(str(ROOT / "configs" / "local.toml"), ["model.hidden_size=32", "model.num_layers=1",
                                                                 "model.num_heads=2", "model.intermediate_size=64"])
    run = spread.start_run(config, run_name="announce", worker_hosts=[], extra_tokens=("probe",), trainer=False)
    result: dict[str, Any] = {}
    try:
        next_version = 0
        for host_name in args.announce_hosts:
            host = spread.workers[host_name]
            profile = profile_of(host.link)
            say(f"announce: {args.announces} announcements heard on {profile}")
            argv = [sys.executable, SCRIPT, "announce-probe", spread.url, run.tokens["probe"], run.tokens["trainer"],
                    run.store_url, spread.endpoint, spread.trainers[0].ns, str(next_version), str(args.announces),
                    str(announce_gap_s(host.link))]
            done = host.run(argv, capture_output=True, text=True, env={**os.environ, **spread.env()}, timeout=600)
            if done.returncode != 0:
                raise RuntimeError(f"the announce probe on {host_name} failed: {done.stderr[-3000:]}")
            probed = json.loads(done.stdout.splitlines()[-1])
            latencies = probed["latencies"]
            next_version += args.announces
            rtt_s = host.link.rtt_ms / 1000
            result[profile] = {**quantiles([round(x, 4) for x in latencies]), "rtt_s": rtt_s, "gap_s": announce_gap_s(host.link),
                               "within_one_rtt": round(sum(x <= max(rtt_s, 0.001) for x in latencies) / len(latencies), 3),
                               "request_s": {how: quantiles([round(x, 4) for x in times]) for how, times in probed["request_s"].items()}}
    finally:
        spread.stop_run(run)
    return result


def part_leases(spread: Spread, args: argparse.Namespace, notes: list[str]) -> dict[str, Any]:
    """5 s leases, 20 s generations, 2 workers on L2 (2 slots each) through the front."""
    from decentrl.config import load_config

    config = load_config(str(ROOT / "configs" / "local.toml"), [
        "model.hidden_size=32", "model.num_layers=1", "model.num_heads=2", "model.intermediate_size=64",
        f"orchestrator.lease_timeout_s={args.lease_s}", f"simulation.latency_median_s={args.lease_generation_s}",
        "simulation.latency_sigma=0", "trainer.steps=2", "trainer.groups_per_step=8", "group_size=4",
        "worker.groups_per_request=4", "worker.concurrency=2",
    ])
    say(f"leases: {args.lease_s:g} s leases, {args.lease_generation_s:g} s generations, 2 workers on L2")
    run = spread.start_run(config, run_name="leases", worker_hosts=["l2", "l2b"])
    try:
        spread.wait_trainer(run, timeout_s=args.run_timeout_s)
        status = run.statuses()[-1]
    finally:
        spread.stop_run(run)
    return {"lease_s": args.lease_s, "generation_s": args.lease_generation_s, "workers": 2, "profile": "L2",
            "leases_lost": status["leases_expired"], "rollouts_accepted": status["rollouts_accepted"],
            "rollouts_rejected": status["rollouts_rejected"], "dropped": status.get("dropped", {}),
            "leased_twice": "none" if status["leases_expired"] == 0 and not status["rollouts_rejected"] else "see leases_lost"}


# -- helper processes (run inside a host) ------------------------------------------------------


def _monitor(url: str, token: str, out: str, interval_s: float = 0.25) -> None:
    """Until killed, every `interval_s`: GET /v1/dashboard (only what is new), one JSON line with
    its time `t`, the run's status and `accepted`, the rollouts accepted per worker token."""
    with open(out, "a") as file:
        while True:
            now = time.time()
            request = urllib.request.Request(f"{url}/v1/dashboard?since={now - 1:.3f}", headers={"Authorization": f"Bearer {token}"})
            with contextlib.suppress(OSError, ValueError):
                with urllib.request.urlopen(request, timeout=5) as answer:
                    board = json.loads(answer.read())
                accepted = {row["worker"]: row["accepted"] for row in board["workers"]}
                file.write(json.dumps({"t": now, **board["status"], "accepted": accepted}) + "\n")
                file.flush()
            time.sleep(interval_s)


def _manifests(url: str, endpoint: str) -> None:
    from decentrl.config import StoreConfig
    from decentrl.store.checkpoints import CheckpointStore

    store = CheckpointStore.from_config(StoreConfig(url=url, endpoint=endpoint, region="us-east-1"))
    print(json.dumps(read_manifests(store)))


def _announcer(trainer_token: str, url: str, store_url: str, endpoint: str) -> None:
    """On trainer0: reads lines "publish V" / "announce V" and answers "ok" when done."""
    from decentrl.api.client import OrchestratorClient
    from decentrl.config import StoreConfig
    from decentrl.store.checkpoints import CheckpointStore

    store = CheckpointStore.from_config(StoreConfig(url=store_url, endpoint=endpoint, region="us-east-1"))
    client = OrchestratorClient(url, trainer_token)
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "model.safetensors").write_bytes(os.urandom(4096))
        (Path(tmp) / "config.json").write_text("{}")
        for line in sys.stdin:
            word, version = line.split()
            if word == "publish":
                store.publish(int(version), tmp)
            else:
                client.announce(int(version))
            print("ok", flush=True)


def _announce_probe(url: str, token: str, trainer_token: str, store_url: str, endpoint: str, trainer_ns: str,
                    first: int, count: int, gap_s: float) -> None:
    """On a worker's host: announce_latencies with this host's client and trainer0's announcements."""
    from announce_latency import announce_latencies

    from decentrl.api.client import OrchestratorClient

    announcer = subprocess.Popen(
        sn._in_ns(trainer_ns, [sys.executable, SCRIPT, "announcer", trainer_token, url, store_url, endpoint]),
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )

    def ask(line: str) -> None:
        assert announcer.stdin is not None and announcer.stdout is not None
        announcer.stdin.write(line + "\n")
        announcer.stdin.flush()
        if announcer.stdout.readline().strip() != "ok":
            raise RuntimeError(f"the announcer failed at {line!r}")

    try:
        if first == 0:
            ask("publish 0")
            ask("announce 0")
            first = 1
            count -= 1
        latencies = announce_latencies(
            OrchestratorClient(url, token), lambda v: ask(f"announce {v}"), list(range(first, first + count)),
            prepare=lambda v: ask(f"publish {v}"), gap_s=gap_s,
        )
    finally:
        announcer.stdin.close()  # type: ignore[union-attr]
        announcer.wait(timeout=30)
    print(json.dumps({"latencies": latencies, "request_s": request_times(OrchestratorClient(url, token))}))


def request_times(client: Any, n: int = 10) -> dict[str, list[float]]:
    """Seconds per GET /v1/info from this host: on the client's kept-alive connection, and on a
    new TCP and TLS connection each (as decentrl's client did with urllib before 2026-11-28)."""
    client.info()  # the kept connection, opened
    times: dict[str, list[float]] = {"kept_alive": [], "new_connection": []}
    for _ in range(n):
        for how in times:
            if how == "new_connection":
                client._drop_connection()
            started = time.monotonic()
            client.info()
            times[how].append(time.monotonic() - started)
    return times


# -- main ----------------------------------------------------------------------------------------


PARTS = ("run", "versions", "late_joiner", "announce", "leases", "real")
DEFAULT_PARTS = PARTS[:-1]  # real: the real model (about 40 min), by name only


def measure(args: argparse.Namespace) -> dict[str, Any]:
    parts = set(args.parts.split(","))
    unknown = parts - set(PARTS)
    if unknown:
        raise SystemExit(f"unknown parts {sorted(unknown)}: choose from {', '.join(PARTS)}")
    notes: list[str] = []
    hosts = {"l1": "L1", "l2": "L2", "l2b": "L2", "l0": "L0", "l3": "L3"}
    if parts & {"versions", "late_joiner"}:
        hosts |= {f"w{i}": "L1" for i in range(args.workers)}
    if "late_joiner" in parts:
        hosts |= {f"late_{p.lower()}": p for p in ("L0", "L1", "L2", "L3")}  # late joiners
    workdir = tempfile.mkdtemp(prefix="spread-", dir="/tmp")  # short: the fault front's Unix socket path
    # The machine's load (1, 5, 15 min) at the start and the end: the figures are from shared cores.
    result: dict[str, Any] = {"quick": args.quick, "parts": sorted(parts), "load_average": {"start": os.getloadavg()}}
    try:
        with Spread(workdir, hosts) as spread:
            result["profiles"] = {name: vars(link) for name, link in sn.PROFILES.items()} | {"orchestrator": vars(DATACENTER)}
            result["shaping"] = spread.net.shaping
            result["topology"] = {
                "orchestrator": f"{spread.orch.ip} (orch, 1 Gbit/s): orchestrator on 127.0.0.1:{ORCH_PORT}, "
                                f"nginx TLS on :{TLS_PORT} of the same host",
                "store": f"{spread.store.ip} (store, 200 Mbit/s): moto on 127.0.0.1, fault front on :{S3_PORT}",
                "trainer": f"{spread.trainers[0].ip}, {spread.trainers[1].ip} (50 Mbit/s up): one rank each, c10d and gloo over ic0 "
                           f"{INTERCONNECT[0]}-{INTERCONNECT[1]} (unshaped)",
                "workers": {name: f"{host.ip} {profile_of(host.link)}" for name, host in spread.workers.items()},
            }
            if "run" in parts:
                run = part_run(spread, args, notes)
                result["run"] = run
                result["trainer_busy_spread"] = run["spread"].get("trainer_busy")
                result["reward_gain_spread"] = run["spread"].get("reward_gain")
                result["trainer_busy_loopback"] = (run["loopback"] or {}).get("trainer_busy")
                result["reward_gain_loopback"] = (run["loopback"] or {}).get("reward_gain")
            if parts & {"versions", "late_joiner"}:
                versions = part_versions(spread, args, notes, late="late_joiner" in parts)
                result["versions"] = versions
                result["delta_efficiency_p100"] = (versions["delta_efficiency"] or {}).get("min")
                result["full_efficiency"] = {p: (q or {}).get("min") for p, q in versions["full_efficiency"].items()}
                result["store_bytes_vs_ideal"] = versions["store_served"]["ratio"]
                if "late_joiner" in parts:
                    joiners = versions["late_joiners"]
                    result["late_joiner_vs_bound"] = {j["profile"]: j.get("vs_bound") for j in joiners}
                    result["late_joiner_vs_bound_less_lease_gate"] = {j["profile"]: j.get("vs_bound_less_lease_gate") for j in joiners}
                    result["late_joiner_fetched_older"] = {j["profile"]: j.get("served_older_than_key") for j in joiners}
            if "announce" in parts:
                announce = part_announce(spread, args, notes)
                result["announce"] = announce
                result["announce_latency_s"] = {p: {"p50": q["p50"], "max": q["max"]} for p, q in announce.items()} if announce else None
            if "leases" in parts:
                leases = part_leases(spread, args, notes)
                result["leases"] = leases
                result["leases_lost_long_generation"] = leases["leases_lost"]
            if "real" in parts:
                real = part_real(spread, args, notes)
                result["real"] = real
                result["real_model_heldout_spread"] = {v: e["reward_mean"] for v, e in real["spread"]["heldout"].items()}
                result["real_model_heldout_loopback"] = {n: (r["heldout"] or {}).get("reward_mean") for n, r in real["loopback"].items()}
            result["delayers"] = spread.net.delayer_stats()
    finally:
        result["load_average"]["end"] = os.getloadavg()
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            result["workdir"] = workdir
    for key in ("trainer_busy_spread", "trainer_busy_loopback", "reward_gain_spread", "reward_gain_loopback",
                "delta_efficiency_p100", "full_efficiency", "store_bytes_vs_ideal", "late_joiner_vs_bound",
                "announce_latency_s", "leases_lost_long_generation"):
        if result.get(key) is None:
            result[key] = None
            notes.append(f"{key}: not measured (its part was not selected or did not report)")
    result["notes"] = notes
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command")
    monitor = sub.add_parser("monitor", help="(internal) poll /v1/status into a file")
    monitor.add_argument("url")
    monitor.add_argument("token")
    monitor.add_argument("out")
    manifests = sub.add_parser("manifests", help="(internal) the manifests of a store, as JSON")
    manifests.add_argument("url")
    manifests.add_argument("endpoint")
    announcer = sub.add_parser("announcer", help="(internal) publish and announce versions read from stdin")
    for name in ("trainer_token", "url", "store_url", "endpoint"):
        announcer.add_argument(name)
    probe = sub.add_parser("announce-probe", help="(internal) announce latencies heard on this host")
    for name in ("url", "token", "trainer_token", "store_url", "endpoint", "trainer_ns"):
        probe.add_argument(name)
    probe.add_argument("first", type=int)
    probe.add_argument("count", type=int)
    probe.add_argument("gap_s", type=float)
    parser.add_argument("--quick", action="store_true", help="the reduced twin: short runs, fewer workers")
    parser.add_argument("--parts", default=",".join(DEFAULT_PARTS),
                        help=f"comma-separated, of {', '.join(PARTS)} (default: all but real)")
    parser.add_argument("--real-model", default=str(ROOT / "models" / "smollm2"), help="real part: the imported model")
    parser.add_argument("--real-steps", type=int, default=30, help="real part: trainer steps (the config's 30)")
    parser.add_argument("--real-eval-prompts", type=int, default=256, help="real part: held-out prompts (x 4 samples)")
    parser.add_argument("--real-eval-before", action="store_true", help="real part: evaluate version 0 too")
    parser.add_argument("--real-set", dest="real_sets", action="append", default=[], metavar="KEY=VALUE",
                        help="real part: a --set for its run (repeatable)")
    parser.add_argument("--workers", type=int, default=None, help="workers on L1 in the versions part (8; --quick 2)")
    parser.add_argument("--no-loopback", dest="loopback", action="store_false", help="run part: skip the loopback run")
    parser.add_argument("--keep", action="store_true", help="keep the work directory (logs, run dirs)")
    parser.add_argument("--store-set", dest="store_sets", action="append", default=[], metavar="KEY=VALUE",
                        help="versions part: a --set for the stand-in run, e.g. store.part_mb=1 (repeatable)")
    args = parser.parse_args()
    if args.command == "monitor":
        _monitor(args.url, args.token, args.out)
    elif args.command == "manifests":
        _manifests(args.url, args.endpoint)
    elif args.command == "announcer":
        _announcer(args.trainer_token, args.url, args.store_url, args.endpoint)
    elif args.command == "announce-probe":
        _announce_probe(args.url, args.token, args.trainer_token, args.store_url, args.endpoint, args.trainer_ns,
                        args.first, args.count, args.gap_s)
    else:
        if reason := sn.unavailable_reason():
            raise SystemExit(f"spread: {reason}")
        quick = args.quick
        args.workers = args.workers or (2 if quick else 8)
        args.run_steps = 20 if quick else 150
        args.run_timeout_s = 300 if quick else 900
        args.version_steps = 20 if quick else 60  # the run stops once the late joiners have served
        args.version_timeout_s = 300 if quick else 1200
        args.generation_s = 2.0 if quick else 5.0
        args.late_at = 4 if quick else 20
        args.late_profiles = ["L1"] if quick else ["L0", "L1", "L2", "L3"]
        args.late_timeout_s = 120 if quick else 240
        args.announces = 10 if quick else 40
        args.announce_hosts = ["l1"] if quick else ["l0", "l1", "l2", "l3"]
        args.lease_s, args.lease_generation_s = (5.0, 20.0)
        args.real_timeout_s = 3600
        print(json.dumps(measure(args)))


if __name__ == "__main__":
    main()
