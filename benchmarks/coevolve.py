"""Co-evolution (issue 48): a proposer and its solvers as one unit of work - how its fan-out is
scheduled under heavy-tailed latency, and (with --learn) whether it teaches the solver more than
the controls from the same start.

`schedule` (always; seconds): the real orchestrator (orchestrator/state.py RunState, its lease
policy and reward stage) under a discrete-event simulation of the rest: --workers workers each
ask for one lease at a time, and a lease's generation takes the longest of its samples' times,
each drawn log-normal with median --median-s and shape --sigma (1.256: p90 = 5x median, the
issue's tail), proposer and solver alike; a simulated trainer takes a batch of
--groups-per-step units and computes for --train-s. Three arms from the same seeds:
- `single`: the single-agent run, plain groups of --solvers samples (the sorting task);
- `naive`: units of roles whose solver node goes whole to the unit's holder and is waited for
  (one sub-lease of all --solvers samples, min_fill = solvers);
- `ours`: the node in sub-leases of --sub-lease-size to any worker as it frees up, closed short at
  --min-fill samples --close-after-s after it is made (late samples refused `node_closed`).
- `two_policies`: ours with two models (`policies = "per_role"`): a worker serves one policy
  (about a lease's share of them, 1 in 1 + solvers / sub-lease size, propose), a trainer each, the
  proposer's computing --train-s / --solvers a step (its batch is one sample a unit).
Per arm: a unit's time from its lease to its group being complete (p50, p90, p90/median), each
role's node time, the trainer's busy fraction (compute over step time after the first batch),
and what the straggler bound closed short and refused.

`learn` (--learn; minutes a run): `decentrl run` of configs/coevolve.toml for --steps steps per
seed (--set adds settings; --policies per_role: two models), against a frozen proposer
(`frozen_roles = ["proposer"]`: with one shared model its proposals still drift as the solver
trains; with two the proposer stays the initial model) and a fixed curriculum (configs/local.toml's
sorting task, each prompt's length uniform over --fixed-digits, 2-8: the proposer's range, fixed in
advance; the same solver samples a step); each final version evaluated on held-out sorting
prompts of --eval-digits (2-8, `decentrl eval`, greedy) as the solver's skill, with its standard
error and the share sorted exactly (`heldout_solved`), beside what answers that sort nothing
score there (`heldout_shortcut_floors`: the problem copied, its commonest digit repeated), and
each length of --also-digits alone; `coevolve_margin_in_stderr` per control and seed,
`goal_heldout_met`, and `coevolve_minus_control_over_seeds` (the mean difference over seeds with
its standard error from the seeds' spread). The co-evolution runs' proposals are read from their
journals by decile of the run (valid share, distinct share, digits and swaps, the solvers' solve
rate, and per proposal size that solve rate, `solve_rate_by_digits`, the share of solvers with
the exact answer, `exact_rate_by_digits`, and what the proposer was paid, `paid_by_digits`, with
the size paid most, `paid_most_digits`: where the learnability rule points; at the top level
`solve_rate_fresh`, `proposal_difficulty`, `paid_most_digits`, `valid_proposals`, `distinct_proposals`, a list per
seed, and `solve_rate_spread_by_digits`: how far apart the sizes' solve rates are, all a
learnability reward of p can steer the proposer by). `two_policies`: the co-evolution run with two models (`[orchestrator.roles] policies =
"per_role"`: a trainer, a stream of versions and a worker per role), its solver's final version
evaluated alike, with its proposals by decile, each trainer's final version, samples a step and
busy fraction. --set-every sets every arm (the fixed curriculum's too: trainer.lr, model.hidden_size);
--curve N evaluates N versions evenly spaced over each run too (`heldout_curve`: where the solver
plateaus; every version kept). --arms picks the runs; --seed-start and --seeds a batch of seeds (with --out and
--reuse, batches under one --out are reported together). Why these controls: docs/tasks.md,
"Measuring it".

The last line is one JSON object with the issue's keys.
    .venv/bin/python benchmarks/coevolve.py --seeds 2
    .venv/bin/python benchmarks/coevolve.py --seeds 2 --sim-steps 2 --learn --steps 60 --policies per_role
Where a curriculum has room (proposals that start at 2-3 digits, a 12-digit ceiling, the long end
held out; docs/tasks.md, "A regime with headroom"):
    .venv/bin/python benchmarks/coevolve.py --seeds 4 --sim-steps 2 --learn --steps 600 --policies per_role \
      --arms coevolve,frozen_proposer,fixed --also-digits "" --eval-digits 9-12 --fixed-digits 2-12 \
      --set task.max_digits=12 --set sampling.max_tokens=13 --set task.proposal=tally
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import os
import random
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import tomllib
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def spread(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p90": None, "p90_over_median": None, "n": 0}
    p50, p90 = percentile(values, 0.5), percentile(values, 0.9)
    return {"p50": round(p50, 3), "p90": round(p90, 3), "p90_over_median": round(p90 / p50, 3), "n": len(values)}


# -- schedule: the real orchestrator, simulated workers and trainer ---------------------------


def schedule_config(arm: str, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    base: dict[str, Any] = {
        "run_name": "coevolve-schedule", "max_staleness": 1, "group_size": args.solvers, "num_workers": args.workers,
        "trainer_ranks": 1,
        "model": {"type": "tiny", "hidden_size": 32, "num_layers": 1, "num_heads": 2, "intermediate_size": 64},
        "sampling": {"temperature": 1.0, "max_tokens": 9},
        "orchestrator": {"lease_timeout_s": 1e6, "max_buffer_groups": 4 * args.groups_per_step},
        "trainer": {"groups_per_step": args.groups_per_step, "steps": args.sim_steps, "seed": seed},
    }
    if arm == "single":
        base["task"] = {"type": "sorting", "num_digits": 4, "num_prompts": 4096, "seed": seed}
        return base
    naive = arm == "naive"
    base["task"] = {"type": "propose", "min_digits": 2, "max_digits": 8, "num_prompts": 4096, "seed": seed, "solver_reward": "exact"}
    base["orchestrator"]["advantages"] = {"type": "roles"}
    base["orchestrator"]["roles"] = {
        "solvers": args.solvers,
        "sub_lease_size": args.solvers if naive else args.sub_lease_size,
        "min_fill": args.solvers if naive else args.min_fill,
        "close_after_s": args.close_after_s,
        "holder_first_s": 3600.0 if naive else 0.0,
    }
    if arm == "two_policies":  # ours with two models: proposer workers and solver workers, a trainer each
        base["orchestrator"]["roles"]["policies"] = "per_role"
    return base


def simulate(arm: str, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    """One arm: returns its unit and node times, the trainer's busy fraction and the bound's counts."""
    from decentrl.api.wire import Rollout, SamplingParams
    from decentrl.config import parse_config
    from decentrl.model.build import build_tiny_tokenizer
    from decentrl.tasks import build_task
    from orchestrator.state import RunState

    config = parse_config(schedule_config(arm, args, seed), source="benchmarks/coevolve.py")
    tokenizer = build_tiny_tokenizer()
    now = [0.0]
    state = RunState(config=config, task=build_task(config.task), tokenizer=tokenizer, clock=lambda: now[0])
    # Two policies: a worker serves one, about a lease's share of them proposing (one proposer lease
    # to solvers / sub_lease_size solver sub-leases a unit); a trainer each, the proposer's computing
    # 1 / solvers of the solver's (its batch is one sample a unit). One policy: None, one trainer.
    two = arm == "two_policies"
    trainers: list[str | None] = ["proposer", "solver"] if two else [None]
    proposers = max(1, round(args.workers / (1 + args.solvers / args.sub_lease_size))) if two else 0
    policy_of = {f"bench/w{w}": ("proposer" if w < proposers else "solver") if two else None for w in range(args.workers)}
    train_s = {None: args.train_s, "solver": args.train_s, "proposer": args.train_s / args.solvers}
    for trainer in trainers:
        state.announce(0, trainer)
    rng = random.Random(seed)
    sampling = SamplingParams(temperature=1.0, max_tokens=9)
    eos = tokenizer.eos_token_id
    mu = math.log(args.median_s)

    def draw() -> float:
        return math.exp(rng.gauss(mu, args.sigma))

    def ids(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False).input_ids + [eos]

    def answer(lease: Any) -> str:
        """A proposer writes 3-6 digits; a solver (or a single-agent sample) is right half the time."""
        if lease.node is not None and lease.node.role == "proposer":
            return "".join(rng.choice("0123456789") for _ in range(rng.randint(3, 6)))
        problem = tokenizer.decode(lease.prompt_token_ids, skip_special_tokens=True).rstrip("=")
        return "".join(sorted(problem)) if rng.random() < 0.5 else "9" * len(problem)

    events: list[tuple[float, int, str, Any]] = []  # (time, tiebreak, kind, payload)
    tick = iter(range(1 << 62))
    for w in range(args.workers):
        heapq.heappush(events, (0.0, next(tick), "ask", f"bench/w{w}"))
    for trainer in trainers:
        heapq.heappush(events, (0.0, next(tick), "trainer", trainer))
    started: dict[str, float] = {}
    node_start: dict[str, float] = {}
    unit_s: list[float] = []
    proposer_s: list[float] = []
    solver_s: list[float] = []
    seen_ready: set[str] = set()
    version = dict.fromkeys(trainers, 0)
    steps, compute, first_batch_at = dict.fromkeys(trainers, 0), dict.fromkeys(trainers, 0.0), dict.fromkeys(trainers, None)
    busy_until = dict.fromkeys(trainers, 0.0)

    def note_ready() -> None:
        for group in list(state.ready):
            if group.lease_id not in seen_ready and group.lease_id in started:
                seen_ready.add(group.lease_id)
                unit_s.append(now[0] - started[group.lease_id])
                if group.lease_id in node_start:
                    solver_s.append(now[0] - node_start[group.lease_id])

    while events and min(steps.values()) < args.sim_steps:
        at, _, kind, payload = heapq.heappop(events)
        now[0] = at
        if kind == "ask":
            leases = state.grant_leases(payload, 1, policy_of[payload])
            note_ready()  # an invalid proposal's unit completes at a lease request
            if not leases:
                heapq.heappush(events, (at + args.poll_s, next(tick), "ask", payload))
                continue
            lease = leases[0]
            if lease.unit_id is None:
                started[lease.lease_id] = at
            duration = max(draw() for _ in range(lease.group_size))
            heapq.heappush(events, (at + duration, next(tick), "post", (payload, lease)))
        elif kind == "post":
            holder, lease = payload
            rollouts = [
                Rollout(
                    rollout_id=uuid.uuid4().hex, run_name=config.run_name, lease_id=lease.lease_id, prompt_id=lease.prompt_id,
                    worker_id=holder.split("/")[1], policy_version=version[policy_of[holder]],
                    prompt_token_ids=lease.prompt_token_ids,
                    completion_token_ids=(c := ids(answer(lease))), logprobs=[-1.0] * len(c), finish_reason="stop",
                    sampling=sampling, node=lease.node,
                )
                for _ in range(lease.group_size)
            ]
            state.ingest(rollouts, holder)
            if lease.node is not None and lease.node.role == "proposer" and lease.lease_id in state.leases:
                proposer_s.append(at - started[lease.lease_id])
                node_start[lease.lease_id] = at
            note_ready()
            heapq.heappush(events, (at, next(tick), "ask", holder))
        elif kind == "trainer":
            trainer = payload
            if at < busy_until[trainer] or steps[trainer] >= args.sim_steps:
                continue
            batch = state.take_batch(version[trainer], policy=trainer)
            note_ready()
            if batch is None:
                heapq.heappush(events, (at + args.poll_s, next(tick), "trainer", trainer))
                continue
            if first_batch_at[trainer] is None:
                first_batch_at[trainer] = at
            else:
                compute[trainer] += train_s[trainer]
            steps[trainer] += 1
            busy_until[trainer] = at + train_s[trainer]
            version[trainer] += 1
            heapq.heappush(events, (busy_until[trainer], next(tick), "publish", (trainer, version[trainer])))
            heapq.heappush(events, (busy_until[trainer], next(tick), "trainer", trainer))
        elif kind == "publish":
            state.announce(payload[1], payload[0])
    busy = {}
    for trainer in trainers:
        total = now[0] - (first_batch_at[trainer] or 0.0)
        busy[trainer] = compute[trainer] / total if total > 0 else None
    policy = state.lease_policy
    return {
        "unit_s": unit_s, "proposer_s": proposer_s, "solver_s": solver_s,
        # The solver's trainer (or the one trainer) is the one the busy goal reads; two policies: each beside.
        "busy": busy[trainers[-1]], "busy_by_trainer": {t: busy[t] for t in trainers if t is not None},
        "steps": min(steps.values()), "wall_s": round(now[0], 2),
        "closed_short": getattr(policy, "closed_short", 0), "node_closed_refused": state.rejected.get("node_closed", 0),
        "stale_dropped": state.stale_dropped,
    }


def schedule(args: argparse.Namespace) -> dict[str, Any]:
    arms: dict[str, Any] = {}
    for arm in ("single", "naive", "ours", "two_policies"):
        runs = [simulate(arm, args, seed) for seed in range(args.seeds)]
        busy = [run["busy"] for run in runs if run["busy"] is not None]
        arms[arm] = {
            "episode": spread([t for run in runs for t in run["unit_s"]]),
            "roles": {
                "proposer": spread([t for run in runs for t in run["proposer_s"]]),
                "solver": spread([t for run in runs for t in run["solver_s"]]),
            },
            "trainer_busy": round(statistics.fmean(busy), 4) if busy else None,
            "trainer_busy_by_seed": [round(b, 4) for b in busy],
            "trainer_busy_by_policy": [
                {t: round(b, 4) if b is not None else None for t, b in run["busy_by_trainer"].items()} for run in runs
            ],
            "closed_short": sum(run["closed_short"] for run in runs),
            "node_closed_refused": sum(run["node_closed_refused"] for run in runs),
            "stale_dropped": sum(run["stale_dropped"] for run in runs),
            "sim_wall_s": [run["wall_s"] for run in runs],
        }
    return arms


# -- learn: real runs from the same start ------------------------------------------------------


def run(config: str, run_dir: Path, sets: list[str]) -> None:
    command = [str(Path(sys.executable).parent / "decentrl"), "run", config, "--run-dir", str(run_dir)]
    for item in sets:
        command += ["--set", item]
    subprocess.run(command, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)


def digit_range(text: str) -> tuple[int, int]:
    """ "4" -> (4, 4); "2-8" -> (2, 8)."""
    low, _, high = text.partition("-")
    return int(low), int(high or low)


def heldout(run_dir: Path, args: argparse.Namespace, digits: str | None = None,
            version: int | None = None) -> tuple[float, float, float]:
    """The final version's (or `version`'s) mean reward (and its standard error) on held-out sorting
    prompts of `digits` digits ("4", or "2-8": each prompt's length uniform in the range; --eval-digits):
    the solver's skill; and the share it sorts exactly (reward 1)."""
    low, high = digit_range(digits or args.eval_digits)
    config = json.loads((run_dir / "config.json").read_text())
    config["task"] = {"type": "sorting", "num_digits": low, "max_digits": high, "num_prompts": 4096, "seed": 0}
    roles = config["orchestrator"].pop("roles", None)
    if roles and roles.get("policies") == "per_role":  # two models: the solver's is the one evaluated
        from decentrl.store.manifest import policy_url

        config["store"]["url"] = policy_url(config["store"]["url"], "solver")
    config["orchestrator"].setdefault("advantages", {})["type"] = "grpo"
    eval_config = run_dir / "eval_config.json"
    eval_config.write_text(json.dumps(config))
    out = subprocess.run(
        [str(Path(sys.executable).parent / "decentrl"), "eval", str(eval_config), "--run-dir", str(run_dir),
         "--prompts", str(args.eval_prompts), "--samples", "1", "--greedy", "--set", f"sampling.max_tokens={high + 1}",
         *(["--version", str(version)] if version is not None else []),
         # the run's own cache: versions of different runs share numbers, and a pull cut short (a full
         # disk) in a shared cache stops every later eval of that version with a digest mismatch
         "--cache-dir", str(run_dir / "eval-cache")],
        check=True, cwd=ROOT, capture_output=True, text=True,
    ).stdout
    scored = json.loads(out.strip().splitlines()[-1])
    return float(scored["reward_mean"]), float(scored["reward_stderr"]), float(scored["solved_fraction"])


SHORTCUTS = {
    # Answers that sort nothing, each as long as the problem: what partial credit pays without the skill.
    "copy": lambda problem: problem,
    "commonest_digit": lambda problem: max(sorted(set(problem)), key=problem.count) * len(problem),
}


def curve_versions(steps: int, points: int) -> list[int]:
    """--curve: `points` versions evenly spaced over a run of `steps` steps, its last among them
    (600 steps, 10 points: 60, 120, ..., 600)."""
    return sorted({max(1, round(steps * k / points)) for k in range(1, points + 1)}) if points else []


def shortcut_floors(eval_config: Path, prompts: int) -> dict[str, float]:
    """The held-out set's mean reward for answers that sort nothing (SHORTCUTS), scored by the task
    on the very prompts `decentrl eval` draws: a solver at or under these shows no sorting."""
    from decentrl.config import parse_config
    from workers.evaluate import eval_prompts

    task, chosen = eval_prompts(parse_config(json.loads(eval_config.read_text())), "heldout", prompts, 0)
    return {name: round(statistics.fmean(task.reward(p, answer(p.text.removesuffix("="))) for p in chosen), 4)
            for name, answer in SHORTCUTS.items()}


def paired(arm: list[float], control: list[float]) -> dict[str, float | None]:
    """Co-evolution minus a control, seed by seed (the same seed: the same initial model): the mean
    difference over seeds, its standard error from the seeds' spread (None under 2 seeds), and
    their ratio. The seeds' spread, not one evaluation's error, is what decides between arms."""
    diffs = [a - c for a, c in zip(arm, control, strict=True)]
    mean = statistics.fmean(diffs)
    se = statistics.stdev(diffs) / math.sqrt(len(diffs)) if len(diffs) > 1 else None
    return {"mean": round(mean, 4), "stderr_over_seeds": round(se, 4) if se is not None else None,
            "t": round(mean / se, 2) if se else None}


def solve_rate_by_digits(units: list[tuple[Any, list[float]]], least: int = 5) -> dict[str, float]:
    """The solvers' mean reward over the valid units of each proposal size (digits), sizes with at
    least `least` units: the landscape a learnability reward of p reads. If it is flat, every size
    pays the proposer alike and no rule of p (Absolute Zero's, R-Zero's) can point it anywhere."""
    return mean_by_digits([(len(p.digits), statistics.fmean(solved)) for p, solved in units if p is not None and solved], least)


def mean_by_digits(values: list[tuple[int, float]], least: int = 5) -> dict[str, float]:
    """(proposal size, one unit's value) pairs -> the mean value per size, sizes with at least `least` units."""
    by: dict[int, list[float]] = {}
    for digits, value in values:
        by.setdefault(digits, []).append(value)
    return {str(n): round(statistics.fmean(vs), 3) for n, vs in sorted(by.items()) if len(vs) >= least}


def paid_most(paid_by_digits: dict[str, float]) -> int | None:
    """The proposal size the proposer was paid most for (the smaller on a tie), None with no size:
    where the learnability rule points."""
    return int(max(sorted(paid_by_digits, key=int), key=paid_by_digits.__getitem__)) if paid_by_digits else None


def proposals(run_dir: Path) -> list[dict[str, Any]]:
    """Per decile of the co-evolution run: valid and distinct proposal shares, mean digits and
    swaps of the valid ones, the solvers' solve rate - read from the journal's served units."""
    from decentrl.config import ProposeTaskConfig
    from decentrl.model.build import build_tiny_tokenizer
    from decentrl.tasks.propose import ProposeTask
    from orchestrator.codec import decode_rollout

    config = json.loads((run_dir / "config.json").read_text())
    task = ProposeTask(ProposeTaskConfig(**config["task"]))
    tokenizer = build_tiny_tokenizer()
    db = sqlite3.connect(run_dir / "journal.sqlite")
    rows = db.execute(
        "SELECT l.lease_id, l.closed_at, l.rewards FROM leases l WHERE l.status = 'served' ORDER BY l.closed_at"
    ).fetchall()
    units = []
    for lease_id, _, rewards in rows:
        if rewards is None:  # served untrained: ready once every trainer had run its last step (state.py `_served_unclaimed`)
            continue
        bodies = db.execute("SELECT rollout_id, data FROM rollouts WHERE lease_id = ? ORDER BY rowid", (lease_id,)).fetchall()
        if not bodies or bodies[0][1] is None:
            continue
        samples = [decode_rollout(data, rollout_id=rollout_id, lease_id=lease_id, run_name="", prompt_token_ids=[])
                   for rollout_id, data in bodies if data is not None]
        texts = [tokenizer.decode(r.completion_token_ids, skip_special_tokens=True) for r in samples]
        proposal = task.propose(texts[0], samples[0].prompt_id)
        paid = json.loads(rewards)
        # Each solver's answer exact (1) or not (0): the pass rate the papers' p is.
        exact = [float("".join(t.split()) == task.answer(proposal)) for t in texts[1:]] if proposal is not None else []
        units.append((proposal, paid[1:], exact, paid[0]))
    deciles = []
    for d in range(10):
        part = units[d * len(units) // 10 : (d + 1) * len(units) // 10]
        answered_units = [(p, solved, exact, paid) for p, solved, exact, paid in part if p is not None and solved]
        valid = [(p, solved) for p, solved, _, _ in part if p is not None]
        difficulty = [task.difficulty(p) for p, _ in valid]
        solved = [r for _, rs in valid for r in rs]
        answered = [rs for _, rs in valid if rs]
        paid_by_digits = mean_by_digits([(len(p.digits), paid) for p, _, _, paid in answered_units])
        deciles.append({
            "units": len(part),
            "valid_proposals": round(len(valid) / len(part), 3) if part else None,
            "distinct_proposals": round(len({p.canonical for p, _ in valid}) / len(valid), 3) if valid else None,
            "digits": round(statistics.fmean(x.digits for x in difficulty), 2) if difficulty else None,
            "operations": round(statistics.fmean(x.operations for x in difficulty), 2) if difficulty else None,
            "solve_rate_fresh": round(statistics.fmean(solved), 3) if solved else None,
            # Units whose solvers all scored 0 (p = 0: no learnability signal), and all 1.
            "p_zero": round(statistics.fmean(not any(rs) for rs in answered), 3) if answered else None,
            "p_one": round(statistics.fmean(min(rs) == 1.0 for rs in answered), 3) if answered else None,
            "solve_rate_by_digits": solve_rate_by_digits(valid),
            # The share of solvers with the exact answer per size, and what the proposer was paid per
            # size (its journaled reward: the configured learnability, less any repetition penalty),
            # with the size it was paid most for: where the rule points, beside where the proposer is.
            "exact_rate_by_digits": mean_by_digits([(len(p.digits), statistics.fmean(e)) for p, _, e, _ in answered_units]),
            "paid_by_digits": paid_by_digits,
            "paid_most_digits": paid_most(paid_by_digits),
        })
    return deciles


def learn(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    # Every batch kept (two policies: two trainers' batches), so the journal holds every served unit's samples for `proposals`.
    common = [f"trainer.steps={args.steps}", "num_workers=2", "trainer_ranks=1", f"orchestrator.batches_kept={2 * args.steps + 1}",
              *([f"store.keep_last={args.steps + 1}"] if args.curve else [])]  # --curve: every version kept
    # --policies per_role: the co-evolution run and its frozen-proposer control each with two models
    # (the frozen one: the proposer's model stays the initial one); --set: more settings of both.
    # --solver-reward: every arm's solvers (the fixed curriculum's too) on the same reward.
    reward = f"task.solver_reward={args.solver_reward}"
    roles = [*args.set, reward, *(["orchestrator.roles.policies=per_role"] if args.policies == "per_role" else [])]
    arms = {
        "coevolve": ("configs/coevolve.toml", roles),
        "frozen_proposer": ("configs/coevolve.toml", [*roles, 'orchestrator.advantages.frozen_roles=["proposer"]']),
        # A fixed curriculum of the same problems' kind, fixed in advance: sorting with each prompt's
        # length uniform over --fixed-digits (default the proposer's whole range, 2-8: uniform over its
        # difficulties), the same solver samples a step (docs/tasks.md, "The controls").
        "fixed": ("configs/local.toml", [f"task.num_digits={digit_range(args.fixed_digits)[0]}",
                                         f"task.max_digits={digit_range(args.fixed_digits)[1]}",
                                         f"sampling.max_tokens={digit_range(args.fixed_digits)[1] + 1}",
                                         "group_size=8", "trainer.groups_per_step=16", f"task.reward={args.solver_reward}",
                                         # the co-evolution config's learning rate (configs/local.toml's is another run's)
                                         f"trainer.lr={tomllib.loads((ROOT / 'configs' / 'coevolve.toml').read_text())['trainer']['lr']}"]),
        # The same co-evolution with two models: a trainer and a stream of versions per role, a worker each.
        "two_policies": ("configs/coevolve.toml", [*args.set, reward, "orchestrator.roles.policies=per_role"]),
    }
    arms = {arm: arms[arm] for arm in args.arms.split(",")}
    scores: dict[str, list[float]] = {arm: [] for arm in arms}
    stderrs: dict[str, list[float]] = {arm: [] for arm in arms}
    solved: dict[str, list[float]] = {arm: [] for arm in arms}
    floors: dict[str, float] = {}
    versions = curve_versions(args.steps, args.curve)
    curves: dict[str, list[list[float]]] = {arm: [] for arm in arms}
    by_decile: list[Any] = []
    by_digits: dict[str, dict[str, list[float]]] = {}
    two: dict[str, Any] = {
        "proposals_by_decile": [], "wall_s": [], "final_version": {"proposer": [], "solver": []},
        "samples_a_step": {"proposer": [], "solver": []}, "trainer_busy": {"proposer": [], "solver": []},
    }
    seeds = range(args.seed_start, args.seed_start + args.seeds)
    for seed in seeds:
        for arm, (config, sets) in arms.items():
            run_dir = out / f"{arm}-{seed}"
            if not (args.reuse and (run_dir / "summary.json").exists()):  # --reuse: a finished run under --out is taken as is
                shutil.rmtree(run_dir, ignore_errors=True)
                # --set-every last: a setting of every arm, the fixed curriculum's too (trainer.lr, model.hidden_size).
                run(config, run_dir, [*common, *sets, *args.set_every, f"trainer.seed={seed}", f"model.seed={seed}", f"task.seed={seed}"])
            score, stderr, exact = heldout(run_dir, args)
            scores[arm].append(score)
            # --curve: the held-out solver along the run (store.keep_last above raised so every version is kept).
            curves[arm].append([round(heldout(run_dir, args, version=v)[0], 4) for v in versions])
            stderrs[arm].append(stderr)
            solved[arm].append(exact)
            floors = floors or shortcut_floors(run_dir / "eval_config.json", args.eval_prompts)
            for digits in filter(None, args.also_digits.split(",")):  # each length of the range on its own
                by_digits.setdefault(arm, {}).setdefault(digits, []).append(round(heldout(run_dir, args, digits)[0], 4))
            if arm == "coevolve":
                by_decile.append(proposals(run_dir))
            if arm == "two_policies":
                two["proposals_by_decile"].append(proposals(run_dir))
                two["wall_s"].append(round(json.loads((run_dir / "summary.json").read_text())["wall_s"], 1))
                for policy in ("proposer", "solver"):
                    steps = [json.loads(line) for line in (run_dir / f"metrics-{policy}.jsonl").read_text().splitlines()]
                    two["final_version"][policy].append(steps[-1]["policy_version"])
                    two["samples_a_step"][policy].append(round(statistics.fmean(m["samples"] for m in steps), 2))
                    two["trainer_busy"][policy].append(round(steps[-1]["trainer_busy_fraction_total"], 4))
    result: dict[str, Any] = {f"heldout_solver_{arm}": [round(s, 4) for s in values] for arm, values in scores.items()}
    result["seeds"] = list(seeds)
    result["heldout_stderr"] = {arm: [round(s, 4) for s in values] for arm, values in stderrs.items()}
    result["heldout_solved"] = {arm: [round(s, 4) for s in values] for arm, values in solved.items()}
    result["heldout_shortcut_floors"] = floors
    if versions:  # --curve: per arm, a list per seed of the held-out solver at each of `versions`
        result["heldout_curve"] = {"versions": versions, **curves}
    if "coevolve" in scores:  # the goal: co-evolution above each control by >= 2 combined standard errors, every seed
        margins = {
            control: [round((scores["coevolve"][i] - scores[control][i]) / math.hypot(stderrs["coevolve"][i], stderrs[control][i]), 2)
                      for i in range(args.seeds)]
            for control in ("frozen_proposer", "fixed") if control in scores
        }
        result["coevolve_margin_in_stderr"] = margins
        result["coevolve_minus_control_over_seeds"] = {
            control: paired(scores["coevolve"], scores[control]) for control in ("frozen_proposer", "fixed") if control in scores
        }
        result["goal_heldout_met"] = len(margins) == 2 and all(m >= 2 for ms in margins.values() for m in ms)
    if by_decile:
        result["proposals_by_decile"] = by_decile
        # The keys, per decile of the run, a list per seed.
        for key, field in (("solve_rate_fresh", "solve_rate_fresh"), ("valid_proposals", "valid_proposals"),
                           ("distinct_proposals", "distinct_proposals")):
            result[key] = [[d[field] for d in seed] for seed in by_decile]
        result["proposal_difficulty"] = [[{"digits": d["digits"], "operations": d["operations"]} for d in seed] for seed in by_decile]
        # Where the learnability rule points each decile (the size it paid most for), beside the digits proposed.
        result["paid_most_digits"] = [[d["paid_most_digits"] for d in seed] for seed in by_decile]
        # What the proposer can gain by its choice: the spread of the solvers' mean reward over the
        # proposal sizes of each decile (max - min of solve_rate_by_digits; ~0: no frontier to find).
        result["solve_rate_spread_by_digits"] = [
            [round(max(m.values()) - min(m.values()), 3) if len(m := d["solve_rate_by_digits"]) > 1 else None for d in seed]
            for seed in by_decile
        ]
    if by_digits:
        result["heldout_solver_by_digits"] = by_digits
    if "two_policies" in arms:
        result["two_policies"] = {"heldout_solver": result.pop("heldout_solver_two_policies"), **two}
    return result


OPTIONS = f"""
seeds int 2 seeds of every arm
seed-start int 0 learn: the first seed (runs seed-start .. seed-start + seeds - 1: a batch of seeds)
workers int 24 schedule: simulated workers, one lease at a time each
solvers int 8 solver samples a unit (a single-agent group's size)
sub-lease-size int 2 schedule, ours: solver samples a sub-lease
min-fill int 6 schedule, ours: the straggler bound
close-after-s float 8.0 schedule, ours: seconds after a node is made before it may close short
median-s float 1.0 schedule: median of a sample's time
sigma float {math.log(5) / 1.2816} schedule: log-normal shape (p90 = 5x median)
groups-per-step int 8 schedule: units (groups) a step
train-s float 12.0 schedule: simulated trainer compute a step
sim-steps int 60 schedule: trainer steps a seed
poll-s float 0.05 schedule: how soon an idle worker or trainer asks again
steps int 150 learn: trainer steps a run
fixed-digits str 2-8 learn: the fixed curriculum's digits ("4", or "2-8": each prompt's length uniform in the range)
eval-digits str 2-8 learn: digits of the held-out sorting prompts ("4", or "2-8": each prompt's length uniform in the range)
also-digits str 4,6,8 learn: held-out digit counts reported beside (heldout_solver_by_digits), comma-separated
eval-prompts int 256 learn: held-out prompts
arms str coevolve,frozen_proposer,fixed,two_policies learn: the runs, comma-separated
curve int 0 learn: the held-out solver also at this many versions evenly spaced over each run (heldout_curve: where it plateaus)
policies str shared learn: the coevolve and frozen_proposer arms with one shared model (shared) or two (per_role)
solver-reward str kept learn: every arm's solver reward: kept (positions x digits kept), positions or permutation (a permutation only)
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for line in OPTIONS.strip().splitlines():  # flag, type, default, help
        flag, kind, default, text = line.split(maxsplit=3)
        cast = {"int": int, "float": float, "str": str}[kind]
        parser.add_argument(f"--{flag}", type=cast, default=cast(default), help=text)
    parser.add_argument("--learn", action="store_true", help="also the real runs (minutes each)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="learn: a setting of configs/coevolve.toml's arms (repeatable), as `decentrl run --set`")
    parser.add_argument("--set-every", action="append", default=[], metavar="KEY=VALUE",
                        help="learn: a setting of every arm, the fixed curriculum's too (repeatable): trainer.lr=3e-4")
    parser.add_argument("--reuse", action="store_true", help="learn: evaluate finished runs already under --out again")
    parser.add_argument("--out", default=None, help="run directories of --learn (default: a temp dir)")
    args = parser.parse_args()
    if args.solver_reward not in ("positions", "permutation", "kept"):
        parser.error(f"--solver-reward {args.solver_reward!r}: choose positions, permutation or kept")
    if args.seeds < 1 or args.seed_start < 0:
        parser.error(f"--seeds {args.seeds} --seed-start {args.seed_start}: at least one seed, the first 0 or more")
    if not 0 <= args.curve <= args.steps:
        parser.error(f"--curve {args.curve}: 0 (none) to --steps ({args.steps}) versions")
    for flag, items in (("--set", args.set), ("--set-every", args.set_every)):
        for item in items:
            if "=" not in item or not item.partition("=")[0].strip():
                parser.error(f"{flag} {item!r}: KEY=VALUE, e.g. trainer.lr=3e-4")
    sys.path.insert(0, str(ROOT))

    arms = schedule(args)
    busy = {arm: arms[arm]["trainer_busy"] for arm in arms}
    result: dict[str, Any] = {
        "schedule": arms,
        "episode_p90_over_median": {arm: arms[arm]["episode"]["p90_over_median"] for arm in arms},
        "episode_p90_over_median_by_role": {arm: {r: v["p90_over_median"] for r, v in arms[arm]["roles"].items()}
                                            for arm in ("naive", "ours", "two_policies")},
        "busy_coevolve_vs_single": round(busy["ours"] / busy["single"], 4) if busy["ours"] and busy["single"] else None,
        "busy_naive_vs_single": round(busy["naive"] / busy["single"], 4) if busy["naive"] and busy["single"] else None,
        "busy_two_policies_vs_single": (round(busy["two_policies"] / busy["single"], 4)
                                        if busy["two_policies"] and busy["single"] else None),
        "two_policies": None,  # with --learn (and two_policies among --arms): the co-evolution run with two models
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
    }
    if args.learn:
        out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="coevolve-"))
        os.makedirs(out, exist_ok=True)
        result.update(learn(args, out))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
