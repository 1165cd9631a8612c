"""Answer extraction and the named rewards of file-based tasks: math, exact, regex, contains, or
an importable function.

Called by decentrl/tasks/dataset.py and decentrl/tasks/reasoning_gym.py inside the reward guard's
child process (decentrl/tasks/guard.py), so a reward that hangs or raises never reaches the
orchestrator. math-verify is imported only by the `math` reward (the `tasks` extra).
"""

from __future__ import annotations

import re
from collections.abc import Callable

from decentrl.config import AnswerConfig

RewardFn = Callable[[str, str], float]  # (extracted answer, reference answer) -> score in [0, 1]

# What is stripped around an answer and collapsed inside one: spaces, tabs and line breaks only.
# Python's own whitespace also counts control bytes (\x1c-\x1f) that a byte-level tokenizer can
# emit: a policy trained on configs/reasoning.toml learned to end answers with \x1d, which
# str.strip() removed, instead of ending its turn.
SPACE = " \t\r\n"


def extract_answer(text: str, config: AnswerConfig) -> str | None:
    """The answer part of a decoded completion; None when the format's marker is absent."""
    if config.format == "raw":
        return text.strip(SPACE)
    if config.format == "tag":
        found = re.findall(rf"<{config.tag}>(.*?)</{config.tag}>", text, flags=re.DOTALL)
        return found[-1].strip(SPACE) if found else None
    if config.format == "boxed":
        return last_boxed(text)
    lines = [line.strip(SPACE) for line in text.split("\n") if line.strip(SPACE)]
    return lines[-1] if lines else None


def last_boxed(text: str) -> str | None:
    """The content of the last \\boxed{...}, braces balanced (a regex cannot nest them)."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, begin = 0, start + len("\\boxed{")
    for i in range(begin, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            if depth == 0:
                return text[begin:i].strip(SPACE)
            depth -= 1
    return None


def words(text: str) -> list[str]:
    return [word for word in re.split(f"[{SPACE}]+", text) if word]


def exact(answer: str, reference: str) -> float:
    return float(words(answer) == words(reference))


def contains(answer: str, reference: str) -> float:
    return float(reference.strip(SPACE) in answer)


def regex(answer: str, reference: str) -> float:
    return float(re.fullmatch(reference, answer.strip(SPACE), flags=re.DOTALL) is not None)


def math(answer: str, reference: str) -> float:
    """Mathematical equivalence with math-verify (LaTeX, \\boxed{}, plain numbers and expressions)."""
    from math_verify import parse, verify

    # math-verify reads LaTeX answers inside $...$ or \boxed{}; a bare "1/2" parses as an expression.
    gold = parse(reference if "$" in reference or "\\boxed" in reference else f"${reference}$")
    guess = parse(answer if "$" in answer or "\\boxed" in answer else f"${answer}$")
    # math-verify's own timeouts (SIGALRM) work here: the guard's child process calls this from
    # its main thread; the guard's timeout bounds the call as a whole.
    return float(verify(gold, guess))


NAMED: dict[str, RewardFn] = {"math": math, "exact": exact, "regex": regex, "contains": contains}


def reward_function(name: str) -> RewardFn:
    """A named reward, or the function named by 'package.module:function'."""
    if name in NAMED:
        return NAMED[name]
    from decentrl.tasks import import_task

    function = import_task(name)
    if not callable(function):
        raise ValueError(f"reward {name!r} is not a function")
    return function  # type: ignore[return-value]
