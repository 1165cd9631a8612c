"""Toy verifiable task: sort a list of digits ascending.

Prompt text is the digits followed by "=", e.g. "3141="; the right completion is "1134" then
end-of-sequence. Partial credit - the fraction of positions holding the right digit - gives a
dense signal: a random policy over the 14-token vocabulary scores about 0.07, a perfect one 1.0.
With `reward = "permutation"` only a permutation of the problem's digits earns it; with `"kept"` it
is scaled by the share of the problem's digits the answer keeps (`sort_credit`).
"""

from __future__ import annotations

import functools
import itertools
import operator
import random
from collections import Counter

from decentrl.config import SortingTaskConfig
from decentrl.tasks.base import Prompt


class SortingTask:
    def __init__(self, config: SortingTaskConfig) -> None:
        self.num_digits = config.num_digits
        self.num_prompts = config.num_prompts
        self.rule = config.reward
        rng = random.Random(config.seed)
        if config.max_digits is None:
            digits = _random_digits(rng, self.num_digits * self.num_prompts)
            self._digits = [digits[i : i + self.num_digits] for i in range(0, len(digits), self.num_digits)]
            return
        # A pool spanning difficulties: each prompt's length uniform in [num_digits, max_digits].
        lengths = [rng.randint(config.num_digits, config.max_digits) for _ in range(self.num_prompts)]
        digits = _random_digits(rng, sum(lengths))
        starts = list(itertools.accumulate(lengths, initial=0))
        self._digits = [digits[a:b] for a, b in zip(starts, starts[1:])]

    def prompt(self, prompt_id: int) -> Prompt:
        return Prompt(prompt_id=prompt_id, text=self._digits[prompt_id] + "=")

    def reward(self, prompt: Prompt, completion_text: str) -> float:
        return sort_credit("".join(completion_text.split()), _sorted_digits(prompt.text), self.rule)


def sort_credit(answer: str, target: str, rule: str) -> float:
    """A sorting answer's reward against `target` (the problem's digits ascending): the share of
    positions right (`rule = "positions"`; extra characters cost as much as wrong ones, so padding
    never pays), or the same for a permutation of the problem's digits only, 0 for any other answer
    (`"permutation"`: an answer must keep every digit before its order earns anything, so the
    problem's commonest digit repeated to its length - a one-digit answer the share right in place
    pays about a third, sorting nothing - earns 0; copying the problem keeps what it has in place),
    or the share right in place times the share of the problem's digits the answer keeps (`"kept"`:
    never 0 for a near miss, as permutation is, so a model from scratch has something to climb; the
    commonest digit repeated earns about a tenth, below a copy of the problem)."""
    if rule == "permutation" and (len(answer) != len(target) or "".join(sorted(answer)) != target):
        return 0.0
    longer = max(len(target), len(answer))
    in_place = sum(map(operator.eq, answer, target)) / longer
    if rule == "kept":
        return in_place * (sum((Counter(answer) & Counter(target)).values()) / longer)
    return in_place


# Byte -> the digit of its top four bits, and the bytes whose top four bits are 10 or more.
_DIGIT_OF = bytes(ord("0123456789"[byte >> 4]) if byte >> 4 < 10 else 0 for byte in range(256))
_NOT_A_DIGIT = bytes(byte for byte in range(256) if byte >> 4 >= 10)


def _random_digits(rng: random.Random, count: int) -> str:
    """`"".join(rng.choice("0123456789") for _ in range(count))`, the prompts' definition, at C speed
    (a task of 100k prompts is built at every orchestrator start, recovery included).

    `rng.choice` of 10 draws `getrandbits(4)`, the top four bits of one 32-bit Mersenne Twister
    output, until it is below 10; `getrandbits(32 * n)` is n such outputs, the first in the
    lowest bits. So the digits are the top nibbles of every fourth byte, little-endian, those of
    10 or more skipped (tests/core/test_tasks.py compares the two).
    """
    text = bytearray()
    while len(text) < count:
        words = max(64, (count - len(text)) * 8 // 5)  # 10 of 16 nibbles are kept: about enough at once
        text += rng.getrandbits(32 * words).to_bytes(4 * words, "little")[3::4].translate(_DIGIT_OF, _NOT_A_DIGIT)
    return text[:count].decode()


@functools.lru_cache(maxsize=4096)
def _sorted_digits(prompt_text: str) -> str:
    # The orchestrator scores group_size completions per prompt: sort its digits once (sorting
    # a 500-digit prompt costs more than comparing a completion with it).
    return "".join(sorted(prompt_text.rstrip("=")))
