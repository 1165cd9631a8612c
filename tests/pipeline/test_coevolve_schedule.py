"""benchmarks/coevolve.py's schedule part, small: the real orchestrator with units of roles under
simulated heavy-tailed workers reports every arm (two policies too) and the issue's keys, and the straggler bound
acts (nodes closed short, late samples refused) only where it is on."""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import tomllib
from pathlib import Path

import numpy as np
import pytest

from decentrl.tasks.propose import Proposal

ROOT = Path(__file__).resolve().parents[2]


def test_the_schedule_benchmark_reports_the_issue_keys() -> None:
    out = subprocess.run(
        [sys.executable, "benchmarks/coevolve.py", "--seeds", "1", "--sim-steps", "6", "--workers", "8", "--train-s", "4"],
        check=True, capture_output=True, text=True, cwd=ROOT, timeout=120,
    ).stdout
    result = json.loads(out.strip().splitlines()[-1])
    assert set(result["episode_p90_over_median"]) == {"single", "naive", "ours", "two_policies"}
    assert all(value is not None and value >= 1.0 for value in result["episode_p90_over_median"].values())
    assert result["busy_coevolve_vs_single"] is not None and result["busy_naive_vs_single"] is not None
    arms = result["schedule"]
    assert arms["naive"]["closed_short"] == 0 and arms["naive"]["node_closed_refused"] == 0, "naive waits for every sample"
    assert arms["ours"]["closed_short"] > 0 and arms["ours"]["node_closed_refused"] > 0
    assert arms["ours"]["roles"]["solver"]["n"] > 0 and arms["single"]["roles"]["solver"]["n"] == 0
    # Two policies: proposer and solver workers, a trainer each, both stepping; its ratio reported beside.
    two = arms["two_policies"]
    assert two["roles"]["solver"]["n"] > 0 and result["busy_two_policies_vs_single"] is not None
    assert all(set(run) == {"proposer", "solver"} and all(b is not None and b > 0 for b in run.values())
               for run in two["trainer_busy_by_policy"])
    assert set(result["episode_p90_over_median_by_role"]) == {"naive", "ours", "two_policies"}


def bench_module():
    spec = importlib.util.spec_from_file_location("coevolve_bench", ROOT / "benchmarks" / "coevolve.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_solve_rate_by_digits_is_the_landscape_the_proposer_reads() -> None:
    """The solvers' mean reward per proposal size, over valid units of sizes seen often enough: a
    flat map means every size pays the proposer alike (--learn reports it per decile)."""
    bench = bench_module()
    units = [(Proposal("12"), [1.0, 0.5])] * 3 + [(Proposal("1234"), [0.0, 0.25])] * 3
    units += [(None, [])] * 4 + [(Proposal("123456"), [1.0])] * 2 + [(Proposal("999"), [])] * 5
    by = bench.solve_rate_by_digits(units, least=3)
    # 2 digits: mean of means 0.75; 4 digits: 0.125; 6 digits (2 units) under `least`; 3 digits: no solver in.
    assert by == {"2": 0.75, "4": 0.125}
    assert bench.solve_rate_by_digits(units, least=2)["6"] == 1.0
    assert bench.solve_rate_by_digits([], least=1) == {}


def test_the_proposers_pay_by_size_and_where_it_points() -> None:
    """Any per-unit value (a solver's exact rate, the proposer's journaled reward) averaged per
    proposal size, sizes seen `least` times; the size paid most, the smaller on a tie."""
    bench = bench_module()
    values = [(2, 0.1), (2, 0.3), (4, 0.5), (4, 0.7), (4, 0.6), (6, 0.9)]
    by = bench.mean_by_digits(values, least=2)
    assert by == {"2": 0.2, "4": 0.6}, "6 digits: one unit, under least"
    assert bench.paid_most(by) == 4
    assert bench.paid_most({"5": 0.4, "3": 0.4, "8": 0.1}) == 3, "a tie: the smaller size"
    assert bench.paid_most({}) is None


def test_paired_difference_over_seeds_against_a_float64_reference() -> None:
    """Co-evolution minus a control, seed by seed: mean, standard error from the seeds' spread, t."""
    bench = bench_module()
    arm, control = [0.334, 0.293, 0.25, 0.31], [0.309, 0.245, 0.27, 0.30]
    diffs = np.asarray(arm, dtype=np.float64) - np.asarray(control, dtype=np.float64)
    se = diffs.std(ddof=1) / np.sqrt(len(diffs))
    got = bench.paired(arm, control)
    assert got["mean"] == pytest.approx(diffs.mean(), abs=1e-4)
    assert got["stderr_over_seeds"] == pytest.approx(se, abs=1e-4)
    assert got["t"] == pytest.approx(diffs.mean() / se, abs=0.01)
    assert bench.paired([0.3], [0.2]) == {"mean": 0.1, "stderr_over_seeds": None, "t": None}, "one seed: no spread"


def test_shortcut_floors_score_answers_that_sort_nothing_on_the_eval_prompts(tmp_path: Path) -> None:
    """The held-out floors: the problem copied, and its commonest digit repeated to its length,
    scored as the sorting task does (digits in place over the longer length) on the prompts
    `decentrl eval` draws."""
    from decentrl.config import parse_config
    from workers.evaluate import eval_prompts

    bench = bench_module()
    config = {"task": {"type": "sorting", "num_digits": 2, "max_digits": 8, "num_prompts": 512, "seed": 0}}
    path = tmp_path / "eval_config.json"
    path.write_text(json.dumps(config))
    floors = bench.shortcut_floors(path, 64)
    _, chosen = eval_prompts(parse_config(config), "heldout", 64, 0)
    problems = [p.text[:-1] for p in chosen]
    copy = [sum(a == b for a, b in zip(x, sorted(x))) / len(x) for x in problems]
    modes = [min(d for d in set(x) if x.count(d) == max(map(x.count, x))) for x in problems]
    common = [x.count(m) / len(x) for x, m in zip(problems, modes)]  # m in place: exactly its own run of the sorted digits
    assert floors == {"copy": pytest.approx(float(np.mean(copy)), abs=1e-4),
                      "commonest_digit": pytest.approx(float(np.mean(common)), abs=1e-4)}
    assert 0.0 < floors["copy"] < 1.0 and 0.0 < floors["commonest_digit"] < 1.0
    assert bench.SHORTCUTS["commonest_digit"]("3113") == "1111", "a tie goes to the smaller digit"


def test_an_unknown_solver_reward_is_refused_before_any_run() -> None:
    done = subprocess.run(
        [sys.executable, "benchmarks/coevolve.py", "--learn", "--solver-reward", "perm"],
        capture_output=True, text=True, cwd=ROOT, timeout=60,
    )
    assert done.returncode == 2 and "--solver-reward 'perm': choose positions, permutation or kept" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("flags", [["--seed-start", "-1"], ["--seeds", "0"], ["--seed-start", "two"]])
def test_a_bad_seed_batch_is_refused_before_any_run(flags: list[str]) -> None:
    done = subprocess.run([sys.executable, "benchmarks/coevolve.py", "--learn", *flags],
                          capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert done.returncode == 2 and ("at least one seed, the first 0 or more" in done.stderr or "invalid int value" in done.stderr)
    assert "Traceback" not in done.stderr


def test_proposals_skip_units_served_untrained(tmp_path: Path) -> None:
    """A two-policy run's last units, ready once both trainers had run their last step, are served
    untrained (orchestrator/state.py `_served_unclaimed`): no rewards journaled. The deciles read
    the trained units and pass over these (a 600-step run's journal held 8 such, and the benchmark
    stopped on them)."""
    import sqlite3
    import tomllib

    from decentrl.api.wire import Rollout, SamplingParams
    from decentrl.model.build import build_tiny_tokenizer
    from orchestrator.codec import encode_rollout
    from orchestrator.journal import SCHEMA

    bench = bench_module()
    task = tomllib.loads((ROOT / "configs" / "coevolve.toml").read_text())["task"]
    (tmp_path / "config.json").write_text(json.dumps({"task": task}))
    tokenizer = build_tiny_tokenizer()
    db = sqlite3.connect(tmp_path / "journal.sqlite")
    db.executescript(SCHEMA)
    unit = json.dumps({"kind": "roles", "roles": ["proposer", "solver"], "sizes": [1, 2], "min_fill": 2})
    for n, (lease_id, rewards) in enumerate([("trained", json.dumps([0.5, 1.0, 0.0])), ("untrained", None)]):
        db.execute("INSERT INTO leases(lease_id, prompt_id, holder, deadline, prompt_token_ids, group_size, status, "
                   "closed_at, rewards, unit) VALUES (?, 7, 'w', 0, x'', 1, 'served', ?, ?, ?)", (lease_id, n, rewards, unit))
        for i, text in enumerate(["1234", "1234", "4321"]):
            ids = tokenizer.encode(text, add_special_tokens=False)
            rollout = Rollout.model_construct(
                rollout_id=f"{lease_id}-{i}", run_name="", lease_id=lease_id, prompt_id=7, worker_id="w", policy_version=0,
                prompt_token_ids=[1], completion_token_ids=ids, logprobs=[0.0] * len(ids), finish_reason="stop",
                sampling=SamplingParams(temperature=1.0, max_tokens=9),
            )
            db.execute("INSERT INTO rollouts(rollout_id, lease_id, data) VALUES (?, ?, ?)",
                       (rollout.rollout_id, lease_id, encode_rollout(rollout)))
    db.commit()
    deciles = bench.proposals(tmp_path)
    assert sum(d["units"] for d in deciles) == 1
    (last,) = [d for d in deciles if d["units"]]
    assert last["valid_proposals"] == 1.0 and last["digits"] == 4 and last["solve_rate_fresh"] == 0.5


def test_curve_versions_are_evenly_spaced_and_end_at_the_last() -> None:
    bench = bench_module()
    assert bench.curve_versions(600, 10) == [60, 120, 180, 240, 300, 360, 420, 480, 540, 600]
    assert bench.curve_versions(600, 5) == [120, 240, 360, 480, 600]
    assert bench.curve_versions(7, 3) == [2, 5, 7]
    assert bench.curve_versions(3, 3) == [1, 2, 3]
    assert bench.curve_versions(600, 0) == []


def test_set_every_reaches_every_arm_and_curve_evaluates_kept_versions(tmp_path: Path, monkeypatch) -> None:
    """--set-every is a setting of every arm, the fixed curriculum's too (--set only the co-evolution
    arms'); --curve keeps every version (store.keep_last) and evaluates the held-out solver at each."""
    bench = bench_module()
    launched: dict[str, list[str]] = {}
    evaluated: list[tuple[str, int | None]] = []

    def run(config: str, run_dir: Path, sets: list[str]) -> None:
        launched[run_dir.name] = sets

    def heldout(run_dir: Path, args, digits=None, version=None) -> tuple[float, float, float]:
        evaluated.append((run_dir.name, version))
        return (0.5 if version is None else version / 1000, 0.01, 0.0)

    monkeypatch.setattr(bench, "run", run)
    monkeypatch.setattr(bench, "heldout", heldout)
    monkeypatch.setattr(bench, "shortcut_floors", lambda eval_config, prompts: {})
    monkeypatch.setattr(bench, "proposals", lambda run_dir: [])
    args = argparse.Namespace(
        steps=6, curve=3, set=["task.learnability=r_zero"], set_every=["trainer.lr=3e-4"], solver_reward="kept",
        policies="per_role", arms="coevolve,frozen_proposer,fixed", fixed_digits="2-8", seeds=1, seed_start=0,
        reuse=False, also_digits="", eval_prompts=8,
    )
    result = bench.learn(args, tmp_path)
    for arm in ("coevolve-0", "frozen_proposer-0", "fixed-0"):
        assert "store.keep_last=7" in launched[arm], arm
        lrs = [item for item in launched[arm] if item.startswith("trainer.lr=")]
        assert lrs[-1] == "trainer.lr=3e-4", f"{arm}: --set-every is applied last, over the arm's own"
    assert "task.learnability=r_zero" not in launched["fixed-0"], "--set is the co-evolution arms' only"
    assert "task.learnability=r_zero" in launched["coevolve-0"]
    assert [v for arm, v in evaluated if arm == "fixed-0"] == [None, 2, 4, 6]
    assert result["heldout_curve"] == {"versions": [2, 4, 6], "coevolve": [[0.002, 0.004, 0.006]],
                                       "frozen_proposer": [[0.002, 0.004, 0.006]], "fixed": [[0.002, 0.004, 0.006]]}
    args.curve, args.set_every = 0, []
    launched.clear()
    assert "heldout_curve" not in bench.learn(args, tmp_path)
    assert not any(item.startswith("store.keep_last") for sets in launched.values() for item in sets)
    # Without --set-every every arm trains at configs/coevolve.toml's learning rate: the fixed
    # curriculum (configs/local.toml, lr 1e-3) is given it, the co-evolution arms have it.
    lr = tomllib.loads((ROOT / "configs" / "coevolve.toml").read_text())["trainer"]["lr"]
    fixed_lr = [float(item.partition("=")[2]) for item in launched["fixed-0"] if item.startswith("trainer.lr=")]
    assert fixed_lr == [lr] and not any(item.startswith("trainer.lr=") for item in launched["coevolve-0"])


@pytest.mark.parametrize(("flags", "message"), [
    (["--curve", "-1"], "--curve -1: 0 (none) to --steps (150) versions"),
    (["--curve", "601", "--steps", "600"], "--curve 601: 0 (none) to --steps (600) versions"),
    (["--curve", "ten"], "invalid int value"),
    (["--set-every", "trainer.lr"], "--set-every 'trainer.lr': KEY=VALUE"),
    (["--set-every", "=3e-4"], "--set-every '=3e-4': KEY=VALUE"),
    (["--set", "lr"], "--set 'lr': KEY=VALUE"),
])
def test_bad_curve_or_settings_are_refused_before_any_run(flags: list[str], message: str) -> None:
    done = subprocess.run([sys.executable, "benchmarks/coevolve.py", "--learn", *flags],
                          capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert done.returncode == 2 and message in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


def test_heldout_evaluates_in_the_runs_own_cache(tmp_path: Path, monkeypatch) -> None:
    """Each run's versions are pulled into its own cache: runs share version numbers, and a shared
    cache holding one run's broken pull (a disk that filled mid-copy) failed every later eval."""
    bench = bench_module()
    (tmp_path / "config.json").write_text(json.dumps({"task": {}, "orchestrator": {}, "store": {"url": ""}}))
    commands: list[list[str]] = []

    def fake_run(command, **kwargs):
        commands.append(command)
        return subprocess.CompletedProcess(command, 0, stdout='{"reward_mean": 0.5, "reward_stderr": 0.1, "solved_fraction": 0.25}\n')

    monkeypatch.setattr(bench.subprocess, "run", fake_run)
    args = argparse.Namespace(eval_digits="2-8", eval_prompts=8)
    assert bench.heldout(tmp_path, args, version=120) == (0.5, 0.1, 0.25)
    (command,) = commands
    assert command[command.index("--cache-dir") + 1] == str(tmp_path / "eval-cache")
    assert command[command.index("--version") + 1] == "120"
