"""Model rewards without stalling the trainer: inline scoring vs scorers (issue 19).

Four runs of `decentrl run` with the same task (sorting), model, workers, trainer and seed; each
measures the trainer's busy fraction (1 - waiting for batches / step time, as
benchmarks/async_vs_sync.py), the time to a target reward and the ingest rate (samples
acknowledged per second):

  free_verifier   the task's own verifier only: rewards cost nothing (the ceiling)
  inline_model    the reward model runs INSIDE the orchestrator's ingest path: the task's
                  reward function (`InlineModelSorting` below, `[task] type = "import"`) runs the
                  classifier's forward pass and the per-item delay for each sample when its group
                  completes, on the orchestrator's event loop, before the rollout post is
                  answered: what scoring with a model looks like without a scorer role
  scorers_1/2     `[orchestrator.rewards] type = "sum"`: the orchestrator queues each complete
                  group's samples; 1 or 2 `decentrl scorer` processes (`num_scorers`) lease them,
                  run the same classifier through the `hf` backend (workers/scorers/hf.py) plus
                  the same per-item delay (`score_with_delay` below, the `python` backend), and
                  post the scores; the group trains once scored

The reward is the same in the three model modes: the sorting verifier's plus `--model-weight`
times the classifier's sigmoid score (a real small AutoModelForSequenceClassification, a Qwen2
built from a config with random weights: its score is noise the policy cannot learn, so
`--model-weight` is small and the time to target still measures learning the task). The
per-item delay (a sleep: it costs no CPU) stands for a reward model large enough to matter, run
on each scorer's own accelerator: the classifier itself is kept tiny, so that on a CPU shared by
every role the cost that scales with the number of scorers is the delay, as it would with one
GPU per scorer. By default the delay is chosen from the free-verifier run so that the delay alone
lets one scorer score only 1/1.2 of what that run's trainer consumed (`--delay-factor 1.2`) and
two scorers 1.67 times it: one scorer is too few, two should be enough. Inline, the orchestrator
scores one sample at a time (the task's reward is per sample), so it can score at most what one
scorer does, and it holds every other request meanwhile. `--modes` may add `scorers_N` for any N,
and `scorers_N_iITEMS_aAHEAD` to set the scorers' `max_items` and `leases_ahead` for that mode
(`--scorer-items`, `--leases-ahead` otherwise): `scorers_2_i64_a0` leases as the first version of
the scorer loop did.

`--repeats N` runs every mode N times, interleaved (repeat r runs the modes in the order given,
rotated by r), with the delay set once, by the first free-verifier run: the machine's load drifts
over minutes, and the trainer's own compute per step (the same work in every mode) shows how much
(`trainer_compute_s_<mode>_repeats`). The busy fraction is compute / (compute + wait), so a step
computed slower on a loaded CPU looks busier at the same wait: compare `wait_s_<mode>` (the
trainer's wait for a batch, per step) as well.

Prints, as its last line, one JSON object: for every mode the means over the repeats of
`busy_<mode>` (after the first batch), `time_to_target_s_<mode>` (None unless every repeat
reached it), `ingest_per_s_<mode>`, `step_s_<mode>`, `trainer_compute_s_<mode>` and
`wait_s_<mode>`, each with its per-repeat values (`..._repeats`); `busy_gap_<mode>`, the free
verifier's busy minus the mode's, paired within each repeat; the delay used, and the settings.

    .venv/bin/python benchmarks/reward_service.py --steps 60 --target 0.18 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path
from typing import Any

from async_vs_sync import read_metrics, summarize

from decentrl.api.wire import ScoreItem
from decentrl.config import HFScorerConfig, SortingTaskConfig
from decentrl.tasks import Prompt
from decentrl.tasks.sorting import SortingTask

ROOT = Path(__file__).resolve().parent.parent
MODES = ("free_verifier", "inline_model", "scorers_1", "scorers_2")
_BACKENDS: dict[str, Any] = {}  # classifier path -> its loaded hf backend (one per process)


def write_classifier(out: Path) -> Path:
    """A small Qwen2 sequence classifier (one label) with the run's tokenizer, built from a config."""
    import torch
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    from decentrl.model.build import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=64, num_labels=1, pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    Qwen2ForSequenceClassification(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def _backend(path: str) -> Any:
    if path not in _BACKENDS:
        from workers.scorers.hf import HFScoreBackend

        _BACKENDS[path] = HFScoreBackend(HFScorerConfig(path=path, input="text", transform="sigmoid", batch_size=64))
    return _BACKENDS[path]


def score_with_delay(items: list[ScoreItem], path: str, delay_s: float) -> list[Any]:
    """The scorers' function (`[scorer] type = "python"`): the hf backend's scores, then the delay per item."""
    verdicts = _backend(path).score(items)
    time.sleep(delay_s * len(items))
    return verdicts


class InlineModelSorting:
    """The sorting task whose reward runs the classifier (and the delay) itself: in the orchestrator's ingest."""

    def __init__(self, path: str, delay_s: float, model_weight: float, num_prompts: int = 4096) -> None:
        self.sorting = SortingTask(SortingTaskConfig(num_prompts=num_prompts))
        self.num_prompts = num_prompts
        self.path, self.delay_s, self.model_weight = path, delay_s, model_weight

    def prompt(self, prompt_id: int) -> Prompt:
        return self.sorting.prompt(prompt_id)

    def reward(self, prompt: Prompt, completion_text: str) -> float:
        item = ScoreItem(rollout_id="inline", prompt_id=prompt.prompt_id, prompt=prompt.text, completion=completion_text)
        (verdict,) = _backend(self.path).score([item])
        time.sleep(self.delay_s)
        return self.sorting.reward(prompt, completion_text) + self.model_weight * verdict.score


def mode_config(args: argparse.Namespace, mode: str, classifier: Path, delay_s: float) -> dict[str, Any]:
    config = tomllib.loads((ROOT / "configs" / "local.toml").read_text())
    config.update(run_name=f"reward-{mode.replace('_', '-')}", max_staleness=args.max_staleness, num_workers=args.workers, seed=0)
    config["trainer"].update(steps=args.steps, groups_per_step=args.groups_per_step, seed=0)
    config["orchestrator"].update(lease_timeout_s=30.0)
    config["worker"].update(groups_per_request=1, concurrency=args.slots)
    config["simulation"] = {"latency_median_s": args.latency_median_s, "latency_sigma": args.latency_sigma, "seed": 0}
    options = {"path": str(classifier), "delay_s": delay_s}
    if mode == "inline_model":
        config["task"] = {"type": "import", "target": "reward_service:InlineModelSorting",
                          "options": {**options, "model_weight": args.model_weight}}
    if mode.startswith("scorers_"):
        count, max_items, leases_ahead = scorer_settings(args, mode)
        config["num_scorers"] = count
        config["orchestrator"]["rewards"] = {"type": "sum", "verifier_weight": 1.0, "model_weight": args.model_weight,
                                             "lease_timeout_s": 30.0}
        config["scorer"] = {"type": "python", "function": "reward_service:score_with_delay", "options": options,
                            "max_items": max_items, "leases_ahead": leases_ahead, "min_wait_s": 0.05}
    return config


def scorer_settings(args: argparse.Namespace, mode: str) -> tuple[int, int, int]:
    """`scorers_N`, optionally with `_iITEMS` and `_aAHEAD` (e.g. `scorers_2_i64_a0`): the number of
    scorers, their `max_items` and `leases_ahead` (`--scorer-items` and `--leases-ahead` unless given)."""
    count, *options = mode.removeprefix("scorers_").split("_")
    settings = {"i": args.scorer_items, "a": args.leases_ahead}
    for option in options:
        if option[:1] not in settings or not option[1:].isdigit():
            raise SystemExit(f"mode {mode!r}: options are _iITEMS and _aAHEAD (e.g. scorers_2_i64_a0)")
        settings[option[0]] = int(option[1:])
    return int(count), settings["i"], settings["a"]


def run_mode(args: argparse.Namespace, mode: str, classifier: Path, delay_s: float, work: Path) -> dict[str, Any]:
    work.mkdir(parents=True, exist_ok=True)
    run_dir = work / mode
    config_path = work / f"{mode}.json"
    config_path.write_text(json.dumps(mode_config(args, mode, classifier, delay_s)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "benchmarks"), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    with open(work / f"{mode}.out", "w") as log:
        code = subprocess.call(
            [sys.executable, "-m", "decentrl", "run", str(config_path), "--run-dir", str(run_dir)],
            stdout=log, stderr=subprocess.STDOUT, env=env,
        )
    if code != 0:
        raise SystemExit(f"{mode} failed: see {work / f'{mode}.out'} and {run_dir / 'logs'}")
    metrics = read_metrics(run_dir)
    status = json.loads((run_dir / "status.json").read_text())
    summary = summarize(args, metrics, status, None)
    later = metrics[1:]
    step_s = sum(m["step_s"] for m in later) / len(later)
    return {
        # Mean step time after the first batch, and its part spent computing: the same work in
        # every mode, so differences in the latter are the machine's load (a shared CPU).
        "step_s": step_s,
        "trainer_compute_s": step_s - sum(m["wait_for_batch_s"] for m in later) / len(later),
        "wait_s": sum(m["wait_for_batch_s"] for m in later) / len(later),  # per step, waiting for its batch
        "time_to_target_after_first_batch_s": (
            None if summary["time_to_target_s"] is None else summary["time_to_target_s"] - summary["first_batch_wait_s"]
        ),
        # The first batch also waits for every role to start (scorers load torch and the
        # classifier): the steady state is after it; the whole run is kept too.
        "busy": summary["trainer_busy_fraction_after_first_batch"],
        "busy_whole_run": summary["trainer_busy_fraction"],
        "first_batch_wait_s": summary["first_batch_wait_s"],
        "time_to_target_s": summary["time_to_target_s"],
        "wall_s": summary["wall_s"],
        "ingest_per_s": status["rollouts_accepted"] / summary["wall_s"],  # acknowledged, per second of training
        "samples_trained_per_s": summary["samples_per_s"],
        "final_reward": summary["final_reward"],
        "scoring": status.get("scoring"),
        "stale_dropped": status["stale_dropped"],
    }


def order(modes: list[str], repeat: int) -> list[str]:
    """The modes of one repeat, rotated by its number so that no mode always runs first (or last)
    while the machine's load drifts. Repeat 0 keeps the order given (the free verifier first when
    its run sets the delay)."""
    return modes[repeat % len(modes):] + modes[: repeat % len(modes)]


def aggregate(runs: list[dict[str, Any]], key: str, digits: int) -> tuple[float | None, list[float | None]]:
    """The mean of `key` over a mode's repeats (None when a repeat has none) and the per-repeat values."""
    values = [None if run[key] is None else round(run[key], digits) for run in runs]
    known = [run[key] for run in runs if run[key] is not None]
    return (round(sum(known) / len(known), digits) if len(known) == len(runs) else None), values


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--groups-per-step", type=int, default=16)
    parser.add_argument("--max-staleness", type=int, default=2)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--slots", type=int, default=16, help="Concurrent lease slots per worker.")
    parser.add_argument("--latency-median-s", type=float, default=0.2, help="Simulated generation latency (a sleep).")
    parser.add_argument("--latency-sigma", type=float, default=0.5)
    parser.add_argument("--target", type=float, default=0.3, help="Target mean reward (smoothed).")
    parser.add_argument("--smooth", type=int, default=5, help="Steps in the reward moving average.")
    parser.add_argument("--model-weight", type=float, default=0.02, help="Weight of the classifier's score in the reward.")
    parser.add_argument("--delay-ms", type=float, default=None, help="Delay per scored item; default: from the free run.")
    parser.add_argument("--delay-factor", type=float, default=1.2,
                        help="Default delay = factor / (samples per second the first free-verifier trainer consumed).")
    parser.add_argument("--scorer-items", type=int, default=16, help="[scorer] max_items: samples per score lease.")
    parser.add_argument("--leases-ahead", type=int, default=1, help="[scorer] leases_ahead: leases kept in hand.")
    parser.add_argument("--repeats", type=int, default=1,
                        help="Runs of every mode, interleaved (repeat r runs the modes rotated by r); means are reported.")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--work", default=None, help="Where the runs go (default: a temporary directory).")
    args = parser.parse_args()

    work = Path(args.work or tempfile.mkdtemp(prefix="reward-service-"))
    work.mkdir(parents=True, exist_ok=True)
    classifier = write_classifier(work / "classifier")
    modes = args.modes.split(",")
    if args.delay_ms is None and "free_verifier" in modes:  # the first run sets the delay
        modes = ["free_verifier", *(mode for mode in modes if mode != "free_verifier")]
    results: dict[str, list[dict[str, Any]]] = {mode: [] for mode in modes}
    delay_s = None if args.delay_ms is None else args.delay_ms / 1000
    if delay_s is None and "free_verifier" not in modes:  # a free-verifier run only to set the delay
        delay_s = args.delay_factor / run_mode(args, "free_verifier", classifier, 0.0, work / "delay")["samples_trained_per_s"]
    for repeat in range(args.repeats):
        for mode in order(modes, repeat):
            delay = 0.0 if mode == "free_verifier" else delay_s
            assert delay is not None  # the first run was the free verifier's, which set it
            result = run_mode(args, mode, classifier, delay, work / f"r{repeat}")
            results[mode].append(result)
            if delay_s is None:
                delay_s = args.delay_factor / result["samples_trained_per_s"]
            print(json.dumps({"repeat": repeat, mode: result}), flush=True)
    summary: dict[str, Any] = {}
    for mode, runs in results.items():
        for key, name, digits in (
            ("busy", "busy", 4), ("busy_whole_run", "busy_whole_run", 4), ("time_to_target_s", "time_to_target_s", 2),
            ("ingest_per_s", "ingest_per_s", 1), ("wall_s", "wall_s", 1), ("step_s", "step_s", 3),
            ("trainer_compute_s", "trainer_compute_s", 3), ("wait_s", "wait_s", 3),
        ):
            summary[f"{name}_{mode}"], summary[f"{name}_{mode}_repeats"] = aggregate(runs, key, digits)
    if "free_verifier" in results:
        for mode, runs in results.items():
            if mode != "free_verifier":
                pairs = [round(free["busy"] - run["busy"], 4) for free, run in zip(results["free_verifier"], runs, strict=True)]
                summary[f"busy_gap_{mode}"] = round(sum(pairs) / len(pairs), 4)
                summary[f"busy_gap_{mode}_repeats"] = pairs
    summary.update(delay_ms_per_item=round((delay_s or 0.0) * 1000, 3), steps=args.steps,
                   groups_per_step=args.groups_per_step, target=args.target, scorer_items=args.scorer_items,
                   leases_ahead=args.leases_ahead, repeats=args.repeats, work=str(work), modes=results)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
