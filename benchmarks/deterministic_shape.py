"""CPU cost per sample of a deterministic worker's generation, by call shape.

A deterministic worker generates in calls of one fixed shape, `[worker]
deterministic_groups_per_call` groups (workers/batching.py, docs/reproducibility.md); this
measures what that choice costs: process CPU time per row of seeded generation (one generator
per row, as a deterministic run samples) on the demo model (configs/local.toml's [model] and
[task], group size 8, max_tokens 6) for 1..16 groups per call, and the free-running worker's
shared-generator call of 16 groups for comparison. Figures are medians of --repeats calls.

    PYTHONPATH=. .venv/bin/python benchmarks/deterministic_shape.py

Prints, as its last line, one JSON object: {"ms_per_row": {groups: ms}, "shared_ms_per_row_16_groups",
"settings"}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--groups", default="1,2,4,8,16", help="Groups per call to measure.")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()

    from decentrl.api.wire import SamplingParams
    from decentrl.config import load_config
    from decentrl.model.build import build_model, build_tiny_tokenizer
    from decentrl.rl.determinism import use_deterministic_torch
    from decentrl.store.weights import write_hf_dir
    from decentrl.tasks import build_task
    from workers.backends.hf import HFBackend

    config = load_config(str(ROOT / "configs" / "local.toml"), [])
    use_deterministic_torch(config.worker.torch_threads)
    directory = tempfile.mkdtemp(prefix="decentrl-shape-")
    model, tokenizer = build_model(config.model), build_tiny_tokenizer()
    tokenizer.save_pretrained(directory)
    model.generation_config.save_pretrained(directory)
    write_hf_dir(directory, model.state_dict(), model.config, extras_from=directory)
    backend = HFBackend(seed=0)
    backend.load(directory, 0)
    task = build_task(config.task)
    prompts = [tokenizer(task.prompt(i).text)["input_ids"] for i in range(512)]
    size, sampling = config.group_size, SamplingParams(**config.sampling.model_dump())

    def ms_per_row(groups: int, seeded: bool) -> float:
        rows, costs = groups * size, []
        for repeat in range(args.repeats):
            batch = [prompts[(repeat * groups + g) % len(prompts)] for g in range(groups) for _ in range(size)]
            started = time.process_time()
            backend.generate(batch, sampling, seeds=list(range(rows)) if seeded else None)
            costs.append((time.process_time() - started) / rows * 1000)
        return statistics.median(costs)

    measured = {int(g): round(ms_per_row(int(g), seeded=True), 3) for g in args.groups.split(",")}
    print(json.dumps({
        "ms_per_row": measured,
        "shared_ms_per_row_16_groups": round(ms_per_row(16, seeded=False), 3),
        "settings": {"group_size": size, "max_tokens": sampling.max_tokens, "repeats": args.repeats,
                     "torch_threads": config.worker.torch_threads},
    }))


if __name__ == "__main__":
    main()
