"""Peak memory and time of the loss's per-token statistics, in chunks of positions, whole, or compiled.

`decentrl/trainer/step.py` `token_stats` computes each target's logprob and each position's
entropy from the model's logits in float32. Above `[trainer] loss_chunk_mb` of float32 logits it
does so over chunks of positions, recomputed in the backward, so that no float32 (B, T, V) tensor
exists whole. This times one forward and backward of it (the entropy a statistic, without gradient, as
by default) on random logits of the given shape in the model's compute dtype, in a fresh process
for each mode, and reports the growth of the peak resident memory (VmHWM) over the logits and
their gradient alone, and seconds (median of --rounds). `compiled` is the whole with `[trainer]
compile` (the statistics compiled by torch.compile): its first pass, the compilation, is timed
apart (`compile_s`) and its peak counts the compiler's own memory.

    .venv/bin/python benchmarks/loss_memory.py [--rows 8 --positions 1792 --vocab 49152 --dtype bfloat16] [--chunk-mb 1024]

The last stdout line is one JSON object: for `whole`, `chunked` and `compiled`,
`peak_over_inputs_gb` and `seconds`; `chunked_vs_whole_peak`, `chunked_vs_whole_time`,
`compiled_vs_whole_peak` and `compiled_vs_whole_time` (the mode / whole).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from decentrl.config import TrainerConfig  # noqa: E402


def high_water_bytes() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM"))


def measure(args: argparse.Namespace) -> dict[str, float]:
    """In this process: one mode, `args.rounds` forward + backward passes."""
    import torch

    from decentrl.trainer import step

    torch.set_num_threads(args.threads)
    chunk_mb = args.chunk_mb if args.mode == "chunked" else 0
    compiled = args.mode == "compiled"
    generator = torch.Generator().manual_seed(0)
    logits = (torch.randn(args.rows, args.positions, args.vocab, generator=generator) * 3).to(getattr(torch, args.dtype))
    logits.requires_grad_(True)
    targets = torch.randint(0, args.vocab, (args.rows, args.positions), generator=generator)
    logits.grad = torch.zeros_like(logits)  # the gradient's own memory counted with the inputs
    before = high_water_bytes()
    times = []
    for _ in range(args.rounds + compiled):
        started = time.perf_counter()
        logprobs, entropies = step.token_stats(logits, targets, None, args.temperature, chunk_mb=chunk_mb, compiled=compiled)
        (logprobs.sum() + entropies.detach().sum() * 0).backward()
        times.append(time.perf_counter() - started)
    first = times.pop(0) if compiled else None
    return {"peak_over_inputs_gb": (high_water_bytes() - before) / 1e9, "seconds": statistics.median(times),
            "seconds_all": times, "compile_s": first}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--positions", type=int, default=1792)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--chunk-mb", type=float, default=TrainerConfig().loss_chunk_mb, help="[trainer] loss_chunk_mb")
    parser.add_argument("--mode", choices=("whole", "chunked", "compiled"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.mode:
        print(json.dumps(measure(args)))
        return
    result: dict[str, object] = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "rows": args.rows, "positions": args.positions,
        "vocab": args.vocab, "dtype": args.dtype, "chunk_mb": args.chunk_mb,
        "float32_copy_gb": args.rows * args.positions * args.vocab * 4 / 1e9, "load_avg": [os.getloadavg()],
    }
    for mode in ("whole", "chunked", "compiled"):
        command = [sys.executable, __file__, *sys.argv[1:], "--mode", mode]
        result[mode] = json.loads(subprocess.run(command, check=True, capture_output=True, text=True).stdout.splitlines()[-1])
    result["load_avg"].append(os.getloadavg())  # type: ignore[attr-defined]
    whole = result["whole"]
    grown = whole["peak_over_inputs_gb"]  # type: ignore[index]
    for mode in ("chunked", "compiled"):
        other = result[mode]
        result[f"{mode}_vs_whole_peak"] = other["peak_over_inputs_gb"] / grown if grown > 0 else None  # type: ignore[index]
        result[f"{mode}_vs_whole_time"] = other["seconds"] / whole["seconds"]  # type: ignore[index]
    print(json.dumps(result))


if __name__ == "__main__":
    main()
