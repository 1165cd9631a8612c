"""Toy verifiable task: sort a list of digits ascending.

Prompt text is the digits followed by "=", e.g. "3141="; the right completion is "1134" then
end-of-sequence. Partial credit - the fraction of positions holding the right digit - gives a
dense signal: a random policy over the 14-token vocabulary scores about 0.07, a perfect one 1.0.
"""

from __future__ import annotations

import functools
import operator
import random

from decentrl.config import SortingTaskConfig
from decentrl.tasks import Prompt


class SortingTask:
    def __init__(self, config: SortingTaskConfig) -> None:
        self.num_digits = config.num_digits
        self.num_prompts = config.num_prompts
        rng = random.Random(config.seed)
        self._digits = [
            "".join(rng.choice("0123456789") for _ in range(self.num_digits))
            for _ in range(self.num_prompts)
        ]

    def prompt(self, prompt_id: int) -> Prompt:
        return Prompt(prompt_id=prompt_id, text=self._digits[prompt_id] + "=")

    def reward(self, prompt: Prompt, completion_text: str) -> float:
        target = _sorted_digits(prompt.text)
        answer = "".join(completion_text.split())
        right = sum(map(operator.eq, answer, target))
        # Extra characters cost as much as wrong ones, so padding the answer never pays.
        return right / max(len(target), len(answer))


@functools.lru_cache(maxsize=4096)
def _sorted_digits(prompt_text: str) -> str:
    # The orchestrator scores group_size completions per prompt: sort its digits once (sorting
    # a 500-digit prompt costs more than comparing a completion with it).
    return "".join(sorted(prompt_text.rstrip("=")))
