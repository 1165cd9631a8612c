"""Verifiable tasks: a deterministic prompt pool and a reward the orchestrator computes itself.

The orchestrator is the only caller of `Task.reward`: a worker's claimed reward is never used.
Multi-turn tasks (decentrl/tasks/episodes.py `EpisodeTask`) have an environment instead, which
workers run and the orchestrator replays to score.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from decentrl.config import (
    ArithmeticTaskConfig,
    CountdownTaskConfig,
    DatasetTaskConfig,
    GuessTaskConfig,
    ImportTaskConfig,
    ReasoningGymTaskConfig,
    TaskConfig,
    VerifiersTaskConfig,
)

if TYPE_CHECKING:
    from decentrl.tasks.episodes import EpisodeTask


@dataclass(frozen=True)
class Prompt:
    prompt_id: int
    text: str
    # Chat messages ((role, content), ...) of a task that has them (a dataset's messages column);
    # None: one user message of `text` when a chat template renders it (decentrl/tasks/prompts.py).
    messages: tuple[tuple[str, str], ...] | None = None


class Task(Protocol):
    num_prompts: int

    def prompt(self, prompt_id: int) -> Prompt: ...

    def reward(self, prompt: Prompt, completion_text: str) -> float:
        """Score in [0, 1] of a decoded completion (special tokens removed); a source with
        `answer.format_reward` adds up to that much format credit (decentrl/tasks/answers.py)."""
        ...


def build_task(config: TaskConfig) -> Task | EpisodeTask:
    if isinstance(config, ArithmeticTaskConfig):
        from decentrl.tasks.arithmetic import ArithmeticTask

        return ArithmeticTask(config)
    if isinstance(config, CountdownTaskConfig):
        from decentrl.tasks.countdown import CountdownTask

        return CountdownTask(config)
    if isinstance(config, GuessTaskConfig):
        from decentrl.tasks.guess import GuessTask

        return GuessTask(config)
    if isinstance(config, ImportTaskConfig):
        return import_task(config.target)(**config.options)
    if isinstance(config, (DatasetTaskConfig, ReasoningGymTaskConfig, VerifiersTaskConfig)):
        from decentrl.tasks.sources import build_source_task

        return build_source_task(config)
    from decentrl.tasks.sorting import SortingTask

    return SortingTask(config)


def import_task(target: str) -> type:
    """The class named by "package.module:Class", with an error that says what is missing."""
    module_name, _, class_name = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"task.target {target!r}: cannot import {module_name!r} ({exc})") from None
    try:
        return getattr(module, class_name)
    except AttributeError:
        raise ValueError(f"task.target {target!r}: module {module_name!r} has no {class_name!r}") from None
