"""Verifiable tasks: a deterministic prompt pool and a reward the orchestrator computes itself.

The orchestrator is the only caller of `Task.reward`: a worker's claimed reward is never used.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from decentrl.config import SortingTaskConfig


@dataclass(frozen=True)
class Prompt:
    prompt_id: int
    text: str


class Task(Protocol):
    num_prompts: int

    def prompt(self, prompt_id: int) -> Prompt: ...

    def reward(self, prompt: Prompt, completion_text: str) -> float:
        """Score in [0, 1] of a decoded completion (special tokens removed)."""
        ...


def build_task(config: SortingTaskConfig) -> Task:
    from decentrl.tasks.sorting import SortingTask

    return SortingTask(config)
