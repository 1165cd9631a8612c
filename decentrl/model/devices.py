"""Does this machine have the GPUs a setting names, and how much of one a process may take.

One check for every role and for `decentrl run`: `device_problem` (a role's `device` setting) and
`placement_problem` (a run's [placement], before any role starts) both come down to
`gpus_problem`, which takes the machine's GPU count as a parameter so that it is tested on CPU.
They return a one-line message naming the setting and what to change (None: fine); the caller
turns it into its own error (the launcher's "error:", a scorer's BackendConfigError, a worker's
exit). torch is imported inside the functions that need it, so the launcher stays light.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

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
