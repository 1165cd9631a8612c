"""`[task]`: the prompts and the verifiable reward (decentrl/tasks/ builds a task from it).

The orchestrator leases the task's prompts and scores every rollout with it; workers build a
multi-turn task's environment from the copy the orchestrator announces (`RunInfo.episode_task`);
`decentrl eval` rebuilds it to hold prompts out.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from decentrl.config.base import Section, keyed_union


class SortingTaskConfig(Section):
    """Sort a list of digits ascending; reward is the fraction of positions right (see tasks/)."""

    type: Literal["sorting"] = "sorting"
    num_digits: int = Field(4, ge=2, le=16, description="Digits per prompt.")
    num_prompts: int = Field(4096, ge=1, description="Size of the prompt pool (seeded).")
    seed: int = Field(0, ge=0, description="Seed of the prompt pool.")


class ArithmeticTaskConfig(Section):
    """Evaluate an integer expression ("12+7*3="); reward 1 for the exact value (see tasks/arithmetic.py)."""

    type: Literal["arithmetic"] = "arithmetic"
    path: str = Field(
        "arithmetic.jsonl", description="JSONL of {\"question\": ...}; a bare name is looked up in decentrl/tasks/data/."
    )
    seed: int = Field(0, ge=0, description="Seed of the prompt order.")


class CountdownTaskConfig(Section):
    """Reach a target with given numbers and + - * /; reward 1 for an exact solution (see tasks/countdown.py)."""

    type: Literal["countdown"] = "countdown"
    path: str = Field(
        "countdown.jsonl", description="JSONL of {\"numbers\": [...], \"target\": n}; bare names: decentrl/tasks/data/."
    )
    seed: int = Field(0, ge=0, description="Seed of the prompt order.")


class ImportTaskConfig(Section):
    """A user task: a class implementing decentrl.tasks.Task, constructed as Class(**options)."""

    type: Literal["import"] = "import"
    target: str = Field(pattern=r"^[\w.]+:\w+$", description="Import path 'package.module:Class'.")
    options: dict[str, object] = Field(default_factory=dict, description="Keyword arguments of the constructor.")
    seed: int = Field(0, ge=0, description="Seed of the prompt order.")


class GuessTaskConfig(Section):
    """Multi-turn: guess a secret number; after each guess the environment says higher or lower
    (see tasks/guess.py). Reward 1 - (guesses - 1) / max_turns once found, else 0."""

    type: Literal["guess"] = "guess"
    max_number: int = Field(99, ge=1, le=10**6, description="Secrets are drawn from 0..max_number.")
    max_turns: int = Field(8, ge=1, le=64, description="Guesses per episode at most.")
    num_prompts: int = Field(4096, ge=1, description="Size of the prompt pool (one secret each, seeded).")
    seed: int = Field(0, ge=0, description="Seed of the secrets and of the prompt order.")


TaskConfig = keyed_union(
    SortingTaskConfig, ArithmeticTaskConfig, CountdownTaskConfig, GuessTaskConfig, ImportTaskConfig
)
