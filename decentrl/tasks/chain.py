"""Chained sums: a task whose every step is checkable exactly (issue 47's pivots benchmark).

The prompt is digits and "=", e.g. "7324="; the right completion writes the running sum after
each digit, each step ending with "=": "7=10=12=16=" then end-of-sequence (one step a marker,
the tree unit's `boundary`). `check_step` judges the last finished step of a completion so far
(the exact process reward the workers/scorers/chain.py scorer posts for POST /v1/steps); the
reward is 1 when every step is right and there are as many as digits, else 0.
"""

from __future__ import annotations

import random

from decentrl.config import ChainTaskConfig
from decentrl.tasks.base import Prompt

MARKER = "="


def running_sums(prompt_text: str) -> list[int]:
    digits = [int(c) for c in prompt_text.removesuffix(MARKER)]
    sums, total = [], 0
    for digit in digits:
        total += digit
        sums.append(total)
    return sums


def check_step(prompt_text: str, completion_so_far: str) -> bool | None:
    """Whether the last finished step of `completion_so_far` (the text before its last marker,
    after the one before) is right: the running sum it should be. None: no step is finished."""
    *finished, _ = completion_so_far.split(MARKER)
    if not finished:
        return None
    sums = running_sums(prompt_text)
    index, text = len(finished) - 1, finished[-1].strip()
    return index < len(sums) and text.isdigit() and int(text) == sums[index]


def check_last_step(prompt_text: str, completion: str) -> bool:
    """Whether a chain's last step, one that ended without the marker (at end-of-sequence or at
    the token limit), is right: its text after the last marker is the last running sum, or, empty
    (the end-of-sequence alone), the chain before it holds every sum, the last one right.
    (`check_step` would judge the step before it.)"""
    *finished, rest = completion.split(MARKER)
    sums = running_sums(prompt_text)
    if rest.strip():
        return len(finished) == len(sums) - 1 and rest.strip().isdigit() and int(rest.strip()) == sums[-1]
    return len(finished) == len(sums) and finished[-1].strip() == str(sums[-1])


def judge_step(prompt_text: str, completion_so_far: str, step_text: str) -> bool:
    """Whether the step `step_text`, the last of `completion_so_far`, is right: one ended by the
    marker by `check_step`, the chain's unmarked last step by `check_last_step`."""
    if step_text.strip().endswith(MARKER):
        return bool(check_step(prompt_text, completion_so_far))
    return check_last_step(prompt_text, completion_so_far)


class ChainTask:
    def __init__(self, config: ChainTaskConfig) -> None:
        self.num_prompts = config.num_prompts
        rng = random.Random(config.seed)
        self._texts = ["".join(rng.choice("0123456789") for _ in range(config.num_digits)) + MARKER for _ in range(config.num_prompts)]

    def prompt(self, prompt_id: int) -> Prompt:
        return Prompt(prompt_id=prompt_id, text=self._texts[prompt_id])

    def reward(self, prompt: Prompt, completion_text: str) -> float:
        return chain_reward(prompt.text, completion_text)


def chain_reward(prompt_text: str, completion_text: str) -> float:
    """1 when the completion is exactly the running sums, each ended by the marker, else 0."""
    steps = "".join(completion_text.split()).split(MARKER)
    if steps[-1] == "":
        steps = steps[:-1]  # the text after the last marker: none in a finished answer
    return float(steps == [str(total) for total in running_sums(prompt_text)])
