"""Crash-resume of the trainer: DCP checkpoints, a journal of batches, and the resume plan.

Under `<run_dir>/trainer/`:
- `checkpoints/step_000050/`: torch.distributed.checkpoint of the model, optimizer, scheduler,
  progress (step = data position, time totals) and each rank's RNG, written every
  `trainer.checkpoint_every` steps. Written into a `.tmp` directory and renamed once every rank
  is done and the publisher has stored every version up to that step, so a committed checkpoint
  is complete and never ahead of the store.
- `batches/step_000051.json`: each batch as rank 0 received it, written before training on it.
  The orchestrator serves a batch once; the journal lets a restarted trainer replay the steps
  since its checkpoint on exactly the same data and arrive at exactly the published weights.

Resume (`plan_resume`): load checkpoint K, replay the journaled steps K+1..J without
republishing the versions the store already holds, then fetch new batches from step J+1 on.
Policy versions thus continue with neither a gap nor a version number reused for other weights.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from decentrl.api.wire import TrainBatch

_STEP_NAME = re.compile(r"step_(\d{6,})")


def _step_name(step: int) -> str:
    return f"step_{step:06d}"


def _steps_in(directory: str, suffix: str = "") -> list[int]:
    if not os.path.isdir(directory):
        return []
    found = []
    for name in os.listdir(directory):
        if name.endswith(suffix) and (match := _STEP_NAME.fullmatch(name.removesuffix(suffix))):
            found.append(int(match.group(1)))
    return sorted(found)


@dataclass
class Progress:
    """What the loop carries from step to step besides weights and optimizer."""

    step: int = 0  # optimizer steps done; the weights are policy version `step`
    busy_s: float = 0.0  # run totals behind trainer_busy_fraction_total
    wall_s: float = 0.0


@dataclass(frozen=True)
class ResumePlan:
    checkpoint: int  # step of the checkpoint to load; 0 = start from version 0
    replay_through: int  # steps checkpoint+1..replay_through train on journaled batches
    published: int  # newest version in the store: steps up to it are not published again


def plan_resume(checkpoint: int | None, journaled: list[int], published: list[int]) -> ResumePlan:
    """Where to restart from, given the newest checkpoint, the journaled steps and the store's versions."""
    start = checkpoint or 0
    through = start
    while through + 1 in journaled:
        through += 1
    newest = max(published, default=0)
    if newest > through:
        raise RuntimeError(
            f"the store already holds version {newest}, but this run dir's trainer state only reaches "
            f"step {through} (checkpoint {start}, journal up to {through}): the store belongs to another "
            "run. Use a new store.url (or run_name and run dir), or restore this run's trainer/ directory"
        )
    return ResumePlan(checkpoint=start, replay_through=through, published=newest)


class BatchJournal:
    """Rank 0's record of the batches it trained on since the last checkpoint."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        os.makedirs(directory, exist_ok=True)

    def _path(self, step: int) -> str:
        return os.path.join(self.directory, _step_name(step) + ".json")

    def steps(self) -> list[int]:
        return _steps_in(self.directory, ".json")

    def write(self, step: int, batch: TrainBatch) -> None:
        # Write aside, fsync, rename: a crash leaves either the whole batch or none of it.
        temporary = self._path(step) + ".tmp"
        with open(temporary, "w", encoding="utf-8") as file:
            file.write(batch.model_dump_json())
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, self._path(step))

    def read(self, step: int) -> TrainBatch:
        with open(self._path(step), encoding="utf-8") as file:
            return TrainBatch.model_validate_json(file.read())

    def prune(self, through_step: int) -> None:
        """Forget the batches a committed checkpoint already covers."""
        for step in self.steps():
            if step <= through_step:
                os.remove(self._path(step))


class TrainerCheckpoints:
    """DCP checkpoints of the training state; `save` and `load` are collective (every rank calls)."""

    def __init__(self, directory: str, keep: int) -> None:
        self.directory = directory
        self.keep = keep

    def latest(self) -> int | None:
        steps = _steps_in(self.directory)
        return steps[-1] if steps else None

    def _state(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LRScheduler, progress: Progress
    ) -> dict[str, object]:
        model_state, optimizer_state = get_state_dict(model, optimizer)
        return {
            "model": model_state,
            "optimizer": optimizer_state,
            "scheduler": scheduler.state_dict(),
            "progress": asdict(progress),
            # Each rank's own generator: keyed by rank so DCP keeps them all.
            f"rng/rank{dist.get_rank()}": torch.get_rng_state(),
        }

    def save(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        progress: Progress,
        before_commit: Callable[[], None] | None = None,
    ) -> None:
        """Write the checkpoint of `progress.step`; `before_commit()` (rank 0) runs between the
        write and the rename that makes the checkpoint visible to a restart."""
        final = os.path.join(self.directory, _step_name(progress.step))
        temporary = final + ".tmp"
        if dist.get_rank() == 0:
            shutil.rmtree(temporary, ignore_errors=True)  # a leftover of a crash mid-save
        dist.barrier()
        dcp.save(self._state(model, optimizer, scheduler, progress), checkpoint_id=temporary)
        dist.barrier()
        if dist.get_rank() == 0:
            if before_commit is not None:
                before_commit()
            shutil.rmtree(final, ignore_errors=True)
            os.rename(temporary, final)
            for old in _steps_in(self.directory)[: -self.keep]:
                shutil.rmtree(os.path.join(self.directory, _step_name(old)))
        dist.barrier()

    def load(
        self,
        step: int,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
    ) -> Progress:
        path = os.path.join(self.directory, _step_name(step))
        state = self._state(model, optimizer, scheduler, Progress())
        rng_key = f"rng/rank{dist.get_rank()}"
        if rng_key not in dcp.FileSystemReader(path).read_metadata().state_dict_metadata:
            # Saved by fewer ranks: model and optimizer reshard, this rank keeps its seeded RNG.
            del state[rng_key]
        dcp.load(state, checkpoint_id=path)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])  # type: ignore[arg-type]
        scheduler.load_state_dict(state["scheduler"])  # type: ignore[arg-type]
        if rng_key in state:
            torch.set_rng_state(state[rng_key])  # type: ignore[arg-type]
        return Progress(**state["progress"])  # type: ignore[arg-type]
