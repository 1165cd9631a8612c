"""On-policy distillation vs RL alone vs both, from the same student start (issue 31, item 3).

One invocation:
1. the teacher: the newest version of `--teacher-run`, trained first when that directory holds
   none (`decentrl run configs/local.toml --set max_staleness=2`: the CPU demo, 150 steps),
   pulled from its store as a full model directory (a stored version may be a delta);
2. the student, `configs/distill.toml` (a fresh tiny model with the same tokenizer, another seed),
   trained `--steps` steps three ways through `decentrl run`, everything else equal:
   - `distill`: the teacher scorer's per-token advantage alone (outcome_weight 0);
   - `rl`: the task's verifier reward and GRPO advantages, no scorer;
   - `both`: the teacher's per-token advantage plus `--outcome-weight` x the GRPO advantage;
3. each run's final version, the teacher and the student's start evaluated on held-out prompts
   (workers/evaluate.py, what `decentrl eval` runs: the task reseeded, minus the training prompts).

The time to target is the wall time from the trainer's first batch request until the 5-step
moving average of the training batches' task reward first reaches `--target` (the reward is the
task's in every mode: distillation runs keep it with model_weight 0). The last line printed is
one JSON object; docs/benchmarks.md has the figures, dated, with the command:

    .venv/bin/python benchmarks/distill.py --steps 40
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODES = ("distill", "rl", "both")


def teacher_dir(args: argparse.Namespace) -> tuple[str, int]:
    """A full model directory of the teacher run's newest version (trained first if there is none)."""
    from decentrl.store.checkpoints import CheckpointStore

    run = Path(args.teacher_run)
    store = CheckpointStore(str(run / "checkpoints"))
    if not (run / "checkpoints").is_dir() or store.latest() is None:
        command = [sys.executable, "-m", "decentrl", "run", str(ROOT / "configs" / "local.toml"), "--run-dir", str(run),
                   "--set", "max_staleness=2", "--set", f"trainer.steps={args.teacher_steps}"]
        print("training the teacher:", " ".join(command), file=sys.stderr)
        with open(f"{run}.out", "w") as log:
            subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, check=True)
    version = store.latest()
    assert version is not None
    return store.pull(version, str(run / "teacher-cache")), version


def mode_config(mode: str, args: argparse.Namespace, teacher: str) -> dict:
    config = tomllib.loads((ROOT / "configs" / "distill.toml").read_text())
    config["run_name"] = f"distill-{mode}"
    config["trainer"].update(steps=args.steps, seed=args.seed)
    config["store"].update(keep_last=args.steps + 1)
    config["scorer"]["path"] = teacher
    if args.clip is not None:
        config["orchestrator"]["advantages"]["distill"]["clip"] = args.clip
    if args.baseline is not None:
        config["orchestrator"]["advantages"]["distill"]["baseline"] = args.baseline
    if mode == "both":
        config["orchestrator"]["advantages"]["distill"]["outcome_weight"] = args.outcome_weight
    if mode == "rl":
        del config["orchestrator"]["advantages"]["distill"], config["scorer"]
        config["orchestrator"]["rewards"] = {"type": "verifier"}
        config["num_scorers"] = 0
    return config


def run_mode(mode: str, args: argparse.Namespace, teacher: str, work: Path) -> dict:
    run_dir = work / mode
    config_path = work / f"{mode}.json"
    config_path.write_text(json.dumps(mode_config(mode, args, teacher)))
    started = time.time()
    with open(work / f"{mode}.out", "w") as log:
        done = subprocess.run([sys.executable, "-m", "decentrl", "run", str(config_path), "--run-dir", str(run_dir)],
                              stdout=log, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        raise SystemExit(f"{mode} failed: see {work / f'{mode}.out'}")
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    start = metrics[0]["time"] - metrics[0]["step_s"]  # the trainer asks for its first batch
    times = [m["time"] - start for m in metrics]
    rewards = [m["reward_mean"] for m in metrics]
    averaged = [sum(rewards[max(0, i - 4) : i + 1]) / len(rewards[max(0, i - 4) : i + 1]) for i in range(len(rewards))]
    reached = next((t for t, r in zip(times, averaged, strict=True) if r >= args.target), None)
    final = evaluate(args, run_dir, args.steps)
    return {
        "time_to_target_s": None if reached is None else round(reached, 1),
        "final_reward": round(final["reward_mean"], 4),
        "final_stderr": round(final["reward_stderr"], 4),
        "train_reward_last5": round(sum(rewards[-5:]) / len(rewards[-5:]), 4),
        "train_curve": [round(r, 3) for r in rewards],
        "steps_s": round(times[-1], 1),
        "wall_s": round(time.time() - started, 1),
    }


def evaluate(args: argparse.Namespace, run_dir: Path, version: int) -> dict:
    """Held-out reward of one version of a run, pulled (verified) as workers pull it."""
    from decentrl.config import load_config
    from decentrl.store.checkpoints import CheckpointStore
    from workers.evaluate import evaluate as run_eval

    config = load_config(str(run_dir / "config.json"))
    checkpoint = CheckpointStore(str(run_dir / "checkpoints")).pull(version, str(run_dir / "eval-cache"))
    return run_eval(config, checkpoint, version, prompts=args.eval_prompts, samples_per_prompt=args.eval_samples).as_dict()


def evaluate_dir(args: argparse.Namespace, config_dir: Path, model_dir: str) -> dict:
    """Held-out reward of a model directory under a run's task and sampling."""
    from decentrl.config import load_config
    from workers.evaluate import evaluate as run_eval

    config = load_config(str(config_dir / "config.json"))
    return run_eval(config, model_dir, 0, prompts=args.eval_prompts, samples_per_prompt=args.eval_samples).as_dict()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40, help="Trainer steps of each mode.")
    parser.add_argument("--target", type=float, default=0.3, help="Training reward (5-step moving average) to time.")
    parser.add_argument("--outcome-weight", type=float, default=1.0, help="Weight of the GRPO advantage in `both`.")
    parser.add_argument("--clip", type=float, default=None, help="[orchestrator.advantages.distill] clip (default none).")
    parser.add_argument("--baseline", choices=("none", "group"), default=None,
                        help="[orchestrator.advantages.distill] baseline (default: configs/distill.toml's, group).")
    parser.add_argument("--seed", type=int, default=0, help="trainer.seed of every mode.")
    parser.add_argument("--teacher-run", default=str(ROOT / "runs" / "distill-teacher"))
    parser.add_argument("--teacher-steps", type=int, default=150, help="Steps of the teacher, when it is trained here.")
    parser.add_argument("--work", default=str(ROOT / "runs" / "bench-distill"))
    parser.add_argument("--eval-prompts", type=int, default=512)
    parser.add_argument("--eval-samples", type=int, default=4)
    parser.add_argument("--modes", default=",".join(MODES))
    args = parser.parse_args()

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    teacher, teacher_version = teacher_dir(args)
    results = {mode: run_mode(mode, args, teacher, work) for mode in args.modes.split(",")}
    first = work / next(iter(results))
    summary: dict = {
        "date": datetime.date.today().isoformat(),
        "command": "python benchmarks/distill.py " + " ".join(sys.argv[1:]),
        "steps": args.steps,
        "target": f"5-step moving average of the training batches' task reward >= {args.target}",
        "teacher_version": teacher_version,
        "teacher_reward": round(evaluate_dir(args, first, teacher)["reward_mean"], 4),
        "student_start_reward": round(evaluate(args, first, 0)["reward_mean"], 4),
        "held_out": f"{args.eval_prompts} held-out prompts x {args.eval_samples} samples",
        "modes": results,
    }
    for mode, result in results.items():
        summary[f"final_reward_{mode}"] = result["final_reward"]
        summary[f"time_to_target_s_{mode}"] = result["time_to_target_s"]
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
