"""Countdown: reach `target` with the given numbers, each used at most once, and + - * /.

Prompt: "numbers 3 7 25 50 target 75:"; the completion is an expression such as "50+25",
checked exactly with fractions: reward 1 if it uses only the given numbers (each at most
once) and equals the target, else 0.
"""

from __future__ import annotations

import ast
import operator
from collections import Counter
from fractions import Fraction

from decentrl.config import CountdownTaskConfig
from decentrl.tasks.base import Prompt
from decentrl.tasks.jsonl import read_jsonl

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def value_and_numbers(expression: str) -> tuple[Fraction, list[int]] | None:
    """Exact value of the expression and the numbers it uses; None if it is not one."""
    used: list[int] = []

    def walk(node: ast.AST) -> Fraction:
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](walk(node.left), walk(node.right))
        if isinstance(node, ast.Constant) and type(node.value) is int:
            used.append(node.value)
            return Fraction(node.value)
        raise ValueError("unsupported syntax")

    try:
        return walk(ast.parse(expression.strip(), mode="eval").body), used
    except (SyntaxError, ValueError, ZeroDivisionError):
        return None


def score(numbers: list[int], target: int, completion_text: str) -> float:
    result = value_and_numbers(completion_text.split("=")[0])
    if result is None:
        return 0.0
    value, used = result
    return float(value == target and not Counter(used) - Counter(numbers))


class CountdownTask:
    def __init__(self, config: CountdownTaskConfig) -> None:
        self._rows = read_jsonl(config.path, ("numbers", "target"))
        self.num_prompts = len(self._rows)

    def prompt(self, prompt_id: int) -> Prompt:
        row = self._rows[prompt_id]
        return Prompt(prompt_id=prompt_id, text=f"numbers {' '.join(map(str, row['numbers']))} target {row['target']}:")

    def reward(self, prompt: Prompt, completion_text: str) -> float:
        row = self._rows[prompt.prompt_id]
        return score(row["numbers"], row["target"], completion_text)
