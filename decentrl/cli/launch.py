"""`decentrl run`: every role on this machine as separate processes, with live progress.

Resolves the config (store URL, port) into RUN_DIR/config.json and starts the orchestrator,
then the trainer (torchrun, `trainer_ranks` processes), the workers and the scorers (`num_scorers`,
for model rewards: docs/rewards.md), each given that file:
settings are never re-spelled as flags, only who a process is, where it connects and where it
keeps its files (`orchestrator_command`, `trainer_command`, `worker_command`; benchmarks start
roles with them too). [placement] (decentrl/config/placement.py) adds, per placed process, its
CUDA_VISIBLE_DEVICES and the `--set` of its device and memory share (`role_starts`); whether this
machine has those GPUs is checked before any role starts (decentrl/model/devices.py). The roles talk only over
loopback HTTP and the checkpoint store. Each role
runs in its own process group, so stopping one stops its children too (torchrun's ranks). The
run ends when the trainer finishes its steps; Ctrl-C or any role exiting early stops everything.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from rich.console import Console
from rich.live import Live
from rich.markup import escape
from rich.table import Table

from decentrl.config import Placed, RunConfig
from decentrl.model.devices import available_gpus, needs_cuda, placement_problem, roles_line
from orchestrator.auth import add_token

console = Console(soft_wrap=True)  # the run's progress
errors = Console(soft_wrap=True, stderr=True)  # what went wrong, and roles that exited: stderr, as every role says its errors
PR_SET_PDEATHSIG = 1
# The progress line's rollouts/s: accepted over the last minute. A worker of a real model posts
# a request's groups at once, every 20 s or so on a CPU, so a short window mostly reads 0.
RATE_WINDOW_S = 60.0


@dataclass
class Role:
    name: str
    process: subprocess.Popen[bytes]
    log_path: str
    log: IO[bytes]


def _die_with_parent() -> None:
    """In the child: get SIGTERM if the launcher dies, even by SIGKILL (Linux)."""
    if sys.platform == "linux":
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (for a server started next; tests and benchmarks use it too)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _start(name: str, argv: list[str], run_dir: Path, env: dict[str, str]) -> Role:
    log_path = run_dir / "logs" / f"{name}.log"
    log = open(log_path, "ab")
    process = subprocess.Popen(
        argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        env={**os.environ, **env}, start_new_session=True, preexec_fn=_die_with_parent,
    )
    return Role(name, process, str(log_path), log)


def descendants(pid: int) -> list[int]:
    """Every live process below `pid` (Linux /proc): torchrun starts its ranks in sessions of
    their own, so a process-group signal to torchrun does not reach them."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parent = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(parent, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def running(pid: int) -> bool:
    """Whether `pid` runs: alive, and not a zombie waiting to be reaped (Linux /proc)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def kill_all(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _stop(roles: list[Role], grace_s: float = 10.0) -> None:
    """Stop roles: every one but the orchestrator at once (each talks only to it), then the
    orchestrator, so no role spends its grace period retrying a peer that is already gone. SIGTERM
    to each role's process group, up to `grace_s` for them all, then SIGKILL to the group and to
    every process below the role that is left."""
    for group in ([r for r in roles if r.name != "orchestrator"], [r for r in roles if r.name == "orchestrator"]):
        trees = [descendants(role.process.pid) for role in group]
        for role in group:
            if role.process.poll() is None:
                os.killpg(role.process.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for role in group:
            try:
                role.process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for role, tree in zip(group, trees, strict=True):
            try:
                os.killpg(role.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            kill_all(tree)
            role.process.wait()
            role.log.close()


def orchestrator_command(config_path: Path, run_dir: Path) -> list[str]:
    return [sys.executable, "-m", "decentrl", "orchestrator", str(config_path), "--run-dir", str(run_dir)]


def _sets(overrides: Sequence[str]) -> list[str]:
    return [arg for item in overrides for arg in ("--set", item)]


def trainer_command(config_path: Path, run_dir: Path, url: str, ranks: int, *, overrides: Sequence[str] = ()) -> list[str]:
    """torchrun (its SIGTERM a clean stop: decentrl/trainer/torchrun.py) with `ranks` trainer processes;
    `overrides`: `--set` items (a placement's memory share)."""
    return [
        sys.executable, "-m", "decentrl.trainer.torchrun", "--standalone", f"--nproc-per-node={ranks}",
        "-m", "decentrl", "trainer", str(config_path), "--orchestrator", url, "--run-dir", str(run_dir),
        *_sets(overrides),
    ]


def worker_command(config_path: Path, run_dir: Path, url: str, worker_id: str, *, overrides: Sequence[str] = ()) -> list[str]:
    """One local worker: the resolved config, its name, and its own cache under the run dir;
    `overrides`: `--set` items (a placement's device and memory share)."""
    return [
        sys.executable, "-m", "decentrl", "worker", "--orchestrator", url, "--config", str(config_path),
        "--worker-id", worker_id, "--cache-dir", str(run_dir / "cache" / worker_id), *_sets(overrides),
    ]


def scorer_command(config_path: Path, url: str, scorer_id: str, *, overrides: Sequence[str] = ()) -> list[str]:
    """One local scorer: the resolved config (its [scorer] section) and its name; `overrides`: `--set` items."""
    return [
        sys.executable, "-m", "decentrl", "scorer", "--orchestrator", url, "--config", str(config_path),
        "--scorer-id", scorer_id, *_sets(overrides),
    ]


@dataclass(frozen=True)
class RoleStart:
    """How `decentrl run` starts one role: its name, argv and environment (on top of the launcher's)."""

    name: str
    argv: list[str]
    env: dict[str, str]


def role_starts(config: RunConfig, config_path: Path, run_dir: Path, url: str, tokens: dict[str, str]) -> list[RoleStart]:
    """The trainer, the workers and the scorers, in start order, each with its token (`tokens` by
    role name) and, when [placement] puts it on GPUs, its CUDA_VISIBLE_DEVICES and the `--set` of
    its device and memory share; a process left unplaced starts exactly as without [placement]."""
    places = config.processes()
    trainer = places["trainer"]
    # A run of two policies: a trainer per policy (trainer-proposer, trainer-solver), the workers split between them.
    starts = [RoleStart(
        "trainer" if policy is None else f"trainer-{policy}",
        trainer_command(config_path, run_dir, url, config.trainer_ranks, overrides=[
            *_placed_sets("trainer", trainer, device=False), *([f"trainer.policy={policy}"] if policy else []),
        ]),
        {"DECENTRL_TOKEN": tokens["trainer"], "OMP_NUM_THREADS": str(config.trainer.torch_threads), **_placed_env(trainer)},
    ) for policy in config.policies or (None,)]
    for i in range(config.num_workers):
        name, place = f"worker-{i}", places[f"worker-{i}"]
        policy = [f"worker.policy={config.policies[i % len(config.policies)]}"] if config.policies else []
        starts.append(RoleStart(
            name, worker_command(config_path, run_dir, url, name, overrides=[*_placed_sets("worker", place), *policy]),
            {"DECENTRL_TOKEN": tokens[name], "OMP_NUM_THREADS": str(config.worker.torch_threads), **_placed_env(place)},
        ))
    for i in range(config.num_scorers):
        name, place = f"scorer-{i}", places[f"scorer-{i}"]
        starts.append(RoleStart(
            name, scorer_command(config_path, url, name, overrides=_placed_sets("scorer", place)),
            {"DECENTRL_TOKEN": tokens[name], "OMP_NUM_THREADS": "1", **_placed_env(place)},
        ))
    return starts


def _placed_env(place: Placed) -> dict[str, str]:
    return {"CUDA_VISIBLE_DEVICES": place.visible_devices} if place.gpus else {}


def _placed_sets(section: str, place: Placed, *, device: bool = True) -> list[str]:
    """The role's settings a placement decides: cuda (its one visible GPU) and its memory share.
    The trainer has no device key: each rank takes cuda:LOCAL_RANK (decentrl/trainer/distributed.py)."""
    if not place.gpus:
        return []
    return [*([f"{section}.device=cuda"] if device else []), f"{section}.gpu_memory={place.memory}"]


def _check_roles(config: RunConfig, roles: list[Role], exited: set[str]) -> None:
    """Raise if a role died; a dead worker (or scorer) is only reported when the config tolerates it."""
    for role in roles:
        code = role.process.poll()
        if code is None or role.name in exited or (role.name.startswith("trainer") and code == 0):
            continue
        kind = role.name.split("-")[0]  # worker-3 -> worker, scorer-1 -> scorer
        left = [r for r in roles if r.name.startswith(f"{kind}-") and r.process.poll() is None]
        if kind in ("worker", "scorer") and config.tolerate_worker_exits and left:
            errors.print(f"[yellow]{role.name} exited with code {code}; {len(left)} {kind}(s) carry on[/]")
            exited.add(role.name)
            continue
        raise RuntimeError(
            f"{role.name} exited with code {code}; stopping every role. "
            f"Last lines of {role.log_path}:\n{_tail(role.log_path)}"
        )


def _tail(path: str, lines: int = 15) -> str:
    return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])


def _get_json(url: str, token: str) -> dict[str, object] | None:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(request, timeout=2) as response:
            return json.loads(response.read())
    except OSError:
        return None


def _read_metrics(path: Path) -> list[dict[str, object]]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _table(config: RunConfig, metrics: list[dict], status: dict | None, rollouts_per_s: float, elapsed: float) -> Table:
    last = metrics[-1] if metrics else {}
    table = Table(title=f"decentrl run {config.run_name}  ({elapsed:.0f}s)", show_header=True)
    for column in ("step", "policy version", "reward mean", "rollouts/s", "trainer busy %", "stale dropped"):
        table.add_column(column, justify="right")
    table.add_row(
        f"{last.get('step', 0)}/{config.trainer.steps}",
        str(status.get("policy_version") if status else "-"),
        f"{last['reward_mean']:.3f}" if last else "-",
        f"{rollouts_per_s:.0f}",
        f"{100 * last['trainer_busy_fraction_total']:.0f}" if last else "-",
        str(status.get("stale_dropped") if status else "-"),
    )
    return table


def summarize(metrics: list[dict[str, object]], window: int = 10) -> dict[str, float]:
    """The mean reward of the first and of the last `window` steps; in a run of fewer than twice
    `window` steps, of its first and last halves, which never overlap (a shared window hid a gain)."""
    rewards = [float(m["reward_mean"]) for m in metrics]
    if not rewards:
        return {"steps": 0, "window": 0, "reward_first": 0.0, "reward_last": 0.0, "reward_gain": 0.0}
    n = max(1, min(window, len(rewards) // 2))
    first, last = sum(rewards[:n]) / n, sum(rewards[-n:]) / n
    return {"steps": len(rewards), "window": n, "reward_first": first, "reward_last": last, "reward_gain": last - first}


def launch(config: RunConfig, run_dir_arg: str | None) -> int:
    run_dir = Path(run_dir_arg or f"runs/{config.run_name}-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    if (run_dir / "metrics.jsonl").exists():
        errors.print(f"[red]error:[/] {run_dir} already holds a run; pass another --run-dir")
        return 2
    problem = placement_problem(config, available_gpus()) if needs_cuda(config) else None
    if problem:
        errors.print("[red]error:[/]", escape(problem))  # its "[0, 1]" lists are text, not markup
        return 2
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    if not config.store.url:
        config = config.with_store_url(str(run_dir / "checkpoints"))
    port = config.orchestrator.port or free_port()
    config = config.model_copy(update={"orchestrator": config.orchestrator.model_copy(update={"port": port})})
    config_path = run_dir / "config.json"
    config_path.write_text(config.model_dump_json(indent=2))
    tokens_path = str(run_dir / "tokens.json")
    trainer_token = add_token(tokens_path, name="trainer", role="trainer")
    tokens = {
        "trainer": trainer_token,
        **{f"worker-{i}": add_token(tokens_path, name=f"worker-{i}", role="worker") for i in range(config.num_workers)},
        **{f"scorer-{i}": add_token(tokens_path, name=f"scorer-{i}", role="scorer") for i in range(config.num_scorers)},
    }
    url = f"http://127.0.0.1:{port}"
    roles: list[Role] = []
    console.print(f"run dir: {run_dir}\norchestrator: {url}  store: {config.store.url}")
    console.print(roles_line(config), markup=False)
    console.print(f"dashboard: {url}/  (asks for a token: any in {tokens_path})", markup=False)
    try:
        roles.append(_start("orchestrator", orchestrator_command(config_path, run_dir), run_dir, {}))
        deadline = time.monotonic() + 120
        while _get_json(f"{url}/v1/status", trainer_token) is None:
            if roles[0].process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"orchestrator did not start; last lines of {roles[0].log_path}:\n{_tail(roles[0].log_path)}")
            time.sleep(0.3)
        for start in role_starts(config, config_path, run_dir, url, tokens):
            roles.append(_start(start.name, start.argv, run_dir, start.env))
        return _watch(config, run_dir, roles, url, trainer_token)
    except KeyboardInterrupt:
        errors.print("[yellow]interrupted: stopping every role[/]")
        return 130
    except RuntimeError as exc:
        errors.print(f"[red]error:[/] {exc}")
        return 1
    finally:
        _stop(roles)


def _progress_line(config: RunConfig, record: dict, status: dict | None, rollouts_per_s: float) -> str:
    return (
        f"step {record['step']}/{config.trainer.steps}  version {record['policy_version']}  "
        f"reward {record['reward_mean']:.3f}  rollouts/s {rollouts_per_s:.0f}  "
        f"trainer busy {100 * record['trainer_busy_fraction_total']:.0f}%  "
        f"stale dropped {status['stale_dropped'] if status else record['stale_dropped']}"
    )


def _watch(config: RunConfig, run_dir: Path, roles: list[Role], url: str, token: str) -> int:
    """Poll roles, status and metrics once a second; a live table on a terminal, else a line a step."""
    started = time.monotonic()
    metrics_path = run_dir / ("metrics-solver.jsonl" if config.policies else "metrics.jsonl")  # two policies: the solver's
    samples: list[tuple[float, int]] = []  # (time, rollouts accepted) over the last RATE_WINDOW_S
    trainers = [role for role in roles if role.name.startswith("trainer")]
    live = Live(console=console, refresh_per_second=2) if console.is_terminal else None
    printed, exited = 0, set[str]()
    with live or contextlib.nullcontext():
        while True:
            _check_roles(config, roles, exited)
            status = _get_json(f"{url}/v1/status", token)
            now = time.monotonic()
            if status is not None:
                samples = [s for s in samples if now - s[0] < RATE_WINDOW_S] + [(now, int(status["rollouts_accepted"]))]
            rate = (samples[-1][1] - samples[0][1]) / (samples[-1][0] - samples[0][0]) if len(samples) > 1 else 0.0
            metrics = _read_metrics(metrics_path)
            if live is not None:
                live.update(_table(config, metrics, status, rate, now - started))
            else:
                for record in metrics[printed:]:
                    console.print(_progress_line(config, record, status, rate))
                printed = len(metrics)
            if all(trainer.process.poll() == 0 for trainer in trainers):
                # The orchestrator's final counters, for benchmarks and post-mortems.
                (run_dir / "status.json").write_text(json.dumps(_get_json(f"{url}/v1/status", token) or status, indent=2))
                break
            time.sleep(1.0)
    summary = {**summarize(metrics), "wall_s": time.monotonic() - started}
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    console.print(
        f"done in {summary['wall_s']:.0f}s: mean reward of the first {summary['window']} steps "
        f"{summary['reward_first']:.3f}, of the last {summary['window']} {summary['reward_last']:.3f} "
        f"(gain {summary['reward_gain']:+.3f})"
    )
    console.print(f"run dir: {run_dir} (config.json, logs/, metrics.jsonl, checkpoints/, summary.json)")
    return 0
