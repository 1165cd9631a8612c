"""Verifiable tasks: a deterministic prompt pool and a reward the orchestrator computes itself.

The orchestrator is the only caller of `Task.reward`: a worker's claimed reward is never used.
Multi-turn tasks (decentrl/tasks/episodes.py `EpisodeTask`) have an environment instead, which
workers run and the orchestrator replays to score.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from decentrl.config import (
    ArithmeticTaskConfig,
    ChainTaskConfig,
    CountdownTaskConfig,
    DatasetTaskConfig,
    GuessTaskConfig,
    ImportTaskConfig,
    ProposeTaskConfig,
    ReasoningGymTaskConfig,
    TaskConfig,
    VerifiersTaskConfig,
)
from decentrl.tasks.base import Prompt, Task, import_task
from decentrl.tasks.sources import VERIFIERS_HINT, require

if TYPE_CHECKING:
    from decentrl.tasks.episodes import EpisodeTask

__all__ = ["Prompt", "Task", "build_task", "import_task"]


def build_task(config: TaskConfig) -> Task | EpisodeTask:
    if isinstance(config, ArithmeticTaskConfig):
        from decentrl.tasks.arithmetic import ArithmeticTask

        return ArithmeticTask(config)
    if isinstance(config, ChainTaskConfig):
        from decentrl.tasks.chain import ChainTask

        return ChainTask(config)
    if isinstance(config, CountdownTaskConfig):
        from decentrl.tasks.countdown import CountdownTask

        return CountdownTask(config)
    if isinstance(config, GuessTaskConfig):
        from decentrl.tasks.guess import GuessTask

        return GuessTask(config)
    if isinstance(config, ProposeTaskConfig):
        from decentrl.tasks.propose import ProposeTask

        return ProposeTask(config)
    if isinstance(config, ImportTaskConfig):
        return import_task(config.target)(**config.options)
    if isinstance(config, (DatasetTaskConfig, ReasoningGymTaskConfig, VerifiersTaskConfig)):
        return _build_source_task(config)
    from decentrl.tasks.sorting import SortingTask

    return SortingTask(config)


def _build_source_task(config: DatasetTaskConfig | ReasoningGymTaskConfig | VerifiersTaskConfig) -> Task | EpisodeTask:
    if isinstance(config, VerifiersTaskConfig):
        require("verifiers", needed_by="task.type 'verifiers'", hint=VERIFIERS_HINT)
        from decentrl.tasks.verifiers_env import VerifiersEpisodeTask, VerifiersTask, is_multi_turn

        return VerifiersEpisodeTask(config) if is_multi_turn(config) else VerifiersTask(config)
    if isinstance(config, DatasetTaskConfig):
        require("datasets", *(["math_verify"] if config.reward == "math" else []), needed_by="task.type 'dataset'")
        from decentrl.tasks.dataset import DatasetTask

        return DatasetTask(config)
    require("reasoning_gym", needed_by="task.type 'reasoning_gym'")
    from decentrl.tasks.reasoning_gym import ReasoningGymTask

    return ReasoningGymTask(config)
