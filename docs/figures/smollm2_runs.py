"""Collect and plot the configs/smollm2.toml runs of docs/real_model.md.

    python docs/figures/smollm2_runs.py --run full-a=/tmp/smol/full-a --run lora-a=/tmp/smol/lora-a \
        --evals /tmp/smol/evals.jsonl          # writes smollm2_runs.json and smollm2_runs.png here
    python docs/figures/smollm2_runs.py        # replots from smollm2_runs.json

Per run it keeps the training curve (metrics.jsonl: reward, entropy, seconds since the run's first
step began), the wall time (summary.json), the settings that differ between runs, and the bytes of
each version's weights as a worker pulls them (a key version's files whole, a delta version's
deltas, a LoRA version's adapter; from the manifests in the store). `--evals` is a JSON-lines file
of `decentrl eval` outputs, each with a "run" key added (and "greedy" as eval prints it).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

HERE = Path(__file__).parent
OUT = HERE / "smollm2_runs"
WEIGHTS = (".safetensors", ".safetensors.delta", ".bin")


def version_bytes(store: Path) -> dict[int, int]:
    """Version -> bytes of weight files a worker pulls for it (deltas as stored, not rebuilt)."""
    found = {}
    for manifest in sorted(store.glob("v*/manifest.json")):
        data = json.loads(manifest.read_text())
        found[data["version"]] = sum(
            (f["delta"]["size"] if f.get("delta") else f["size"])
            for f in data["files"]
            if f["path"].endswith(WEIGHTS)
        )
    return found


def collect(runs: list[str], evals_file: str | None) -> dict:
    evals = [json.loads(line) for line in Path(evals_file).read_text().splitlines()] if evals_file else []
    out = {}
    for spec in runs:
        name, directory = spec.split("=", 1)
        run = Path(directory)
        config = json.loads((run / "config.json").read_text())
        metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        start = metrics[0]["time"] - metrics[0]["step_s"]
        out[name] = {
            "run_dir": directory,
            "settings": {
                "lr": config["trainer"]["lr"],
                "lora": config["trainer"]["lora"],
                "trainer_seed": config["trainer"]["seed"],
                "task_seed": config["task"]["seed"],
                "steps": config["trainer"]["steps"],
            },
            "wall_s": json.loads((run / "summary.json").read_text())["wall_s"],
            "curve": [
                {"step": m["step"], "reward_mean": m["reward_mean"], "entropy": m["entropy"],
                 "seconds": round(m["time"] - start, 1), "completion_tokens": m["completion_tokens"]}
                for m in metrics
            ],
            "version_bytes": version_bytes(run / "checkpoints"),
            "evals": [e for e in evals if e["run"] == name],
        }
    return out


def plot(data: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # Version 0 is the imported model in every run: its one eval is every curve's first point.
    base = [(e["version"], e["reward_mean"], e["reward_stderr"])
            for run in data.values() for e in run["evals"] if e["version"] == 0 and not e["greedy"]][:1]
    fig, (train, held) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name, run in data.items():
        style = "-" if run["settings"]["lora"] is None else "--"
        steps = [c["step"] for c in run["curve"]]
        line, = train.plot(steps, [c["reward_mean"] for c in run["curve"]], style, label=name)
        own = [(e["version"], e["reward_mean"], e["reward_stderr"]) for e in run["evals"] if not e["greedy"]]
        points = sorted(own if any(v == 0 for v, _, _ in own) else own + base)
        if points:
            held.errorbar([p[0] for p in points], [p[1] for p in points], yerr=[p[2] for p in points],
                          fmt="o" + style, color=line.get_color(), capsize=3, label=name)
    train.set(xlabel="trainer step", ylabel="training reward (64 samples a step)", ylim=(0, 1),
              title="training batches")
    held.set(xlabel="version", ylabel="held-out accuracy (256 prompts x 4, +- stderr)", ylim=(0, 1),
             title="decentrl eval, facts never trained on")
    for ax in (train, held):
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right")
    fig.suptitle("SmolLM2-135M-Instruct, configs/smollm2.toml, 2 shared CPU cores (2026-11-26)")
    fig.tight_layout()
    fig.savefig(OUT.with_suffix(".png"), dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", action="append", default=[], help="NAME=RUN_DIR (repeat)")
    parser.add_argument("--evals", help="JSON lines of decentrl eval outputs with a 'run' key")
    args = parser.parse_args()
    if args.run:
        OUT.with_suffix(".json").write_text(json.dumps(collect(args.run, args.evals), indent=1) + "\n")
    plot(json.loads(OUT.with_suffix(".json").read_text()))


if __name__ == "__main__":
    main()
