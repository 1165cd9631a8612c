"""Experiment trackers: each step's metrics and, every few steps, a table of sample completions,
sent to trackio, Weights & Biases (offline: no network) or TensorBoard, as `[logging]` lists.

Rank 0 of the trainer (decentrl/trainer/train.py) opens `Trackers` once, with the run's resolved
config attached, and calls `step` after writing each metrics.jsonl record. Each tracker's package
is imported only when the config lists it. A tracker that fails while training is counted
(`failures`) and logged once; training goes on, since metrics.jsonl and the orchestrator's
dashboard still hold every number. A listed tracker that is not installed stops the trainer
before its first step, with the pip command that fixes it.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections import Counter
from collections.abc import Callable
from typing import Any, Protocol

from decentrl.api.wire import TrainBatch
from decentrl.config import LoggingConfig

log = logging.getLogger("decentrl.trainer.trackers")

SAMPLE_COLUMNS = ["step", "policy_version", "reward", "advantage", "prompt", "completion"]


class Tracker(Protocol):
    def log(self, step: int, metrics: dict[str, float]) -> None: ...
    def table(self, step: int, rows: list[list[Any]]) -> None: ...
    def close(self) -> None: ...


class TrackioTracker:
    def __init__(self, project: str, name: str, config: dict[str, Any], directory: str) -> None:
        # trackio reads its storage folder from the environment when first imported.
        os.environ.setdefault("TRACKIO_DIR", directory)
        import trackio

        self.trackio = trackio
        trackio.init(project=project, name=name, config=config, embed=False, auto_log_cpu=False, auto_log_gpu=False)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.trackio.log(metrics, step=step)

    def table(self, step: int, rows: list[list[Any]]) -> None:
        self.trackio.log({"samples": self.trackio.Table(columns=SAMPLE_COLUMNS, data=rows)}, step=step)

    def close(self) -> None:
        self.trackio.finish()


class WandbTracker:
    def __init__(self, project: str, name: str, config: dict[str, Any], directory: str) -> None:
        import wandb

        self.wandb = wandb
        # Offline: runs are written under `directory` and synced later with `wandb sync`, if ever.
        self.run = wandb.init(project=project, name=name, config=config, dir=directory, mode="offline")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=step)

    def table(self, step: int, rows: list[list[Any]]) -> None:
        self.run.log({"samples": self.wandb.Table(columns=SAMPLE_COLUMNS, data=rows)}, step=step)

    def close(self) -> None:
        self.run.finish()
        self.wandb.teardown()  # waits for wandb's writer process: finish() returns before the records are on disk


class TensorBoardTracker:
    def __init__(self, project: str, name: str, config: dict[str, Any], directory: str) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=os.path.join(directory, project, name))
        self.writer.add_text("config", "```json\n" + json.dumps(config, indent=2) + "\n```", 0)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for name, value in metrics.items():
            self.writer.add_scalar(name, value, step)
        self.writer.flush()

    def table(self, step: int, rows: list[list[Any]]) -> None:
        cell = lambda value: str(value).replace("|", "\\|").replace("\n", " ")  # noqa: E731
        lines = ["| " + " | ".join(SAMPLE_COLUMNS) + " |", "|" + "---|" * len(SAMPLE_COLUMNS)]
        lines += ["| " + " | ".join(cell(value) for value in row) + " |" for row in rows]
        self.writer.add_text("samples", "\n".join(lines), step)

    def close(self) -> None:
        self.writer.close()


OPENERS: dict[str, tuple[Callable[..., Tracker], str]] = {
    "trackio": (TrackioTracker, "trackio"),
    "wandb": (WandbTracker, "wandb"),
    "tensorboard": (TensorBoardTracker, "tensorboard"),
}


class Trackers:
    def __init__(
        self, config: LoggingConfig, *, run_name: str, run_config: dict[str, Any], directory: str,
        decode: Callable[[list[int]], str],
    ) -> None:
        self.config = config
        self.decode = decode
        self.failures: Counter[str] = Counter()
        self.open: dict[str, Tracker] = {}
        for name in config.trackers:
            opener, extra = OPENERS[name]
            where = os.path.join(directory, name)
            os.makedirs(where, exist_ok=True)
            try:
                self.open[name] = opener(config.project, run_name, run_config, where)
            except ImportError as exc:
                raise RuntimeError(
                    f"logging.trackers lists {name!r} but it is not installed ({exc}); "
                    f'pip install "decentrl[{extra}]", or remove it from [logging]'
                ) from None

    def step(self, step: int, record: dict[str, Any], batch: TrainBatch) -> None:
        """Send one metrics.jsonl record (its finite numbers), and every `samples_every` steps a table."""
        metrics = {k: float(v) for k, v in record.items() if type(v) in (int, float) and math.isfinite(v) and k != "step"}
        rows = None
        if self.config.samples_every and step % self.config.samples_every == 0:
            rows = [
                [step, s.policy_version, s.reward, s.advantage, self.decode(s.prompt_token_ids), self.decode(s.completion_token_ids)]
                for s in batch.samples[: self.config.samples_per_table]
            ]
        for name, tracker in self.open.items():
            self._guarded(name, tracker.log, step, metrics)
            if rows is not None:
                self._guarded(name, tracker.table, step, rows)

    def close(self) -> None:
        for name, tracker in self.open.items():
            self._guarded(name, tracker.close)

    def _guarded(self, name: str, call: Callable[..., None], *args: Any) -> None:
        try:
            call(*args)
        except Exception:  # a tracker never stops training: counted, logged the first time
            self.failures[name] += 1
            if self.failures[name] == 1:
                log.exception("tracker %s failed; training goes on (further failures are counted, not logged)", name)
