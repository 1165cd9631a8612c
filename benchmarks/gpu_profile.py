"""Where the GPU time goes: the hf worker's decode loop and the trainer's step against their bare
counterparts (benchmarks/gpu_check.py measures the ratios; this says why they are what they are).

  worker   hf backend decode (as shipped, and with Gumbel-max sampling in place of
           torch.multinomial) vs transformers' generate: tokens/s, and torch.profiler's top ops
           by self CPU and CUDA time over a short decode of each
  trainer  one full decentrl step vs the bare loop of gpu_check.py (Qwen3-0.6B shape, 2k tokens),
           and the step with the entropy statistic off: step seconds and the top ops of each

Writes OUT/profile.txt (the tables) and prints one JSON line of timings last.

    python benchmarks/gpu_profile.py [--out DIR] [--sections worker,trainer]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from benchmarks.gpu_check import (  # noqa: E402
    bare_step,
    decentrl_step,
    free_port,
    pulled_model,
    shape_overrides,
    synthetic_batch,
    texts_of_countdown,
    timed,
)

ACTIVITIES = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def table(prof: profile, title: str, rows: int = 18) -> str:
    cuda = torch.cuda.is_available()
    parts = [f"== {title}: by self CPU time"]
    parts.append(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows))
    if cuda:
        parts.append(f"== {title}: by self CUDA time")
        parts.append(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=rows))
    return "\n".join(parts)


def gumbel_sample(self, dist: torch.Tensor, generators):  # noqa: ANN001, ANN201 - HFBackend._sample's signature
    """Exact categorical sampling as vLLM does it: argmax of p / Exp(1) noise."""
    probs = dist.exp()
    if generators is None:
        return (probs / torch.empty_like(probs).exponential_(generator=self.generator)).argmax(-1, keepdim=True)
    return torch.cat([
        (probs[row : row + 1] / torch.empty_like(probs[row : row + 1]).exponential_(generator=g)).argmax(-1, keepdim=True)
        for row, g in enumerate(generators)
    ])


def worker(reduced: bool, report: list[str]) -> dict[str, object]:
    from transformers import AutoModelForCausalLM

    from decentrl.api.wire import SamplingParams
    from decentrl.model.chat_model import write_shaped_model
    from workers.backends.hf import HFBackend

    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows, prompt_len, new_tokens = (64, 256, 128) if not reduced else (4, 16, 8)
    out: dict[str, object] = {}
    with tempfile.TemporaryDirectory() as workdir:
        shape = "smollm2-135m"
        version = pulled_model(
            str(write_shaped_model(texts_of_countdown(), f"{workdir}/m", shape, **shape_overrides(reduced, shape))), workdir
        )
        rng = random.Random(0)
        prompts = [[rng.randrange(3, 300) for _ in range(prompt_len)] for _ in range(rows)]
        sampling = SamplingParams(temperature=1.0, max_tokens=new_tokens)
        backend = HFBackend(device=device, seed=0)
        backend.load(version, 0)
        backend.generate(prompts[:2], sampling.model_copy(update={"max_tokens": 4}))

        def timed_generate(label: str) -> None:
            sync()
            started = time.perf_counter()
            done = backend.generate(prompts, sampling)
            sync()
            seconds = time.perf_counter() - started
            out[label] = {"s": seconds, "tokens_per_s": sum(len(c.token_ids) for c in done) / seconds}

        timed_generate("hf")
        with profile(activities=ACTIVITIES) as prof:
            backend.generate(prompts, sampling.model_copy(update={"max_tokens": 16}))
        report.append(table(prof, "hf backend decode, 16 tokens"))
        shipped = HFBackend._sample
        HFBackend._sample = gumbel_sample  # type: ignore[method-assign]
        try:
            backend.generate(prompts[:2], sampling.model_copy(update={"max_tokens": 4}))
            timed_generate("hf_gumbel")
        finally:
            HFBackend._sample = shipped  # type: ignore[method-assign]
        dtype = next(backend.model.parameters()).dtype
        backend = None  # its memory freed before the bare model loads

        model = AutoModelForCausalLM.from_pretrained(version, dtype=dtype).to(device).eval()
        ids = torch.tensor(prompts, device=device)
        kwargs = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, pad_token_id=0, attention_mask=torch.ones_like(ids))
        model.generate(input_ids=ids, max_new_tokens=4, **kwargs)
        sync()
        started = time.perf_counter()
        generated = model.generate(input_ids=ids, max_new_tokens=new_tokens, **kwargs)
        sync()
        seconds = time.perf_counter() - started
        out["bare"] = {"s": seconds, "tokens_per_s": (generated.shape[1] - prompt_len) * rows / seconds}
        with profile(activities=ACTIVITIES) as prof:
            model.generate(input_ids=ids, max_new_tokens=16, **kwargs)
        report.append(table(prof, "transformers generate, 16 tokens"))
    return out


def trainer(reduced: bool, report: list[str]) -> dict[str, object]:
    from transformers import AutoModelForCausalLM

    import decentrl.trainer.step as step_module
    from decentrl.config import TrainerConfig
    from decentrl.model.chat_model import shape_config
    from decentrl.trainer.distributed import init_distributed

    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    _, _, device = init_distributed()
    cuda = device.type == "cuda"
    shape = "qwen3-0.6b"
    config = shape_config(shape, **shape_overrides(reduced, shape))
    prompt_len, completion_len, rows = (256, 1792, 16) if not reduced else (16, 48, 4)
    cfg = TrainerConfig(micro_batch_tokens=8192 if not reduced else 256, mixed_precision="bf16" if cuda else "fp32")
    batch = synthetic_batch(rows, prompt_len, completion_len, config.vocab_size, seed=0)
    ours = decentrl_step(config, cfg, batch, device)

    def seconds(fn) -> float:  # noqa: ANN001
        return statistics.median(timed(fn, 1, 3, sync))

    out: dict[str, object] = {"ours_s": seconds(ours)}
    with profile(activities=ACTIVITIES) as prof:
        ours()
        sync()
    report.append(table(prof, "decentrl trainer step, Qwen3-0.6B shape"))
    shipped = step_module.entropy
    step_module.entropy = lambda logits, normalizer: torch.zeros_like(normalizer)  # type: ignore[assignment]
    try:
        out["ours_no_entropy_s"] = seconds(ours)
    finally:
        step_module.entropy = shipped  # type: ignore[assignment]
    ours = None  # its model freed before the bare model is built
    if cuda:
        torch.cuda.empty_cache()
    torch.manual_seed(0)
    bare_model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).to(device).train()
    bare_optimizer = torch.optim.AdamW(bare_model.parameters(), lr=1e-6)

    def bare() -> None:
        bare_step(bare_model, bare_optimizer, batch.samples, cfg.micro_batch_tokens, device, cuda)

    out["bare_s"] = seconds(bare)
    with profile(activities=ACTIVITIES) as prof:
        bare()
        sync()
    report.append(table(prof, "bare step, Qwen3-0.6B shape"))
    import torch.distributed as dist

    dist.destroy_process_group()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.environ.get("OUT") or "runs/gpu_profile")
    parser.add_argument("--sections", default="worker,trainer")
    args = parser.parse_args()
    reduced = not torch.cuda.is_available()
    report: list[str] = []
    result: dict[str, object] = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "reduced": reduced}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    for section in args.sections.split(","):
        result[section] = worker(reduced, report) if section == "worker" else trainer(reduced, report)
        Path(args.out, "profile.txt").write_text("\n\n".join(report))
        print(f"{section}: {json.dumps(result[section])}", file=sys.stderr, flush=True)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
