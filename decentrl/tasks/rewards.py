"""The named rewards of file-based tasks: math, exact, regex, contains, or an importable function,
each comparing an extracted answer (decentrl/tasks/answers.py) with the reference.

Called by decentrl/tasks/dataset.py and decentrl/tasks/reasoning_gym.py inside the reward guard's
child process (decentrl/tasks/guard.py), so a reward that hangs or raises never reaches the
orchestrator. math-verify is imported only by the `math` reward (the `tasks` extra).
"""

from __future__ import annotations

import re
from collections.abc import Callable

from decentrl.tasks.answers import SPACE

RewardFn = Callable[[str, str], float]  # (extracted answer, reference answer) -> score in [0, 1]


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
    from decentrl.tasks.base import import_task

    function = import_task(name)
    if not callable(function):
        raise ValueError(f"reward {name!r} is not a function")
    return function  # type: ignore[return-value]
