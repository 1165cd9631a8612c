"""Does this machine have the GPUs a setting names, how much of one a process may take, and
which dtype each role computes in here (`compute_dtype`, `machine`).

One check for every role and for `decentrl run`: `device_problem` (a role's `device` setting) and
`placement_problem` (a run's [placement], before any role starts) both come down to
`gpus_problem`, which takes the machine's GPU count as a parameter so that it is tested on CPU.
They return a one-line message naming the setting and what to change (None: fine); the caller
turns it into its own error (the launcher's "error:", a scorer's BackendConfigError, a worker's
exit). torch is imported inside the functions that need it, so the launcher stays light.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    import torch

    from decentrl.config import RunConfig


def available_gpus() -> int:
    """CUDA GPUs torch sees on this machine (under this process's CUDA_VISIBLE_DEVICES); 0 without CUDA."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def gpus_problem(setting: str, value: object, gpus: Sequence[int], available: int, *, instead: str) -> str | None:
    """What is wrong with `setting` = `value` naming GPU indices `gpus` on a machine with `available`
    GPUs; `instead`: the way out besides another machine (e.g. "remove [placement]")."""
    if gpus and available == 0:
        return (f"{setting} = {value!r} but this machine has no CUDA GPU (torch.cuda.is_available() is False): "
                f"{instead} or run on a GPU machine")
    missing = [gpu for gpu in gpus if gpu >= available]
    if missing:
        exist = "GPU 0" if available == 1 else f"GPUs 0..{available - 1}"
        return (f"{setting} = {value!r} names GPU {missing[0]} but this machine has {available} "
                f"(torch.cuda.device_count(): {exist}): name GPUs that exist, or {instead}")
    return None


def device_problem(setting: str, device: str, available: int) -> str | None:
    """What is wrong with a role's torch device setting (`worker.device = 'cuda:1'`) here; None: fine."""
    if not device.startswith("cuda"):
        return None
    _, _, index = device.partition(":")
    return gpus_problem(setting, device, [int(index) if index.isdigit() else 0], available, instead=f"set {setting} = 'cpu'")


def needs_cuda(config: RunConfig) -> bool:
    """Whether `decentrl run` would start a role on CUDA, i.e. whether counting GPUs is worth importing torch."""
    return config.placement.used or _devices(config) != []


def placement_problem(config: RunConfig, available: int) -> str | None:
    """What keeps `decentrl run` from starting `config` on a machine with `available` GPUs: a
    [placement] GPU that is not there, or the device of a role it starts unplaced (hf workers,
    hf scorers) naming CUDA without it. None: every role can start."""
    placement = config.placement
    for key, role in (("trainer", placement.trainer), ("workers", placement.workers), ("scorers", placement.scorers)):
        problem = gpus_problem(f"placement.{key}.gpus", role.gpus, role.gpus, available, instead="remove [placement]")
        if problem:
            return problem
    for setting, device in _devices(config):
        problem = device_problem(setting, device, available)
        if problem:
            return problem
    return None


def _devices(config: RunConfig) -> list[tuple[str, str]]:
    """The device settings of the roles `decentrl run` starts that [placement] leaves to them."""
    devices = []
    if config.worker.backend == "hf" and not config.placement.workers.gpus and config.worker.device.startswith("cuda"):
        devices.append(("worker.device", config.worker.device))
    scorer = config.scorer
    if (config.num_scorers and scorer is not None and scorer.type == "hf" and not config.placement.scorers.gpus
            and scorer.device.startswith("cuda")):
        devices.append(("scorer.device", scorer.device))
    return devices


def limit_gpu_memory(device: torch.device, share: float | None) -> None:
    """Let this process's CUDA caching allocator take at most `share` of `device`'s memory; a CPU
    device or no share: nothing to limit. Call before the first allocation on the device."""
    import torch

    if share is not None and device.type == "cuda":
        torch.cuda.set_per_process_memory_fraction(share, device.index)  # index None: the current device


# -- what this machine computes fast ------------------------------------------------------

ComputeDtype = Literal["auto", "fp32", "bf16"]
_DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16"}


@dataclass(frozen=True)
class Machine:
    """What a role computes on, for its start-up line, /v1/status and the benchmarks' reports.
    `isa`: the vector instructions torch's CPU kernels use here - "amx", "avx512", "avx2", "arm",
    or "default" - read from torch (torch.backends.cpu.get_cpu_capability), so that an emulated
    AVX2 machine (ATEN_CPU_CAPABILITY=avx2 on an AVX-512 CPU, docs/reproducibility.md) reports
    avx2; `cpu_isa` is what the CPU itself has. `bf16_native`: the device computes bf16 in
    hardware (`bf16_native`)."""

    device: str  # "cpu", or the CUDA device's name
    isa: str
    cpu_isa: str
    threads: int
    bf16_native: bool

    def line(self, compute: str) -> str:
        """One line for a role's start-up log: device, ISA, threads, compute dtype."""
        emulated = f" (emulated; the CPU has {self.cpu_isa})" if self.cpu_isa != self.isa else ""
        bf16 = "native" if self.bf16_native else "not native"
        return f"{self.device}, {self.isa}{emulated}, {self.threads} threads, bf16 {bf16}: computes in {compute}"


def machine(device: str = "cpu") -> Machine:
    """This process's `device` (a torch device string) as a `Machine`."""
    import torch

    isa, cpu_isa = _kernel_isa(), _cpu_isa()
    target = torch.device(device)
    name = torch.cuda.get_device_name(target) if target.type == "cuda" else target.type
    return Machine(name, isa, cpu_isa, torch.get_num_threads(), bf16_native(target))


def _cpu_isa() -> str:
    """The widest vector ISA the CPU has, whatever torch is told to use."""
    import platform

    import torch

    if platform.machine() in ("aarch64", "arm64"):
        return "arm"
    if torch.cpu._is_amx_tile_supported():
        return "amx"
    if torch.cpu._is_avx512_supported():
        return "avx512"
    return "avx2" if torch.cpu._is_avx2_supported() else "default"


def _kernel_isa() -> str:
    """The ISA torch's CPU kernels dispatch to (ATEN_CPU_CAPABILITY lowers it); AMX where the
    kernels are AVX-512 and the CPU has AMX tiles (oneDNN's bf16 matmuls use them)."""
    import torch

    capability = torch.backends.cpu.get_cpu_capability().lower()  # "avx2", "avx512", "default", "sve256", ...
    cpu = _cpu_isa()
    if cpu == "arm":
        return "arm"
    if capability == "avx512":
        return "amx" if cpu == "amx" else "avx512"
    return capability


def bf16_native(device: torch.device) -> bool:
    """Whether `device` computes bf16 in hardware: CUDA with bf16 (compute capability 8.0 and up),
    an x86 CPU with AVX-512 bf16 or AMX (and torch's kernels allowed to use them), an ARM CPU with
    the bf16 extension. Elsewhere (an AVX2 CPU) a bf16 matmul is emulated: 4-5x slower than fp32
    (docs/real_model.md), so roles compute in fp32 from bf16 weights instead."""
    import torch

    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type != "cpu":
        return False
    # oneDNN's own check follows ONEDNN_MAX_CPU_ISA and ATEN_CPU_CAPABILITY (an emulated AVX2 says no).
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return False
    if _cpu_isa() == "arm":
        return True
    return _kernel_isa() in ("avx512", "amx") and (torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def compute_dtype(setting: ComputeDtype, device: torch.device, weights: torch.dtype) -> torch.dtype:
    """The dtype a role computes in, given its setting and the dtype of the weights it is handed
    (a version's published dtype, a model's own). "auto": the weights' dtype where the device
    computes it natively (fp32 always; bf16 and fp16 on CUDA, bf16 per `bf16_native`), else
    float32 - the same weights, upcast exactly, so nothing published changes. "fp32" and "bf16"
    win over the rule."""
    import torch

    if setting != "auto":
        return getattr(torch, _DTYPE_NAMES[setting])
    if weights == torch.float32:
        return weights
    if device.type == "cuda":
        return weights if weights != torch.bfloat16 or bf16_native(device) else torch.float32
    return weights if weights == torch.bfloat16 and bf16_native(device) else torch.float32


def roles_line(config: RunConfig) -> str:
    """`decentrl run`'s start-up line: this machine's ISA and the dtype each role it starts computes
    in (as each role resolves it: `compute_dtype` against the run's publish dtype)."""
    import torch

    from decentrl.model.build import publish_dtype

    published = publish_dtype(config.store, config.model)
    short = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
    here = machine()
    trainer_device = torch.device("cuda" if config.placement.trainer.gpus else "cpu")
    parts = [f"trainer {short[compute_dtype(config.trainer.mixed_precision, trainer_device, published)]} "
             f"x {config.trainer_ranks} ranks, {config.trainer.torch_threads} threads each"]
    if config.worker.backend == "hf":
        worker_device = torch.device("cuda" if config.placement.workers.gpus else config.worker.device)
        parts.append(f"workers {short[compute_dtype(config.worker.compute_dtype, worker_device, published)]}, "
                     f"{config.worker.torch_threads} threads each")
    else:
        parts.append(f"workers: {config.worker.backend}'s own dtype")
    verification = config.orchestrator.verification
    if verification.enabled:
        parts.append(f"verifier {short[compute_dtype(verification.compute_dtype, torch.device('cpu'), published)]}")
    emulated = f" (emulated; the CPU has {here.cpu_isa})" if here.cpu_isa != here.isa else ""
    bf16 = "native" if here.bf16_native else "not native"
    return (f"machine: {here.isa}{emulated}, {os.cpu_count()} cores, bf16 {bf16}; versions in {short[published]}; "
            f"computing: {'; '.join(parts)}")
