"""The GPU path in one command: the `gpu` tests, trainer and worker against the engine beneath them,
and an end-to-end run of configs/gpu1.toml.

Sections, each in its own process (its own CUDA context, so peak memory is its own), in this order:

  tests    the `gpu`-marked tests (pytest -m gpu over the files that have them): pass/fail counts
  trainer  one full training step (decentrl's rank_share -> accumulate_gradients -> clip -> AdamW,
           FSDP2 on NCCL, 1 rank, bf16 compute) on sequences of a 256-token prompt and a 1,792-token
           completion, for the SmolLM2-135M and Qwen3-0.6B shapes (random weights); the same batch
           through a bare torch loop (autocast bf16, log-softmax policy gradient, AdamW) on the same
           model: tokens/s, MFU, `trainer_vs_bare` (goal >= 0.9), peak memory
  worker   the hf backend (workers/backends/hf.py) against transformers' own `generate`, same
           model (SmolLM2-135M shape, bf16, pulled from a store like a worker does), prompts, batch
           and lengths: completion tokens/s and `worker_hf_vs_bare` (goal >= 0.9)
  compile  the trainer's step with `[trainer] compile` (compiled blocks and loss) against the same
           step eager, both shapes: the first step (the compilation), then its steps warm
  e2e      `decentrl run configs/gpu1.toml` (trainer rank and hf worker sharing GPU 0) for a fixed
           number of steps: trainer busy fraction, seconds per step, publish / pull / swap seconds
           per version, peak GPU memory per role (nvidia-smi, sampled twice a second). Last, with
           what is left of the 8 minutes: a run stopped in its shutdown still reports its steps

MFU counts 6 x (parameters in matmuls, the output projection included, the input embedding not)
+ 6 x layers x heads x head_dim x sequence length (causal attention) FLOPs per token against the
card's dense bf16 peak (989 TFLOP/s for H100 SXM and H200): the convention under which prime-rl's
published Qwen3-0.6B figure (11.9k tokens/s at 16k context on one H100) is an MFU of 11%.

Without CUDA (CI) it runs `--reduced`: the same code paths with 2-layer models of the same
architectures, short sequences, gloo and the CPU, so the script cannot rot; its figures mean nothing.
Every section's result is written to OUT/gpu_check.json as it finishes; the last stdout line is
the whole JSON object (keys in docs/benchmarks.md).

    python benchmarks/gpu_check.py [--out DIR] [--sections tests,trainer,worker,compile,e2e] [--reduced]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

SECTIONS = ("tests", "trainer", "worker", "compile", "e2e")
# Seconds each section may take before it is stopped (its result then says so, with what it had
# printed): 8 minutes in all; `e2e` gets what the others left of them, at most its own (its
# metrics are read from the run's files, so a run stopped while shutting down still reports).
TOTAL_S = 480
BUDGET_S = {"tests": 70, "trainer": 120, "worker": 120, "compile": 150, "e2e": 160}
LAST_MIN_S = 60  # `e2e` is skipped with less left
# Dense bf16 matmul peaks (TFLOP/s) by the card's name, for MFU.
PEAK_TFLOPS = {"H100 PCIe": 756.0, "H100": 989.4, "H200": 989.4, "A100": 312.0}
REDUCED = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16)


def peak_tflops(name: str) -> float | None:
    return next((peak for key, peak in PEAK_TFLOPS.items() if key in name), None)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def texts_of_countdown(count: int = 400) -> list[str]:
    """Text for the shaped models' tokenizer: the countdown task's prompts (configs/gpu1.toml's task)."""
    from decentrl.config import CountdownTaskConfig
    from decentrl.tasks import build_task

    task = build_task(CountdownTaskConfig())
    return [task.prompt(i).text for i in range(min(count, task.num_prompts))]


def shape_overrides(reduced: bool, shape: str) -> dict[str, object]:
    """The reduced (CPU) model: 2 layers of the same architecture, a vocabulary of 512."""
    if not reduced:
        return {}
    overrides = {**REDUCED, "vocab_size": 512}
    if shape == "smollm2-135m":
        overrides.pop("head_dim")  # Llama derives it
    return overrides


# -- trainer ------------------------------------------------------------------------------------


def matmul_flops_per_token(config, seq_len: int) -> float:  # noqa: ANN001 - a transformers config
    """Training FLOPs per token: 6 x matmul parameters (output projection in, input embedding out)
    + causal attention's 6 x layers x heads x head_dim x seq_len."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    params = sum(p.numel() for name, p in model.named_parameters() if "embed_tokens" not in name)
    if config.tie_word_embeddings:
        params += config.vocab_size * config.hidden_size  # the tied output projection still multiplies
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    attention = 6 * config.num_hidden_layers * config.num_attention_heads * head_dim * seq_len
    return 6 * params + attention


def synthetic_batch(rows: int, prompt_len: int, completion_len: int, vocab: int, seed: int):  # noqa: ANN201
    import random

    from decentrl.api.wire import TrainBatch, TrainSample

    rng = random.Random(seed)
    samples = []
    for row in range(rows):
        completion = [rng.randrange(vocab) for _ in range(completion_len)]
        samples.append(TrainSample(
            prompt_token_ids=[rng.randrange(vocab) for _ in range(prompt_len)], completion_token_ids=completion,
            logprobs=[-rng.uniform(0.5, 3.0) for _ in completion], advantage=rng.uniform(-1, 1), reward=rng.random(),
            policy_version=0, group_id=str(row // 4),
        ))
    return TrainBatch(trainer_version=0, samples=samples, staleness_histogram={"0": rows}, rollouts_accepted=rows, stale_dropped=0)


def timed(step, warmup: int, steps: int, sync) -> list[float]:  # noqa: ANN001
    for _ in range(warmup):
        step()
    sync()
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - started)
    return times


def bare_step(model, optimizer, samples, budget: int, device, autocast: bool) -> None:  # noqa: ANN001
    """A plain policy-gradient step over the same samples and micro-batches: what a hand-written
    loop does (logits at the completion positions only, as TRL's `logits_to_keep`)."""
    import torch

    total = sum(len(s.completion_token_ids) for s in samples)
    order = sorted(samples, key=lambda s: -(len(s.prompt_token_ids) + len(s.completion_token_ids)))
    per_micro = max(1, budget // (len(order[0].prompt_token_ids) + len(order[0].completion_token_ids)))
    for start in range(0, len(order), per_micro):
        rows = order[start : start + per_micro]
        ids = torch.tensor([s.prompt_token_ids + s.completion_token_ids for s in rows], device=device)
        p = len(rows[0].prompt_token_ids)
        advantages = torch.tensor([s.advantage for s in rows], device=device)[:, None]  # (B, 1)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            logits = model(input_ids=ids, logits_to_keep=ids.shape[1] - p + 1, use_cache=False).logits[:, :-1].float()  # (B, C, V)
        logprobs = logits.log_softmax(-1).gather(-1, ids[:, p:, None]).squeeze(-1)  # (B, C)
        loss = -(advantages * logprobs).sum() / total
        loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def decentrl_step(config, trainer, batch, device, one_unit: bool | None = None):  # noqa: ANN001, ANN201 - a transformers config; returns the step
    """A fresh FSDP2 model of `config` (seed 0) with the trainer's optimizer, and one full step over
    `batch` as the training loop runs it (`training_step`), its blocks compiled first where
    `trainer.compile` (as `load_policy` does). The model lives as long as the returned function.
    `one_unit`: the whole model one FSDP2 unit or one a block; None: as the trainer (`one_unit_here`)."""
    import torch
    from transformers import AutoModelForCausalLM

    from decentrl.trainer.distributed import shard_model
    from decentrl.trainer.step import compile_blocks

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).to(device).train()
    if trainer.compile:
        compile_blocks(model)
    model = shard_model(model, mixed_precision=trainer.mixed_precision, one_unit=one_unit)
    return training_step(model, trainer, batch, device)


def training_step(model, trainer, batch, device):  # noqa: ANN001, ANN201 - an FSDP2 model; returns the step
    """One full step of the training loop's code over `batch` on `model` (sharded over the ranks of the
    process group) with the trainer's optimizer: this rank's share (rank_share) -> accumulate_gradients
    -> clip -> AdamW -> the loss all-reduce. benchmarks/real_model.py runs it on the imported model."""
    import torch
    import torch.distributed as dist

    from decentrl.trainer.batching import rank_share
    from decentrl.trainer.step import accumulate_gradients, reduce_over_ranks
    from decentrl.trainer.train import build_optimizer

    optimizer = build_optimizer([p for p in model.parameters() if p.requires_grad], trainer)
    max_tokens = max(len(s.completion_token_ids) for s in batch.samples)
    rank, world = dist.get_rank(), dist.get_world_size()

    def step() -> None:
        _, totals, micro_batches = rank_share(
            batch, rank=rank, world=world, config=trainer, max_tokens=max_tokens, pad_id=0, device=device
        )
        loss, sums = accumulate_gradients(model, None, micro_batches, totals=totals, config=trainer, temperature=1.0)
        torch.nn.utils.clip_grad_norm_(model.parameters(), trainer.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        reduce_over_ranks(loss, sums, device)

    return step


def time_decentrl_step(
    config, trainer, batch, device, warmup: int, steps: int, one_unit: bool | None = None,  # noqa: ANN001
) -> tuple[list[float], int | None]:
    """Seconds of each of `steps` steps of `decentrl_step`, and its peak CUDA memory (None on the CPU)."""
    return timed_with_peak(decentrl_step(config, trainer, batch, device, one_unit), warmup, steps, device.type == "cuda")


def time_bare_step(config, trainer, batch, device, warmup: int, steps: int) -> tuple[list[float], int | None]:  # noqa: ANN001
    """The same for the bare loop (`bare_step`) on an unsharded model of the same weights."""
    import torch
    from transformers import AutoModelForCausalLM

    cuda = device.type == "cuda"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=True)  # as ours (build_optimizer)
    return timed_with_peak(
        lambda: bare_step(model, optimizer, batch.samples, trainer.micro_batch_tokens, device, cuda), warmup, steps, cuda
    )


def timed_with_peak(step, warmup: int, steps: int, cuda: bool) -> tuple[list[float], int | None]:  # noqa: ANN001
    import torch

    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    times = timed(step, warmup, steps, torch.cuda.synchronize if cuda else (lambda: None))
    return times, (torch.cuda.max_memory_allocated() if cuda else None)


def trainer_cases(reduced: bool, cuda: bool):  # noqa: ANN201 - yields (key, transformers config, TrainerConfig, batch)
    """The two model shapes the trainer sections time, each with its trainer settings and batch."""
    from decentrl.config import TrainerConfig
    from decentrl.model.chat_model import shape_config

    prompt_len, completion_len = (256, 1792) if not reduced else (16, 48)
    rows = 16 if not reduced else 4
    for shape, budget in (("smollm2-135m", 16384), ("qwen3-0.6b", 8192)):
        config = shape_config(shape, **shape_overrides(reduced, shape))
        trainer = TrainerConfig(
            micro_batch_tokens=budget if not reduced else 256, mixed_precision="bf16" if cuda else "fp32", lr=1e-6
        )
        batch = synthetic_batch(rows, prompt_len, completion_len, config.vocab_size, seed=0)
        yield shape.replace("-", "_").replace(".", "_"), config, trainer, batch


def one_rank(reduced: bool) -> tuple[object, bool, int, int]:
    """A process group of one rank; (device, cuda, warm-up steps, timed steps)."""
    from decentrl.trainer.distributed import init_distributed

    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    _, _, device = init_distributed()
    return device, device.type == "cuda", *((2, 5) if not reduced else (1, 2))


def run_trainer(reduced: bool) -> dict[str, object]:
    import torch

    from decentrl.trainer.distributed import one_unit_here

    device, cuda, warmup, steps = one_rank(reduced)
    peak = peak_tflops(torch.cuda.get_device_name(device)) if cuda else None
    out: dict[str, object] = {"device": torch.cuda.get_device_name(device) if cuda else "cpu", "peak_tflops": peak}
    for key, config, trainer, batch in trainer_cases(reduced, cuda):
        seq_len = len(batch.samples[0].prompt_token_ids) + len(batch.samples[0].completion_token_ids)
        tokens = len(batch.samples) * seq_len
        flops = matmul_flops_per_token(config, seq_len) * tokens

        ours, ours_peak = time_decentrl_step(config, trainer, batch, device, warmup, steps)
        bare, bare_peak = time_bare_step(config, trainer, batch, device, warmup, steps)
        # The other cut of the model into FSDP2 units than the trainer's here (`one_unit_here`: one
        # unit on one CUDA rank, one a block on the CPU), so both are timed either way.
        trainers_cut = one_unit_here(1, device.type)
        other, _ = time_decentrl_step(config, trainer, batch, device, warmup, steps, one_unit=not trainers_cut)
        ours_s, bare_s, other_s = statistics.median(ours), statistics.median(bare), statistics.median(other)
        one_unit_s, per_block_s = (ours_s, other_s) if trainers_cut else (other_s, ours_s)
        out[key] = {
            "tokens_per_step": tokens, "seq_len": seq_len, "step_s": ours_s, "bare_step_s": bare_s,
            "step_s_all": ours, "bare_step_s_all": bare,
            "tokens_per_s": tokens / ours_s, "bare_tokens_per_s": tokens / bare_s,
            "mfu": flops / ours_s / (peak * 1e12) if peak else None,
            "bare_mfu": flops / bare_s / (peak * 1e12) if peak else None,
            "trainer_vs_bare": bare_s / ours_s,
            "one_unit": trainers_cut, "one_unit_step_s": one_unit_s, "per_block_step_s": per_block_s,
            "one_unit_vs_per_block": per_block_s / one_unit_s,
            "peak_memory_gb": ours_peak / 2**30 if ours_peak else None,
            "bare_peak_memory_gb": bare_peak / 2**30 if bare_peak else None,
        }
        print(json.dumps({key: out[key]}), flush=True)
    import torch.distributed as dist

    dist.destroy_process_group()
    return out


def run_compile(reduced: bool) -> dict[str, object]:
    """`[trainer] compile` against the same step eager, on a model of its own each, eager first."""
    import torch
    import torch.distributed as dist

    device, cuda, warmup, steps = one_rank(reduced)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    out: dict[str, object] = {}
    for key, config, trainer, batch in trainer_cases(reduced, cuda):
        eager, _ = time_decentrl_step(config, trainer, batch, device, warmup, steps)
        step = decentrl_step(config, trainer.model_copy(update={"compile": True}), batch, device)
        first = timed(step, 0, 1, sync)[0]  # the compilation, and the step
        compiled, peak = timed_with_peak(step, warmup - 1, steps, cuda)
        eager_s, compiled_s = statistics.median(eager), statistics.median(compiled)
        out[key] = {
            "eager_step_s": eager_s, "compiled_step_s": compiled_s, "compiled_vs_eager": eager_s / compiled_s,
            "compiled_first_step_s": first, "compiled_step_s_all": compiled,
            "compiled_peak_memory_gb": peak / 2**30 if peak else None,
        }
        print(json.dumps({key: out[key]}), flush=True)
    dist.destroy_process_group()
    return out


# -- worker -------------------------------------------------------------------------------------


def pulled_model(directory: str, workdir: str) -> str:
    """`directory` published to a file:// store and pulled back, as a worker receives a version."""
    from decentrl.store.checkpoints import CheckpointStore

    store = CheckpointStore(f"file://{workdir}/store")
    store.publish(0, directory)
    return store.pull(0, f"{workdir}/cache")


def run_worker(reduced: bool) -> dict[str, object]:
    import torch
    from transformers import AutoModelForCausalLM

    from decentrl.api.wire import SamplingParams
    from decentrl.model.chat_model import write_shaped_model
    from workers.backends.hf import HFBackend

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    rows, prompt_len, new_tokens = (64, 256, 256) if not reduced else (4, 16, 16)
    with tempfile.TemporaryDirectory(prefix="decentrl-gpu-check-") as workdir:
        shape = "smollm2-135m"
        source = write_shaped_model(texts_of_countdown(), f"{workdir}/model", shape, **shape_overrides(reduced, shape))
        version = pulled_model(str(source), workdir)
        import random

        rng = random.Random(0)
        prompts = [[rng.randrange(3, 300) for _ in range(prompt_len)] for _ in range(rows)]
        sampling = SamplingParams(temperature=1.0, max_tokens=new_tokens)

        backend = HFBackend(device=device, seed=0)
        backend.load(version, 0)
        dtype = next(backend.model.parameters()).dtype
        eos, pad = backend._eos_and_pad()
        model = AutoModelForCausalLM.from_pretrained(version, dtype=dtype).to(device).eval()
        input_ids = torch.tensor(prompts, device=device)
        kwargs = dict(attention_mask=torch.ones_like(input_ids), do_sample=True, temperature=1.0, top_k=0, top_p=1.0, pad_token_id=pad)

        def hf() -> int:
            return sum(len(c.token_ids) for c in backend.generate(prompts, sampling))

        def bare() -> int:  # transformers' generate, same weights and sampling (no top-k/top-p), stops at the same ids
            output = model.generate(input_ids=input_ids, max_new_tokens=new_tokens, **kwargs)
            rows = output[:, prompt_len:].tolist()
            return sum(next((i + 1 for i, t in enumerate(row) if t in eos), len(row)) for row in rows)

        # The first pass at a shape pays one-time costs (cuDNN attention builds a plan per sequence
        # length); it is reported, and both are then timed warm, alternating, twice each.
        sync = torch.cuda.synchronize if cuda else (lambda: None)
        cold, warm, peaks = {}, {"hf": [], "bare": []}, {}
        for name, run in (("hf", hf), ("bare", bare), ("hf", hf), ("bare", bare), ("hf", hf), ("bare", bare)):
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            sync()
            started = time.perf_counter()
            tokens = run()
            sync()
            seconds = time.perf_counter() - started
            if name not in cold:
                cold[name] = seconds
            else:
                warm[name].append(tokens / seconds)
            peaks[name] = max(peaks.get(name, 0.0), torch.cuda.max_memory_allocated() / 2**30) if cuda else None
        # Then once each with cuDNN's attention off (SDPA picks flash or memory-efficient kernels,
        # which build no plan per sequence length). The hf backend decodes so anyway (since
        # 2026-11-27: `without_cudnn_attention`); here `generate` does too.
        no_cudnn: dict[str, float] = {}
        torch.backends.cuda.enable_cudnn_sdp(False)
        try:
            for name, run in (("hf", hf), ("bare", bare)):
                sync()
                started = time.perf_counter()
                tokens = run()
                sync()
                no_cudnn[name] = tokens / (time.perf_counter() - started)
        finally:
            torch.backends.cuda.enable_cudnn_sdp(True)
    ours_rate, bare_rate = statistics.median(warm["hf"]), statistics.median(warm["bare"])
    return {
        "device": torch.cuda.get_device_name() if cuda else "cpu", "dtype": str(dtype).removeprefix("torch."),
        "rows": rows, "prompt_len": prompt_len, "max_new_tokens": new_tokens,
        "hf_tokens_per_s": ours_rate, "bare_tokens_per_s": bare_rate, "worker_hf_vs_bare": ours_rate / bare_rate,
        "hf_tokens_per_s_all": warm["hf"], "bare_tokens_per_s_all": warm["bare"],
        "hf_cold_s": cold["hf"], "bare_cold_s": cold["bare"],  # bare's first pass follows hf's: shared plan caches
        "hf_tokens_per_s_no_cudnn_sdp": no_cudnn["hf"], "bare_tokens_per_s_no_cudnn_sdp": no_cudnn["bare"],
        "worker_hf_vs_bare_no_cudnn_sdp": no_cudnn["hf"] / no_cudnn["bare"],
        "peak_memory_gb": peaks["hf"], "bare_peak_memory_gb": peaks["bare"],
    }


# -- tests --------------------------------------------------------------------------------------


def run_tests(timeout_s: float) -> dict[str, object]:
    files = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py") if "pytest.mark.gpu" in p.read_text())
    argv = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", "-rs", *files]
    try:
        done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as exc:
        return {"files": files, "error": f"timed out after {timeout_s:.0f}s", "output_tail": str(exc.stdout or "")[-2000:]}
    counts = {
        word: int(n)
        for n, word in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected)", done.stdout.splitlines()[-1] if done.stdout else "")
    }
    return {"files": files, "exit_code": done.returncode, **{k: counts.get(k, 0) for k in ("passed", "failed", "skipped")},
            "errors": counts.get("error", 0) + counts.get("errors", 0),
            "output_tail": (done.stdout + done.stderr)[-1500:] if done.returncode not in (0, 5) else ""}


# -- end to end ---------------------------------------------------------------------------------


class GpuMemorySampler(threading.Thread):
    """Peak GPU memory per process (nvidia-smi, twice a second), named by the role it belongs to."""

    def __init__(self, run_dir: str) -> None:
        super().__init__(daemon=True)
        self.run_dir, self.peaks, self.total_peak = run_dir, {}, 0
        self.roles: dict[int, str] = {}  # a pid's role, named while it lives: an exiting one has no cmdline
        self.stopping = threading.Event()

    @staticmethod
    def role_of(pid: int) -> str:
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_text().split("\0")
        except OSError:
            return f"pid-{pid}"
        if "--worker-id" in argv:
            return argv[argv.index("--worker-id") + 1]
        for role in ("trainer", "scorer", "orchestrator"):
            if role in argv:
                return role
        return f"pid-{pid}"

    def named(self, pid: int) -> str:
        """`role_of`, remembered from the first time it names one: an exiting process has no cmdline."""
        role = self.roles.get(pid) or self.role_of(pid)
        if not role.startswith("pid-"):
            self.roles[pid] = role
        return role

    def run(self) -> None:
        while not self.stopping.wait(0.5):
            try:
                apps = subprocess.run(
                    ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                    capture_output=True, text=True, timeout=5,
                ).stdout
                used = subprocess.run(
                    ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=5
                ).stdout
            except (OSError, subprocess.TimeoutExpired):
                return
            for line in apps.splitlines():
                fields = [x.strip() for x in line.split(",")]
                if len(fields) == 2 and all(x.isdigit() for x in fields):  # "[N/A]" where the driver hides it
                    role = self.named(int(fields[0]))
                    self.peaks[role] = max(self.peaks.get(role, 0), int(fields[1]))
            self.total_peak = max([self.total_peak] + [int(x) for x in used.split() if x.isdigit()])


def start_run(argv: list[str]) -> subprocess.Popen[str]:
    """`decentrl run` (`argv`) in a session of its own, its output piped: for `finish_run`."""
    return subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def finish_run(process: subprocess.Popen[str], timeout_s: float, stop_s: float = 45.0) -> tuple[int | None, str]:
    """Wait for a `start_run` process: (its exit code, its output). Out of time, (None, its output):
    interrupted as at a terminal, the run stops every role it started (each in a session of its
    own) and waits for them, so none is left running (holding a GPU) after it; a run that does not
    stop within `stop_s` is killed with every role below it."""
    from decentrl.cli.launch import descendants, kill_all, running

    try:
        out, _ = process.communicate(timeout=timeout_s)
        return process.returncode, out
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGINT)
        try:
            out, _ = process.communicate(timeout=stop_s)
        except subprocess.TimeoutExpired:
            # The roles sit in sessions of their own: the run's group signal does not reach them, and
            # their death signal (PR_SET_PDEATHSIG) takes its time on a loaded machine.
            roles = descendants(process.pid)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            kill_all(roles)
            out, _ = process.communicate()
            deadline = time.monotonic() + 30
            while any(running(pid) for pid in roles) and time.monotonic() < deadline:
                time.sleep(0.1)
        return None, out


def run_e2e(reduced: bool, timeout_s: float) -> dict[str, object]:
    import shutil

    import torch

    from decentrl.model.chat_model import write_shaped_model

    cuda = torch.cuda.is_available()
    steps, max_tokens = (3, 384) if not reduced else (3, 8)  # 4 steps until 2026-11-27 (step 1 waits for rollouts)
    workdir = tempfile.mkdtemp(prefix="decentrl-gpu-e2e-")
    try:
        shape = "smollm2-135m"
        model_dir = write_shaped_model(texts_of_countdown(), f"{workdir}/model", shape, **shape_overrides(reduced, shape))
        run_dir = f"{workdir}/run"
        overrides = [f"model.path={model_dir}", f"trainer.steps={steps}", f"sampling.max_tokens={max_tokens}"]
        if reduced:  # the CPU: no placement, fp32, small batches
            overrides += ["placement.trainer.gpus=[]", "placement.workers.gpus=[]", "worker.device=cpu",
                          "trainer.mixed_precision=fp32", "trainer.groups_per_step=2", "worker.groups_per_request=2",
                          "trainer.micro_batch_tokens=4096"]
        argv = [sys.executable, "-m", "decentrl", "run", str(ROOT / "configs" / "gpu1.toml"), "--run-dir", run_dir]
        for item in overrides:
            argv += ["--set", item]
        sampler = GpuMemorySampler(run_dir) if cuda and shutil.which("nvidia-smi") else None
        if sampler:
            sampler.start()
        started = time.perf_counter()
        code, out = finish_run(start_run(argv), timeout_s)
        tail = out[-1500:] if code is not None else f"timed out after {timeout_s:.0f}s\n" + out[-1500:]
        wall = time.perf_counter() - started
        if sampler:
            sampler.stopping.set()
            sampler.join()
        metrics = (
            [json.loads(line) for line in Path(run_dir, "metrics.jsonl").read_text().splitlines()]
            if Path(run_dir, "metrics.jsonl").exists()
            else []
        )
        swaps = []
        for log in Path(run_dir, "logs").glob("worker-*.log"):
            swaps += [tuple(map(float, m)) for m in re.findall(r"loaded version \d+: pull ([\d.]+)s, pause ([\d.]+)s", log.read_text())]
        trained = [m for m in metrics if m["step"] > 1] or metrics  # step 1 waits for the first rollouts
        result: dict[str, object] = {
            "exit_code": code,
            "wall_s": wall,
            "steps": len(metrics),
            "max_tokens": max_tokens,
            "step_s": statistics.fmean(m["step_s"] for m in trained) if trained else None,
            "compute_s": statistics.fmean(m["compute_s"] for m in trained) if trained else None,
            "trainer_busy_fraction": metrics[-1]["trainer_busy_fraction_total"] if metrics else None,
            "trainer_tokens_per_s": statistics.fmean(m["tokens_per_s"] for m in trained) if trained else None,
            "publish_s": statistics.fmean(m["publish_s"] for m in metrics if "publish_s" in m)
            if any("publish_s" in m for m in metrics)
            else None,
            "pull_s": statistics.fmean(s[0] for s in swaps) if swaps else None,
            "swap_pause_s": statistics.fmean(s[1] for s in swaps) if swaps else None,
            "versions_loaded": len(swaps),
            "peak_gpu_memory_mib": sampler.peaks if sampler else None,
            "gpu_memory_used_peak_mib": sampler.total_peak if sampler else None,
        }
        if code != 0:
            result["output_tail"] = tail
            logs = sorted(Path(run_dir, "logs").glob("*.log")) if Path(run_dir, "logs").exists() else []
            result["logs_tail"] = {p.name: p.read_text(errors="replace")[-800:] for p in logs}
        return result
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


# -- driver -------------------------------------------------------------------------------------


def child(section: str, reduced: bool) -> None:
    """One section in this process; its result is the last stdout line."""
    result = {"trainer": run_trainer, "worker": run_worker, "compile": run_compile}[section](reduced)
    print(json.dumps(result), flush=True)


def printed_so_far(stdout: str | bytes | None) -> dict[str, object]:
    """The JSON objects a section stopped early had printed (one a shape), merged: the later wins."""
    text = stdout.decode(errors="replace") if isinstance(stdout, bytes) else stdout or ""
    merged: dict[str, object] = {}
    for line in text.splitlines():
        try:
            value = json.loads(line)
        except ValueError:
            continue
        if isinstance(value, dict):
            merged.update(value)
    return merged


def in_child(section: str, reduced: bool, timeout_s: float) -> dict[str, object]:
    argv = [sys.executable, __file__, "--child", section] + (["--reduced"] if reduced else [])
    try:
        done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as exc:
        stderr = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else exc.stderr or ""
        return {**printed_so_far(exc.stdout), "error": f"timed out after {timeout_s:.0f}s", "output_tail": stderr[-1500:]}
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        return {"error": f"exit code {done.returncode}", "output_tail": (done.stdout + done.stderr)[-2500:]}
    return json.loads(lines[-1])


def compiled_vs_bare(trainer: dict, compiled: dict, shape: str) -> float | None:
    bare, ours = trainer.get(shape, {}).get("bare_step_s"), compiled.get(shape, {}).get("compiled_step_s")
    return bare / ours if bare and ours else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.environ.get("OUT") or "runs/gpu_check", help="Directory for gpu_check.json.")
    parser.add_argument("--sections", default=",".join(SECTIONS), help="Comma-separated, from: " + ", ".join(SECTIONS))
    parser.add_argument("--reduced", action="store_true", help="Small shapes (the default without CUDA).")
    parser.add_argument("--child", choices=("trainer", "worker", "compile"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    import torch

    reduced = args.reduced or not torch.cuda.is_available()
    if args.child:
        child(args.child, reduced)
        return
    sections = [s for s in args.sections.split(",") if s]
    if unknown := set(sections) - set(SECTIONS):
        parser.error(f"unknown sections {sorted(unknown)}: choose from {', '.join(SECTIONS)}")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    result: dict[str, object] = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "reduced": reduced,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__, "cuda": torch.version.cuda,
    }
    started = time.perf_counter()
    for section in sections:
        began = time.perf_counter()
        budget = BUDGET_S[section] * (3 if reduced else 1)  # 2 CPU cores are slower than the GPU
        if section == "e2e" and not reduced:
            budget = min(budget, TOTAL_S - (began - started))
            if budget < LAST_MIN_S:
                result[section] = {"error": f"skipped: {budget:.0f}s left of the {TOTAL_S}s"}
                continue
        if section == "tests":
            result[section] = run_tests(budget)
        elif section == "e2e":
            result[section] = run_e2e(reduced, budget)
        else:
            result[section] = in_child(section, reduced, budget)
        result[section]["section_s"] = time.perf_counter() - began  # type: ignore[index]
        print(f"{section}: {json.dumps(result[section])}", file=sys.stderr, flush=True)
        (out_dir / "gpu_check.json").write_text(json.dumps(result, indent=2))
    trainer, worker, compiled = result.get("trainer", {}), result.get("worker", {}), result.get("compile", {})
    result["summary"] = {
        "trainer_vs_bare_135m": trainer.get("smollm2_135m", {}).get("trainer_vs_bare"),
        "trainer_vs_bare_0_6b": trainer.get("qwen3_0_6b", {}).get("trainer_vs_bare"),
        "one_unit_vs_per_block_135m": trainer.get("smollm2_135m", {}).get("one_unit_vs_per_block"),
        "one_unit_vs_per_block_0_6b": trainer.get("qwen3_0_6b", {}).get("one_unit_vs_per_block"),
        "trainer_mfu_0_6b": trainer.get("qwen3_0_6b", {}).get("mfu"),
        "trainer_tokens_per_s_0_6b": trainer.get("qwen3_0_6b", {}).get("tokens_per_s"),
        "compiled_vs_eager_135m": compiled.get("smollm2_135m", {}).get("compiled_vs_eager"),
        "compiled_vs_eager_0_6b": compiled.get("qwen3_0_6b", {}).get("compiled_vs_eager"),
        # The compiled step against the trainer section's bare loop: two processes, one card.
        "compiled_vs_bare_135m": compiled_vs_bare(trainer, compiled, "smollm2_135m"),
        "compiled_vs_bare_0_6b": compiled_vs_bare(trainer, compiled, "qwen3_0_6b"),
        "worker_hf_vs_bare": worker.get("worker_hf_vs_bare"),
        "gpu_tests_passed": result.get("tests", {}).get("passed"),
        "gpu_tests_failed": result.get("tests", {}).get("failed"),
        "total_s": time.perf_counter() - started,
    }
    (out_dir / "gpu_check.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
