"""`[logging]`: the experiment trackers the trainer sends its per-step metrics to.

decentrl/trainer/trackers.py reads it on the trainer's rank 0; the orchestrator's dashboard
(orchestrator/dashboard.py) needs no setting here.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from decentrl.config.base import Section


class LoggingConfig(Section):
    """Experiment trackers the trainer's rank 0 sends each step's metrics and a sample table to
    (decentrl/trainer/trackers.py). Each is an optional extra, imported only when listed here:
    pip install "decentrl[trackio]", "decentrl[wandb]" or "decentrl[tensorboard]". Their files go
    under <run_dir>/trackers/. A tracker that fails while training is counted and logged once,
    and training goes on; one that is listed but not installed stops the trainer at start."""

    trackers: list[Literal["trackio", "wandb", "tensorboard"]] = Field(
        default_factory=list, max_length=3, description="Which trackers to send to (none by default)."
    )
    project: str = Field("decentrl", pattern=r"^[A-Za-z0-9._-]{1,64}$", description="The trackers' project name.")
    samples_every: int = Field(
        10, ge=0, description="Steps between sample tables (decoded completions with rewards); 0: no tables."
    )
    samples_per_table: int = Field(8, ge=1, le=256, description="Completions in each sample table.")

    @model_validator(mode="after")
    def _distinct(self) -> LoggingConfig:
        if len(set(self.trackers)) != len(self.trackers):
            raise ValueError(f"logging.trackers names a tracker twice: {self.trackers}")
        return self
