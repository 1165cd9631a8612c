"""Asynchronous vs synchronous training, measured side by side with the real system.

Each scenario runs `decentrl run` twice with the same task, model, worker pool and seeds:
max_staleness = 0 (synchronous, on-policy) and max_staleness = --async-staleness. Workers
generate for real; on top, each request is held back by a log-normal delay (median
--latency-median-s, sigma --latency-sigma: the config's [simulation], workers/simulation.py)
that stands for long reasoning traces on the workers' own accelerators. Scenarios:
  base           the pool as configured
  slow_worker    worker-0 ten times slower than the rest
  killed_worker  worker-1 SIGKILLed after a third of the steps (its leases expire and are
                 leased again; the run tolerates the loss)

Each pair of runs is repeated for --seeds seeds (trainer.seed = simulation.seed = 0, 1, ...): figures are means over
the seeds, the per-seed figures are kept under
"seeds". Reward is compared at equal steps and at equal wall time (when the fastest run
finished), two ways: the rewards of the training batches (the last 10 steps; the smoothed
curve), and an evaluation of the policy itself (workers/evaluate.py, as `decentrl eval`: the
final version, and the newest version at that wall time, on --eval-prompts held-out prompts x
--eval-samples samples). The evaluation is the fair one: an asynchronous run's last batches were
sampled by policies up to max_staleness versions older than its final one. A comma list for
--async-staleness adds one asynchronous run per value. --deterministic adds "async_deterministic":
the asynchronous run again with deterministic = true (docs/reproducibility.md), same seeds, and
reports its trainer busy fraction and time to target against the free-running one
("deterministic_cost"; the goal is busy within 0.05), with its hedging as configured or as
--hedge-after, --max-copies, --hedge-batches, --no-hedging set it (orchestrator/lease_policy.py). --skip-sync leaves the synchronous run out
(its figures and ratios are then null), for measuring only that cost.

What the staleness rule throws away (docs/trainer.md): every run reports "length_bias", from the
trainer's metrics.jsonl - the samples dropped as stale over the run against those trained, their
counts and sample-weighted mean completion length and reward, and the gaps against the batch of
the same step. The toy task's generation time hardly grows with length, so
--latency-per-token-s adds a delay per completion token a request produced (simulation.
latency_per_token_s) and --max-tokens lets lengths vary; long completions then finish late, as
real reasoning traces do. --keep-late K adds "async_keep_late": the first asynchronous run again
with orchestrator.keep_late = K, and "keep_late_effect" holds its bias, drops and held-out final
reward against the run without. Every run also reports the
trainer's compute and wait per step (after the first batch): on a machine where the workers'
generation shares the trainer's cores, a trainer slowed by it looks busier. And the machine's
load over the same window: `cores_busy`, the cores the run's processes kept busy, and
`cpu_s_by_role`, each role's CPU seconds (sampled from /proc: Linux). --pin-trainer gives
the trainer core 0 and every other role the remaining cores, as a deployment gives the trainer
its own accelerator.

Writes one PNG per scenario (reward vs wall time; trainer busy/idle timeline of the first seed)
and prints, as its last line, one JSON object: the base scenario's {"sync", "async",
"time_to_target_ratio"} plus every scenario under "scenarios".

    .venv/bin/pip install -e ".[bench]"
    .venv/bin/python benchmarks/async_vs_sync.py --scenarios base --seeds 3 --async-staleness 2,3 --out docs/figures
    .venv/bin/python benchmarks/async_vs_sync.py --scenarios slow_worker,killed_worker --steps 60 --out docs/figures
    .venv/bin/python benchmarks/async_vs_sync.py --scenarios base --seeds 2 --async-staleness 2 --keep-late 2 --skip-sync \
        --max-tokens 16 --latency-per-token-s 0.02 --out docs/figures
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_label(scenario: str, max_staleness: int, deterministic: bool, keep_late: int) -> str:
    return f"{scenario}-s{max_staleness}{'-det' if deterministic else ''}{f'-k{keep_late}' if keep_late else ''}"


def scenario_config(
    args: argparse.Namespace, scenario: str, max_staleness: int, seed: int, deterministic: bool, keep_late: int = 0
) -> dict:
    config = tomllib.loads((ROOT / "configs" / "local.toml").read_text())
    config.update(
        run_name=run_label(scenario, max_staleness, deterministic, keep_late), max_staleness=max_staleness,
        num_workers=args.workers, deterministic=deterministic, seed=seed,
    )
    config["trainer"].update(steps=args.steps, seed=seed, **({"lr": args.lr} if args.lr else {}))
    config["orchestrator"].update(lease_timeout_s=args.lease_timeout_s, keep_late=keep_late)
    if deterministic:  # hedging (orchestrator/lease_policy.py) acts in deterministic runs only
        config["orchestrator"]["hedging"] = {
            "enabled": not args.no_hedging, **({"after": args.hedge_after} if args.hedge_after else {}),
            **({"max_copies": args.max_copies} if args.max_copies else {}),
            **({"batches": args.hedge_batches} if args.hedge_batches else {}),
        }
    config["store"].update(keep_last=args.steps + 1)  # every version stays, to be evaluated afterwards
    config["worker"].update(groups_per_request=1, concurrency=args.slots)
    if args.max_tokens:
        config["sampling"].update(max_tokens=args.max_tokens)
    config["simulation"] = {
        "latency_median_s": args.latency_median_s,
        "latency_sigma": args.latency_sigma,
        "latency_per_token_s": args.latency_per_token_s,  # long completions late, as real traces are
        "seed": seed,  # the delays differ from seed to seed, as the trainer's randomness does
        "slowdowns": {"worker-0": 10.0} if scenario == "slow_worker" else {},
    }
    if scenario == "killed_worker":
        config["tolerate_worker_exits"] = True
    return config


def run_processes(run_dir: Path) -> Iterator[tuple[Path, list[bytes]]]:
    """The run's processes (Linux /proc): each one's /proc entry and command line."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:  # ended meanwhile
                continue
            if str(run_dir).encode() in b" ".join(cmdline):
                yield entry, cmdline


def role_pids(run_dir: Path, *args: str) -> list[int]:
    """The run's processes whose command line has every one of `args`."""
    return [int(entry.name) for entry, cmdline in run_processes(run_dir) if all(arg.encode() in cmdline for arg in args)]


def worker_pid(run_dir: Path, name: str) -> int | None:
    return next(iter(role_pids(run_dir, "worker", name)), None)


class RoleCpu:
    """CPU seconds of a run's processes by role (Linux /proc), sampled as the run goes, over the
    window from the trainer's first step to its last: on a machine where every role shares the
    cores, `cores_busy` near the core count means copies of work can only come out of another
    role's time. A process's CPU after its last sample (at most one poll) is not counted."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.seen: dict[int, tuple[str, float]] = {}  # pid -> (role, CPU seconds so far)
        self.marks: list[tuple[float, dict[str, float]]] = []  # (time, CPU seconds by role)

    def sample(self) -> None:
        ticks = os.sysconf("SC_CLK_TCK")
        for entry, cmdline in run_processes(self.run_dir):
            if b"decentrl" not in cmdline[:-1]:
                continue
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:  # ended meanwhile
                continue
            role = cmdline[cmdline.index(b"decentrl") + 1].decode(
                errors="replace"
            )  # run, orchestrator, trainer (torchrun and ranks), worker, ...
            self.seen[int(entry.name)] = (role, (int(fields[11]) + int(fields[12])) / ticks)  # utime + stime

    def mark(self) -> None:
        """One end of the window: now, and the CPU seconds by role so far."""
        totals: dict[str, float] = {}
        for role, seconds in self.seen.values():
            totals[role] = totals.get(role, 0.0) + seconds
        self.marks.append((time.time(), totals))

    def window(self) -> dict:
        (t0, start), (t1, end) = self.marks[0], self.marks[-1]
        used = {role: round(seconds - start.get(role, 0.0), 2) for role, seconds in end.items()}
        return {"cpu_s_by_role": used, "cores_busy": sum(used.values()) / (t1 - t0) if t1 > t0 else None}


TRAINER_CPUS = {0}  # --pin-trainer: the trainer's core; the run's other processes get the rest


def pin_trainer(run_dir: Path) -> None:
    """Every thread of the run's trainer processes (torchrun and its ranks) on TRAINER_CPUS."""
    for pid in role_pids(run_dir, "trainer"):
        for task in Path(f"/proc/{pid}/task").glob("*"):
            try:
                os.sched_setaffinity(int(task.name), TRAINER_CPUS)
            except OSError:  # the thread ended meanwhile
                pass


def run_once(
    args: argparse.Namespace, scenario: str, max_staleness: int, seed: int, work: Path, deterministic: bool = False,
    keep_late: int = 0,
) -> dict:
    name = f"{run_label(scenario, max_staleness, deterministic, keep_late)}-seed{seed}"
    run_dir = work / name
    config_path = work / f"{name}.json"
    config_path.write_text(json.dumps(scenario_config(args, scenario, max_staleness, seed, deterministic, keep_late)))
    log = open(work / f"{name}.out", "w")
    others = set(range(os.cpu_count() or 1)) - TRAINER_CPUS
    process = subprocess.Popen(
        [sys.executable, "-m", "decentrl", "run", str(config_path), "--run-dir", str(run_dir)],
        stdout=log, stderr=subprocess.STDOUT,
        # --pin-trainer: every role starts on the other cores; the trainer is moved to its own below.
        preexec_fn=(lambda: os.sched_setaffinity(0, others)) if args.pin_trainer else None,
    )
    killed_at = None
    cpu = RoleCpu(run_dir)
    while process.poll() is None:
        time.sleep(0.5)
        steps_done = len(read_metrics(run_dir))
        if len(cpu.marks) < 2:
            cpu.sample()
            if (steps_done >= 1 and not cpu.marks) or steps_done >= args.steps:
                cpu.mark()
        if args.pin_trainer:
            pin_trainer(run_dir)  # again every poll: threads started since are pinned too
        if scenario == "killed_worker" and killed_at is None:
            pid = worker_pid(run_dir, "worker-1")
            if steps_done >= args.steps // 3 and pid is not None:
                os.kill(pid, signal.SIGKILL)
                killed_at = time.time()
    if process.returncode != 0:
        raise SystemExit(f"{name} failed: see {log.name}")
    if scenario == "killed_worker" and killed_at is None:
        raise SystemExit(f"{name}: worker-1 was never killed (the run ended first); try more --steps. See {log.name}")
    result = summarize(args, read_metrics(run_dir), json.loads((run_dir / "status.json").read_text()), killed_at)
    result["run_dir"] = str(run_dir)
    result.update(cpu.window() if len(cpu.marks) == 2 else {"cpu_s_by_role": {}, "cores_busy": None})
    result["copies_abandoned"] = copies_abandoned(run_dir)
    result["eval_final"] = final = evaluate_version(args, run_dir, args.steps)
    result["eval_final_reward"], result["eval_final_stderr"] = final["reward_mean"], final["reward_stderr"]
    return result


def evaluate_version(args: argparse.Namespace, run_dir: Path, version: int) -> dict:
    """`decentrl eval` of one version of the run, on held-out prompts, with the run's sampling.
    The version is pulled (verified; a delta version rebuilt from its base), as workers pull it."""
    from decentrl.config import load_config
    from decentrl.store.checkpoints import CheckpointStore
    from workers.evaluate import evaluate

    config = load_config(str(run_dir / "config.json"))
    checkpoint = CheckpointStore(str(run_dir / "checkpoints")).pull(version, str(run_dir / "eval-cache"))
    figures = evaluate(config, checkpoint, version, prompts=args.eval_prompts, samples_per_prompt=args.eval_samples)
    return figures.as_dict()


def version_at(result: dict, t: float) -> int:
    """The newest version the trainer had made by wall time `t` (version N after step N, published
    moments later in the background)."""
    return sum(1 for s in result["curve"]["t"] if s <= t)


def copies_abandoned(run_dir: Path) -> int:
    """Losing hedge copies the workers abandoned when told (their exit lines, workers/worker.py);
    a killed worker logs none."""
    return sum(
        int(count) for log in (run_dir / "logs").glob("worker-*.log")
        for count in re.findall(r"(\d+) lost copies abandoned", log.read_text(errors="replace"))
    )


def read_metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def summarize(args: argparse.Namespace, metrics: list[dict], status: dict, killed_at: float | None) -> dict:
    start = metrics[0]["time"] - metrics[0]["step_s"]  # the trainer asks for its first batch
    times = [m["time"] - start for m in metrics]
    rewards = [m["reward_mean"] for m in metrics]
    window = args.smooth
    smoothed = [sum(rewards[max(0, i - window + 1): i + 1]) / len(rewards[max(0, i - window + 1): i + 1]) for i in range(len(rewards))]
    reached = next((t for t, r in zip(times, smoothed) if r >= args.target), None)
    histogram: dict[str, int] = {}
    for m in metrics:
        for lag, count in m["staleness_histogram"].items():
            histogram[lag] = histogram.get(lag, 0) + count
    generated = status["rollouts_accepted"] + sum(status["rollouts_rejected"].values())
    later = metrics[1:]  # the first batch also waits for the workers to start and load version 0
    return {
        "trainer_busy_fraction": metrics[-1]["trainer_busy_fraction_total"],
        "trainer_busy_fraction_after_first_batch": 1 - sum(m["wait_for_batch_s"] for m in later) / sum(m["step_s"] for m in later),
        # What the busy fraction divides: a trainer slowed by the workers' CPU looks busier.
        "trainer_compute_s_per_step": sum(m["step_s"] - m["wait_for_batch_s"] for m in later) / len(later),
        "trainer_wait_s_per_step": sum(m["wait_for_batch_s"] for m in later) / len(later),
        "first_batch_wait_s": metrics[0]["wait_for_batch_s"],
        "samples_per_s": sum(m["samples"] for m in metrics) / times[-1],
        "time_to_target_s": reached,
        "wall_s": times[-1],
        "final_reward": sum(rewards[-10:]) / len(rewards[-10:]),
        "final_entropy": sum(m["entropy"] for m in metrics[-10:]) / len(metrics[-10:]),  # the trainer policy's, per completion token
        "stale_dropped_fraction": status["stale_dropped"] / generated if generated else 0.0,
        "staleness_histogram": dict(sorted(histogram.items(), key=lambda kv: int(kv[0]))),
        "leases_expired": status["leases_expired"],
        "hedged_leases": status.get("hedged_leases", 0),  # deterministic runs: second leases of lagging places
        "hedge_duplicates": status.get("hedge_duplicates", 0),
        "hedge_mismatches": status.get("hedge_mismatches", 0),
        "hedge_copies_told": status.get("hedge_copies_told", 0),  # losing copies whose workers were told to stop
        "worker_killed_at_s": killed_at - start if killed_at else None,
        "length_bias": length_bias(metrics),
        "curve": {"t": times, "reward": rewards, "smoothed": smoothed},
        "timeline": [(m["time"] - start - m["step_s"], m["wait_for_batch_s"], m["step_s"] - m["wait_for_batch_s"]) for m in metrics],
    }


def length_bias(metrics: list[dict]) -> dict:
    """What the staleness rule threw away against what trained, over the run (the trainer's
    metrics.jsonl: each batch's completion_length_mean and reward_mean, and its stale_report of
    the samples dropped as stale since the previous batch), weighted by samples. Completions
    shorten as a policy learns, so the run-wide means mix early and late steps; the `*_gap_same_step`
    figures compare each step's dropped samples with the batch of that step, weighted by the
    dropped samples: a positive length gap means the rule dropped longer completions than it kept."""
    trained = sum(m["samples"] for m in metrics)
    dropped = [m for m in metrics if m["stale_report_samples"]]
    n_dropped = sum(m["stale_report_samples"] for m in dropped)
    # A group dropped before its rewards (a sample stale at ingest, a group awaiting scores) has none.
    rewarded = [m for m in dropped if m["stale_report_reward_mean"] is not None]
    n_rewarded = sum(m["stale_report_samples"] for m in rewarded)

    def weighted(rows: list[dict], value: str, weight: str) -> float | None:
        total = sum(m[weight] for m in rows)
        return sum(m[value] * m[weight] for m in rows) / total if total else None

    return {
        "trained_samples": trained,
        "trained_length_mean": weighted(metrics, "completion_length_mean", "samples"),
        "trained_reward_mean": weighted(metrics, "reward_mean", "samples"),
        "dropped_samples": n_dropped,
        "dropped_length_mean": weighted(dropped, "stale_report_length_mean", "stale_report_samples"),
        "dropped_rewarded_samples": n_rewarded,  # of steps whose report has a reward: an upper bound
        "dropped_reward_mean": weighted(rewarded, "stale_report_reward_mean", "stale_report_samples"),
        "length_gap_same_step": (
            sum((m["stale_report_length_mean"] - m["completion_length_mean"]) * m["stale_report_samples"] for m in dropped)
            / n_dropped if n_dropped else None
        ),
        "reward_gap_same_step": (
            sum((m["stale_report_reward_mean"] - m["reward_mean"]) * m["stale_report_samples"] for m in rewarded)
            / n_rewarded if n_rewarded else None
        ),
    }


def pool_length_bias(biases: list[dict]) -> dict:
    """Several runs' `length_bias` as if one run: counts summed, means weighted by their counts."""
    weights = {
        "trained_length_mean": "trained_samples", "trained_reward_mean": "trained_samples",
        "dropped_length_mean": "dropped_samples", "length_gap_same_step": "dropped_samples",
        "dropped_reward_mean": "dropped_rewarded_samples", "reward_gap_same_step": "dropped_rewarded_samples",
    }
    pooled: dict = {count: sum(b[count] for b in biases) for count in set(weights.values())}
    for key, count in weights.items():
        rows = [b for b in biases if b[key] is not None]
        total = sum(b[count] for b in rows)
        pooled[key] = sum(b[key] * b[count] for b in rows) / total if total else None
    return {key: pooled[key] for key in biases[0]}  # the runs' order of keys


def reward_at(result: dict, t: float) -> float:
    """The smoothed reward of the last step finished by wall time `t`."""
    curve = result["curve"]
    return next((r for s, r in zip(reversed(curve["t"]), reversed(curve["smoothed"])) if s <= t), curve["smoothed"][0])


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


def aggregate(runs: list[dict]) -> dict:
    """Means over seeds of one mode's figures; time to target only if every seed reached it."""
    first = runs[0]
    histogram: dict[str, int] = {}
    for run in runs:
        for lag, count in run["staleness_histogram"].items():
            histogram[lag] = histogram.get(lag, 0) + count
    reached = [run["time_to_target_s"] for run in runs]
    return {
        **{
            k: mean([run[k] for run in runs])
            for k, v in first.items()
            if isinstance(v, float) and k not in ("time_to_target_s", "worker_killed_at_s", "cores_busy")
        },
        "time_to_target_s": mean(reached) if None not in reached else None,
        "target_reached": f"{sum(t is not None for t in reached)}/{len(runs)} seeds",
        "staleness_histogram": dict(sorted(histogram.items(), key=lambda kv: int(kv[0]))),
        "leases_expired": sum(run["leases_expired"] for run in runs),
        **{
            key: sum(run[key] for run in runs)
            for key in ("hedged_leases", "hedge_duplicates", "hedge_mismatches", "hedge_copies_told", "copies_abandoned")
        },
        "worker_killed_at_s": [run["worker_killed_at_s"] for run in runs] if first["worker_killed_at_s"] else None,
        "length_bias": pool_length_bias([run["length_bias"] for run in runs]),
        "cores_busy": mean([run["cores_busy"] for run in runs]) if None not in [run["cores_busy"] for run in runs] else None,
        "cpu_s_by_role": {
            role: round(mean([run["cpu_s_by_role"].get(role, 0.0) for run in runs]), 2)
            for role in sorted({role for run in runs for role in run["cpu_s_by_role"]})
        },
    }


def plot(scenario: str, results: dict[str, list[dict]], target: float, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6.5), gridspec_kw={"height_ratios": [3, 1.2]})
    colors = dict(zip(results, itertools.cycle(("tab:red", "tab:blue", "tab:green", "tab:purple", "tab:orange"))))
    for mode, runs in results.items():
        for seed, result in enumerate(runs):
            curve = result["curve"]
            if seed == 0:
                top.plot(curve["t"], curve["reward"], color=colors[mode], alpha=0.2, linewidth=0.8)
            label = f"{mode} ({result['label']}, {len(runs)} seed{'s' if len(runs) > 1 else ''})" if seed == 0 else None
            top.plot(curve["t"], curve["smoothed"], color=colors[mode], alpha=1.0 if seed == 0 else 0.5, label=label)
            if result["worker_killed_at_s"] is not None:
                top.axvline(result["worker_killed_at_s"], color=colors[mode], linestyle=":", linewidth=1)
    top.axhline(target, color="grey", linestyle="--", linewidth=0.8, label=f"target {target}")
    top.set_ylabel("mean reward per step")
    top.set_title(f"decentrl, scenario '{scenario}': reward vs wall time")
    top.legend(loc="lower right")
    for row, (mode, runs) in enumerate(results.items()):
        idle = [(s, w) for s, w, _ in runs[0]["timeline"]]
        busy = [(s + w, b) for s, w, b in runs[0]["timeline"]]
        bottom.broken_barh(idle, (row - 0.35, 0.7), color="lightgrey")
        bottom.broken_barh(busy, (row - 0.35, 0.7), color=colors[mode])
    bottom.set_yticks(range(len(results)), [f"{m} busy {100 * r[0]['trainer_busy_fraction']:.0f}%" for m, r in results.items()])
    bottom.set_xlabel("wall time since the trainer started (s), first seed; colored = trainer computing, grey = waiting for data")
    xmax = max(r["curve"]["t"][-1] for runs in results.values() for r in runs)
    top.set_xlim(0, xmax * 1.02)
    bottom.set_xlim(0, xmax * 1.02)
    fig.tight_layout()
    path = out / f"async_vs_sync_{scenario}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenarios", default="base,slow_worker,killed_worker")
    parser.add_argument("--steps", type=int, default=150, help="Optimizer steps per run (docs/benchmarks.md compares 60 and 150).")
    parser.add_argument("--seeds", type=int, default=1, help="Runs per mode (trainer.seed = simulation.seed = 0..N-1); figures are means.")
    parser.add_argument("--target", type=float, default=0.3, help="Target mean reward (smoothed).")
    parser.add_argument("--smooth", type=int, default=5, help="Steps in the reward moving average.")
    parser.add_argument("--async-staleness", default="2", help="max_staleness of the asynchronous run; a comma list runs one per value.")
    parser.add_argument("--lr", type=float, default=None, help="trainer.lr of every mode; default configs/local.toml's (1e-3).")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument(
        "--max-tokens", type=int, default=None,
        help="sampling.max_tokens of every mode; default configs/local.toml's (6: completions of 5-6 tokens, hardly "
        "varying in length). More lets lengths vary, which --latency-per-token-s turns into lateness.",
    )
    parser.add_argument("--slots", type=int, default=16, help="Concurrent lease slots per worker.")
    parser.add_argument("--latency-median-s", type=float, default=0.2)
    parser.add_argument("--latency-sigma", type=float, default=1.0)
    parser.add_argument(
        "--latency-per-token-s", type=float, default=0.0,
        help="simulation.latency_per_token_s: seconds of delay per completion token a request produced, so long "
        "completions finish late (default 0: the delay does not depend on length).",
    )
    parser.add_argument(
        "--keep-late", type=int, default=0,
        help="Also run the first asynchronous mode with orchestrator.keep_late = K (\"async_keep_late\") and report "
        "what it does to the length bias of stale drops and to the final held-out reward (\"keep_late_effect\").",
    )
    parser.add_argument("--lease-timeout-s", type=float, default=5.0)
    parser.add_argument("--eval-prompts", type=int, default=1024, help="Held-out prompts per evaluation of a version.")
    parser.add_argument("--eval-samples", type=int, default=4, help="Samples per held-out prompt.")
    parser.add_argument("--out", default="docs/figures", help="Where the PNGs go.")
    parser.add_argument("--deterministic", action="store_true", help="Also run the asynchronous mode with deterministic = true.")
    parser.add_argument(
        "--hedge-after", type=float, default=None, help="orchestrator.hedging.after of the deterministic run (default: the config's)."
    )
    parser.add_argument(
        "--max-copies", type=int, default=None, help="orchestrator.hedging.max_copies of the deterministic run (default: the config's)."
    )
    parser.add_argument(
        "--hedge-batches", type=int, default=None, help="orchestrator.hedging.batches of the deterministic run (default: the config's)."
    )
    parser.add_argument(
        "--no-hedging", action="store_true", help="The deterministic run without hedging (orchestrator.hedging.enabled = false)."
    )
    parser.add_argument("--skip-sync", action="store_true", help="Leave out the synchronous run (no time-to-target ratios).")
    parser.add_argument(
        "--pin-trainer", action="store_true",
        help="The trainer on core 0, every other role on the other cores (Linux): the trainer's compute is then not "
        "slowed by the workers' generation, as on a deployment where it has its own accelerator.",
    )
    args = parser.parse_args()
    if args.pin_trainer and (os.cpu_count() or 1) < 2:
        raise SystemExit("--pin-trainer needs at least 2 cores: one for the trainer, the rest for the other roles")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report: dict[str, dict] = {}
    # Kept when a run fails, so its logs can be read; removed after a clean finish.
    tmp = tempfile.mkdtemp(prefix="decentrl-async-vs-sync-")
    plain = ("curve", "timeline", "label", "run_dir", "eval_final")
    # "async" is the first --async-staleness; further ones run as "async_s<N>".
    stalenesses = [int(n) for n in args.async_staleness.split(",")]
    if not stalenesses or min(stalenesses) < 1:
        raise SystemExit(f"--async-staleness takes integers >= 1 separated by commas (got {args.async_staleness!r})")
    modes = {**({} if args.skip_sync else {"sync": 0}), "async": stalenesses[0], **{f"async_s{n}": n for n in stalenesses[1:]}}
    if args.deterministic:
        modes["async_deterministic"] = stalenesses[0]
    if args.keep_late:
        modes["async_keep_late"] = stalenesses[0]
    for scenario in args.scenarios.split(","):
        results: dict[str, list[dict]] = {mode: [] for mode in modes}
        seeds = []
        for seed in range(args.seeds):
            for mode, staleness in modes.items():
                deterministic = mode == "async_deterministic"
                keep_late = args.keep_late if mode == "async_keep_late" else 0
                result = run_once(args, scenario, staleness, seed, Path(tmp), deterministic, keep_late)
                result["label"] = (
                    f"max_staleness={staleness}{' deterministic' if deterministic else ''}"
                    f"{f' keep_late={keep_late}' if keep_late else ''}"
                )
                results[mode].append(result)
                print(f"{scenario} seed {seed} {mode}: " + json.dumps({k: v for k, v in result.items() if k not in plain}), flush=True)
            pair = {mode: runs[-1] for mode, runs in results.items()}
            equal_t = min(r["wall_s"] for r in pair.values())  # when the fastest run finished
            at_equal_t = {mode: version_at(r, equal_t) for mode, r in pair.items()}
            seeds.append(
                {
                    **{mode: {k: v for k, v in r.items() if k not in plain} for mode, r in pair.items()},
                    "reward_at_equal_wall_time": {"t_s": equal_t, **{mode: reward_at(r, equal_t) for mode, r in pair.items()}},
                    "eval_at_equal_wall_time": {
                        "t_s": equal_t,
                        # The fastest run's newest version is its final one, evaluated already.
                        **{
                            mode: {
                                "version": v,
                                **(pair[mode]["eval_final"] if v == args.steps else evaluate_version(args, Path(pair[mode]["run_dir"]), v)),
                            }
                            for mode, v in at_equal_t.items()
                        },
                    },
                }
            )
        figure = plot(scenario, results, args.target, out)
        means = {mode: aggregate(runs) for mode, runs in results.items()}
        sync_t = means["sync"]["time_to_target_s"] if "sync" in means else None
        ratios = {mode: m["time_to_target_s"] / sync_t if sync_t and m["time_to_target_s"] else None for mode, m in means.items()}
        report[scenario] = {
            **means,
            "time_to_target_ratio": ratios["async"],
            **{f"time_to_target_ratio_{mode}": ratio for mode, ratio in ratios.items() if mode.startswith("async_s")},
            "reward_at_equal_steps": {mode: m["final_reward"] for mode, m in means.items()},
            "reward_at_equal_wall_time": {
                key: mean([s["reward_at_equal_wall_time"][key] for s in seeds]) for key in ("t_s", *modes)
            },
            # The final policy itself, on held-out prompts (the batch rewards above were sampled by
            # policies up to max_staleness versions older than the one they are plotted at).
            "eval_reward_at_equal_steps": {mode: m["eval_final_reward"] for mode, m in means.items()},
            "eval_reward_at_equal_wall_time": {
                "t_s": mean([s["eval_at_equal_wall_time"]["t_s"] for s in seeds]),
                **{mode: mean([s["eval_at_equal_wall_time"][mode]["reward_mean"] for s in seeds]) for mode in modes},
            },
            "seeds": seeds,
            "plot": str(figure),
        }
        if args.keep_late:
            off, on = means["async"], means["async_keep_late"]
            report[scenario]["keep_late_effect"] = {
                "keep_late": args.keep_late,
                "length_bias_off": off["length_bias"],
                "length_bias_on": on["length_bias"],
                "stale_dropped_fraction_off": off["stale_dropped_fraction"],
                "stale_dropped_fraction_on": on["stale_dropped_fraction"],
                "staleness_histogram_on": on["staleness_histogram"],  # lags beyond max_staleness: the groups kept late
                "eval_final_reward_off": off["eval_final_reward"],
                "eval_final_reward_on": on["eval_final_reward"],
                "eval_final_reward_per_seed_off": [s["async"]["eval_final_reward"] for s in seeds],
                "eval_final_reward_per_seed_on": [s["async_keep_late"]["eval_final_reward"] for s in seeds],
                "wall_s_off": off["wall_s"],
                "wall_s_on": on["wall_s"],
                "samples_per_s_off": off["samples_per_s"],
                "samples_per_s_on": on["samples_per_s"],
            }
        if args.deterministic:
            free, fixed = means["async"], means["async_deterministic"]
            report[scenario]["deterministic_cost"] = {
                "busy_fraction_free": free["trainer_busy_fraction"],
                "busy_fraction_deterministic": fixed["trainer_busy_fraction"],
                "busy_gap": free["trainer_busy_fraction"] - fixed["trainer_busy_fraction"],
                "time_to_target_s_free": free["time_to_target_s"],
                "time_to_target_s_deterministic": fixed["time_to_target_s"],
                "wall_s_free": free["wall_s"],
                "wall_s_deterministic": fixed["wall_s"],
                "busy_after_first_batch_free": free["trainer_busy_fraction_after_first_batch"],
                "busy_after_first_batch_deterministic": fixed["trainer_busy_fraction_after_first_batch"],
                "trainer_compute_s_per_step_free": free["trainer_compute_s_per_step"],
                "trainer_compute_s_per_step_deterministic": fixed["trainer_compute_s_per_step"],
                "trainer_wait_s_per_step_free": free["trainer_wait_s_per_step"],
                "trainer_wait_s_per_step_deterministic": fixed["trainer_wait_s_per_step"],
                # The machine: cores the run's processes kept busy from the trainer's first step to its
                # last, and each role's CPU seconds in that window (RoleCpu).
                "cores_busy_free": free["cores_busy"],
                "cores_busy_deterministic": fixed["cores_busy"],
                "cpu_s_by_role_free": free["cpu_s_by_role"],
                "cpu_s_by_role_deterministic": fixed["cpu_s_by_role"],
                "samples_per_s_free": free["samples_per_s"],
                "samples_per_s_deterministic": fixed["samples_per_s"],
                "leases_expired_deterministic": fixed["leases_expired"],
                "hedged_leases": fixed["hedged_leases"],
                "hedge_duplicates": fixed["hedge_duplicates"],
                "hedge_mismatches": fixed["hedge_mismatches"],
                "hedge_copies_told": fixed["hedge_copies_told"],
                "copies_abandoned": fixed["copies_abandoned"],
                "per_seed": [
                    {
                        mode: {
                            k: s[mode][k]
                            for k in (
                                "trainer_busy_fraction",
                                "time_to_target_s",
                                "wall_s",
                                "cores_busy",
                                "hedged_leases",
                                "hedge_duplicates",
                                "hedge_copies_told",
                                "copies_abandoned",
                            )
                        }
                        for mode in ("async", "async_deterministic")
                    }
                    for s in seeds
                ],
            }
    shutil.rmtree(tmp)
    settings = {
        k: getattr(args, k)
        for k in (
            "steps",
            "seeds",
            "target",
            "smooth",
            "async_staleness",
            "lr",
            "max_tokens",
            "workers",
            "slots",
            "latency_median_s",
            "latency_sigma",
            "latency_per_token_s",
            "keep_late",
            "lease_timeout_s",
            "eval_prompts",
            "eval_samples",
            "deterministic",
            "skip_sync",
            "hedge_after",
            "max_copies",
            "hedge_batches",
            "no_hedging",
            "pin_trainer",
        )
    }
    first = report[next(iter(report))]
    print(json.dumps({
        "sync": first.get("sync"), "async": first["async"], "time_to_target_ratio": first["time_to_target_ratio"],
        **({"deterministic_cost": first["deterministic_cost"]} if args.deterministic else {}),
        **({"keep_late_effect": first["keep_late_effect"]} if args.keep_late else {}),
        "settings": settings, "scenarios": report,
    }))


if __name__ == "__main__":
    main()
