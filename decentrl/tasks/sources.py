"""Task sources from the ecosystem (`[task] type = "dataset"` or `"reasoning_gym"`): building them,
with an error naming the missing extra when its libraries are absent.

Called by `decentrl.tasks.build_task`. Both sources hold a held-out part for `decentrl eval`
(`heldout_task`) and score through the reward guard (decentrl/tasks/guard.py).
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from decentrl.config import DatasetTaskConfig, ReasoningGymTaskConfig

if TYPE_CHECKING:
    from decentrl.tasks import Task

EXTRA_HINT = 'install the tasks extra: pip install -e ".[tasks]"'


@runtime_checkable
class HeldOutSource(Protocol):
    """A task whose held-out prompts are not its training prompts reseeded (a dataset's eval split)."""

    def heldout_task(self) -> Task: ...


@runtime_checkable
class AnswerSource(Protocol):
    """A task that knows each prompt's reference answer (a tokenizer may learn from it)."""

    def answer(self, prompt_id: int) -> str: ...


def require(*modules: str, needed_by: str) -> None:
    """A clear error when an optional library is missing, instead of an ImportError deep in a call."""
    missing = [name for name in modules if importlib.util.find_spec(name) is None]
    if missing:
        raise ValueError(f"{needed_by} needs {', '.join(missing)}: {EXTRA_HINT}")


def build_source_task(config: DatasetTaskConfig | ReasoningGymTaskConfig) -> Task:
    if isinstance(config, DatasetTaskConfig):
        require("datasets", *(["math_verify"] if config.reward == "math" else []), needed_by="task.type 'dataset'")
        from decentrl.tasks.dataset import DatasetTask

        return DatasetTask(config)
    require("reasoning_gym", needed_by="task.type 'reasoning_gym'")
    from decentrl.tasks.reasoning_gym import ReasoningGymTask

    return ReasoningGymTask(config)
