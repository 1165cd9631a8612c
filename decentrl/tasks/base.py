"""What every task shares: a `Prompt`, the `Task` protocol and `import_task` (a user's task class
by its import path). Its own module so that the tasks and `build_task` (decentrl/tasks/__init__.py),
which imports them, do not import each other."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Protocol


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
