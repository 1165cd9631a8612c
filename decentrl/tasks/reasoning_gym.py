"""`[task] type = "reasoning_gym"`: prompts from reasoning-gym's procedural generators, scored by
each dataset's own `score_answer` on the answer extracted from the completion.

One dataset is created with `reasoning_gym.create_dataset(name, size=, seed=, **options)`; a
weighted mix through its `composite` dataset, which routes each entry back to its source's
scorer. Generators are seeded, so the orchestrator, the reward guard's child and `decentrl eval`
(which reseeds for held-out prompts) agree on every entry.

Built by decentrl/tasks/__init__.py `build_task`; `reward` runs in the reward guard's child process.
"""

from __future__ import annotations

import difflib
import functools
from typing import Any

from decentrl.config import ReasoningGymTaskConfig
from decentrl.tasks.answers import extract_answer, format_credit
from decentrl.tasks.base import Prompt
from decentrl.tasks.guard import RewardGuard


def create(config: ReasoningGymTaskConfig) -> Any:  # noqa: ANN401 - a reasoning_gym ProceduralDataset
    """The configured dataset; an unknown name or option fails naming it and what is close."""
    import reasoning_gym
    from reasoning_gym.factory import DATASETS

    for i, spec in enumerate(config.datasets):
        if spec.name not in DATASETS:
            close = difflib.get_close_matches(spec.name, DATASETS, n=3)
            hint = f" (did you mean {', '.join(close)}?)" if close else f" ({len(DATASETS)} known; see docs/tasks.md)"
            raise ValueError(f"task.datasets.{i}.name: unknown reasoning-gym dataset {spec.name!r}{hint}")
    try:
        if len(config.datasets) == 1:
            spec = config.datasets[0]
            return reasoning_gym.create_dataset(spec.name, size=config.size, seed=config.seed, **spec.options)
        from reasoning_gym.composite import DatasetSpec

        mix = [DatasetSpec(name=s.name, weight=s.weight, config=dict(s.options)) for s in config.datasets]
        return reasoning_gym.create_dataset("composite", size=config.size, seed=config.seed, datasets=mix)
    except (TypeError, AssertionError, ValueError) as exc:  # reasoning-gym validates options with asserts
        names = ", ".join(s.name for s in config.datasets)
        raise ValueError(f"task.datasets ({names}): options rejected by reasoning-gym: {exc or type(exc).__name__}") from None


def scorer(config: ReasoningGymTaskConfig):  # noqa: ANN201 - the guard's child calls it
    """score(completion, entry) for the guard's child: extract the answer, then score_answer."""
    dataset = create(config)

    def score(completion: str, entry: dict) -> float:
        answer = extract_answer(completion, config.answer)
        return 0.0 if answer is None else float(dataset.score_answer(answer, entry))

    return score


class ReasoningGymTask:
    def __init__(self, config: ReasoningGymTaskConfig) -> None:
        self.config = config
        dataset = create(config)
        self._entries = [dataset[i] for i in range(config.size)]
        self.num_prompts = config.size
        self._guard = RewardGuard(
            functools.partial(scorer, config), timeout_s=config.reward_timeout_s,
            name="reasoning_gym " + "+".join(s.name for s in config.datasets),
        )

    def prompt(self, prompt_id: int) -> Prompt:
        return Prompt(prompt_id=prompt_id, text=self._entries[prompt_id]["question"])

    def answer(self, prompt_id: int) -> str:
        return str(self._entries[prompt_id]["answer"])

    def reward(self, prompt: Prompt, completion_text: str) -> float:
        """Correctness, plus `answer.format_reward` for an answer found in the format (training only)."""
        return self.correctness(prompt, completion_text) + format_credit(completion_text, self.config.answer)

    def correctness(self, prompt: Prompt, completion_text: str) -> float:
        return self._guard(prompt.prompt_id, completion_text, self._entries[prompt.prompt_id])

    @property
    def reward_failures(self) -> dict[str, int]:
        return dict(self._guard.failures)
