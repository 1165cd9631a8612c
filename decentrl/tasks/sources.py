"""Task sources from the ecosystem (`[task] type = "dataset"`, `"reasoning_gym"` or `"verifiers"`):
building them, with an error naming the missing extra when its libraries are absent.

`decentrl.tasks.build_task` builds them; this module holds what they share. Every source scores through the reward guard
(decentrl/tasks/guard.py); the dataset and verifiers sources hold a part out for `decentrl eval`
(`heldout_task`, the seeded choice `held_out`), reasoning-gym's generators are reseeded instead.
"""

from __future__ import annotations

import importlib.util
import random
from typing import TYPE_CHECKING, Literal, Protocol, runtime_checkable

if TYPE_CHECKING:
    from decentrl.tasks.base import Task

EXTRA_HINT = 'install the tasks extra: pip install -e ".[tasks]"'
VERIFIERS_HINT = 'install the verifiers extra: pip install -e ".[verifiers]"'
Part = Literal["train", "eval"]  # which part of a source a task holds: training prompts or held-out ones


@runtime_checkable
class HeldOutSource(Protocol):
    """A task whose held-out prompts are not its training prompts reseeded (a dataset's eval split)."""

    def heldout_task(self) -> Task: ...


@runtime_checkable
class AnswerSource(Protocol):
    """A task that knows each prompt's reference answer (a tokenizer may learn from it)."""

    def answer(self, prompt_id: int) -> str: ...


def held_out(count: int, fraction: float, seed: int) -> set[int]:
    """Which of `count` items (positions) are held out for eval: a seeded `fraction`, at least one
    when the fraction is above 0."""
    if fraction == 0:
        return set()
    order = list(range(count))
    random.Random(seed).shuffle(order)
    return set(order[: max(1, round(count * fraction))])


def require(*modules: str, needed_by: str, hint: str = EXTRA_HINT) -> None:
    """A clear error when an optional library is missing, instead of an ImportError deep in a call."""
    missing = [name for name in modules if importlib.util.find_spec(name) is None]
    if missing:
        raise ValueError(f"{needed_by} needs {', '.join(missing)}: {hint}")
