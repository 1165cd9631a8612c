"""`[placement]`: which GPUs of this machine `decentrl run` gives each role, and how much of each.

Read by `decentrl run` (decentrl/cli/launch.py), which starts a placed process with
CUDA_VISIBLE_DEVICES set to its GPUs and hands it `--set <role>.device=cuda` and
`--set <role>.gpu_memory=<memory>`; the roles themselves read only those keys, never this section.
`PlacementConfig.processes` is the one computation of who goes where: the launcher starts
processes from it, and RunConfig's checks (trainer_ranks, memory shares per GPU) sum over it.
Whether the named GPUs exist on the machine is checked at start-up (decentrl/model/devices.py), not here:
a config is written on one machine and run on another.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from pydantic import Field, model_validator

from decentrl.config.base import Section

GpuIndex = Annotated[int, Field(ge=0, le=1023)]


class RolePlacement(Section):
    """One role's GPUs and the share of each GPU's memory one of its processes may take."""

    gpus: list[GpuIndex] = Field(
        default_factory=list, max_length=1024,
        description="GPU indices (as torch.cuda numbers them on this machine); [] = on the CPU, as without "
        "[placement]. trainer: rank i on gpus[i]; workers and scorers: process i on gpus[i % len(gpus)].",
    )
    memory: float = Field(
        0.9, gt=0, le=1, description="Share of each of its GPUs' memory one process of this role may take "
        "(vLLM's gpu_memory_utilization; hf and the trainer: torch.cuda.set_per_process_memory_fraction). "
        "The shares of all processes placed on one GPU must add up to 1 at most.",
    )


class PlacementConfig(Section):
    """Where `decentrl run` puts its trainer ranks, workers and scorers: GPU indices and memory shares."""

    trainer: RolePlacement = Field(
        default_factory=RolePlacement, description="The trainer's ranks: one GPU each, len(gpus) = trainer_ranks."
    )
    workers: RolePlacement = Field(
        default_factory=RolePlacement, description="Workers: worker-i on gpus[i % len(gpus)]."
    )
    scorers: RolePlacement = Field(
        default_factory=RolePlacement, description="Scorers (hf reward models): scorer-i on gpus[i % len(gpus)]."
    )

    @model_validator(mode="after")
    def _trainer_gpus_distinct(self) -> PlacementConfig:
        gpus = self.trainer.gpus
        twice = sorted({gpu for gpu in gpus if gpus.count(gpu) > 1})
        if twice:
            raise ValueError(
                f"placement.trainer.gpus = {gpus} lists GPU {twice[0]} more than once: every trainer rank needs "
                "a GPU of its own (list distinct indices, or lower trainer_ranks)"
            )
        return self

    @property
    def used(self) -> bool:
        """Whether any role is placed on a GPU."""
        return bool(self.trainer.gpus or self.workers.gpus or self.scorers.gpus)

    def processes(self, *, trainer_ranks: int, num_workers: int, num_scorers: int) -> dict[str, Placed]:
        """Every process `decentrl run` starts ("trainer" - torchrun with all its ranks -, "worker-0",
        ..., "scorer-0", ...) and its place; a role without GPUs gets `Placed()` (CPU, as today).
        The trainer's gpus must number trainer_ranks (RunConfig checks it)."""
        places = {"trainer": _place(self.trainer, self.trainer.gpus)}
        for role, name, count in ((self.workers, "worker", num_workers), (self.scorers, "scorer", num_scorers)):
            for i in range(count):
                places[f"{name}-{i}"] = _place(role, [role.gpus[i % len(role.gpus)]] if role.gpus else [])
        return places


@dataclass(frozen=True)
class Placed:
    """One process's place: the GPUs it sees (its CUDA_VISIBLE_DEVICES, in this order) and the share
    of each one's memory it may take; no GPUs: left on the CPU, its environment untouched."""

    gpus: tuple[int, ...] = ()
    memory: float | None = None

    @property
    def visible_devices(self) -> str:
        """CUDA_VISIBLE_DEVICES: the trainer's "0,1,2,3" puts LOCAL_RANK i on gpus[i] (cuda:i)."""
        return ",".join(str(gpu) for gpu in self.gpus)


def _place(role: RolePlacement, gpus: list[int]) -> Placed:
    return Placed(tuple(gpus), role.memory) if gpus else Placed()


def memory_overcommit(places: dict[str, Placed]) -> str | None:
    """The first GPU whose processes' memory shares add up to more than 1, as a message naming the
    GPU, the processes and the keys to lower; None when every GPU fits."""
    shares: dict[int, list[tuple[str, float, str]]] = {}  # gpu -> (process, share, its memory key)
    for name, place in places.items():
        key = _MEMORY_KEY[name.split("-")[0]]  # worker-3 -> worker
        for rank, gpu in enumerate(place.gpus):
            label = f"trainer rank {rank}" if name == "trainer" else name
            shares.setdefault(gpu, []).append((label, place.memory or 0.0, key))
    for gpu in sorted(shares):
        total = sum(share for _, share, _ in shares[gpu])
        if total > 1.0 + 1e-9:  # 0.1 + 0.2 shares may sum to 0.30000000000000004
            parts = " + ".join(f"{label} ({share:g})" for label, share, _ in shares[gpu])
            keys = " or ".join(dict.fromkeys(key for _, _, key in shares[gpu]))
            return f"GPU {gpu}: {parts} = {total:g} > 1: lower {keys}, or place them on other GPUs"
    return None


_MEMORY_KEY = {"trainer": "placement.trainer.memory", "worker": "placement.workers.memory", "scorer": "placement.scorers.memory"}
