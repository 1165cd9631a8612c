"""Answer extraction: which part of a decoded completion a task's reward compares with its
reference (`[task] answer = { format = ... }`), and the optional format credit.

Each format is a small pure function `text -> answer | None` (None: the format's marker is
absent, which scores 0). Extraction only picks the string; comparing it with the reference stays
the task's (a dataset's named reward, reasoning-gym's `score_answer`). Called by
decentrl/tasks/dataset.py and decentrl/tasks/reasoning_gym.py: extraction for correctness inside
the reward guard's child, the format credit in the task's `reward` (decentrl's own linear-time
code, nothing of the user's). `decentrl eval` scores correctness only (`FormatCredited`).
Sample completions and what each format takes from them: docs/tasks.md, "Answer formats".
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from decentrl.config import AnswerConfig

if TYPE_CHECKING:
    from decentrl.tasks.base import Prompt

# What is stripped around an answer and collapsed inside one: spaces, tabs and line breaks only.
# Python's own whitespace also counts control bytes (\x1c-\x1f) that a byte-level tokenizer can
# emit: a policy trained on configs/reasoning.toml learned to end answers with \x1d, which
# str.strip() removed, instead of ending its turn.
SPACE = " \t\r\n"

# lm-eval-harness GSM8K "flexible-extract": a run of at least 2 of $ digits . , (with an optional
# minus), or a bare integer (a lone digit).
NUMBER = re.compile(r"(-?[$0-9.,]{2,})|(-?[0-9]+)")
BOX_OPENERS = ("\\boxed{", "\\fbox{")


def raw(text: str) -> str:
    """The whole completion, stripped."""
    return text.strip(SPACE)


def last_tag(text: str, tag: str) -> str | None:
    """The text inside the last <tag>...</tag>, stripped."""
    found = re.findall(rf"<{tag}>(.*?)</{tag}>", text, flags=re.DOTALL)
    return found[-1].strip(SPACE) if found else None


def last_line(text: str) -> str | None:
    """The last line that is not blank, stripped."""
    lines = [line.strip(SPACE) for line in text.split("\n") if line.strip(SPACE)]
    return lines[-1] if lines else None


def last_number(text: str) -> str | None:
    """The last number, as lm-eval-harness's GSM8K "flexible-extract" reads it: the last match of
    `(-?[$0-9.,]{2,})|(-?[0-9]+)`, then `$` and `,` removed and one trailing `.` dropped (the
    `regexes_to_ignore` its exact match applies). So "1,234." -> "1234", "$-5"/"-$5" -> "-5",
    "-3.5" -> "-3.5", "5-3" -> "-3" (a hyphen right before a digit reads as a minus), "1.2.3"
    stays "1.2.3". One difference: a match without a digit ("..." of an ellipsis, ",,") is
    skipped, where lm-eval would take it and score 0."""
    for match in reversed(NUMBER.findall(text)):
        found = (match[0] or match[1]).replace("$", "").replace(",", "")
        if any(c.isdigit() for c in found):
            return found[:-1] if found.endswith(".") else found
    return None


def last_boxed(text: str) -> str | None:
    """The content of the last \\boxed{...} or \\fbox{...} (as math-verify and lighteval read
    both), braces balanced: "\\boxed{\\frac{1}{2}}" -> "\\frac{1}{2}" (a regex cannot nest them).
    None when the last one is not closed."""
    start, opener = max((text.rfind(opener), opener) for opener in BOX_OPENERS)
    if start < 0:
        return None
    depth, begin = 0, start + len(opener)
    for i in range(begin, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            if depth == 0:
                return text[begin:i].strip(SPACE)
            depth -= 1
    return None


EXTRACTORS: dict[str, Callable[[str], str | None]] = {
    "raw": raw, "last_number": last_number, "boxed": last_boxed, "last_line": last_line,
}  # and "tag", which also needs the tag's name


def extract_answer(text: str, config: AnswerConfig) -> str | None:
    """The answer part of a decoded completion; None when the format's marker is absent."""
    if config.format == "tag":
        return last_tag(text, config.tag)
    return EXTRACTORS[config.format](text)


def format_credit(text: str, config: AnswerConfig) -> float:
    """`format_reward` when the completion holds a non-empty answer in the configured format, else 0
    (added to correctness for training; never part of `decentrl eval`'s figure)."""
    if config.format_reward == 0:
        return 0.0
    return config.format_reward if extract_answer(text, config) else 0.0


@runtime_checkable
class FormatCredited(Protocol):
    """A task whose `reward` may add format credit to correctness (the dataset and reasoning-gym
    sources): `correctness` is the score without it, which `decentrl eval` reports."""

    def correctness(self, prompt: Prompt, completion_text: str) -> float: ...
