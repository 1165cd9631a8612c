"""Arithmetic: "12+7*3=" -> the exact integer value; reward 1 for the right number, else 0."""

from __future__ import annotations

import ast
import operator
import re

from decentrl.config import ArithmeticTaskConfig
from decentrl.tasks.base import Prompt
from decentrl.tasks.jsonl import read_jsonl

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def evaluate(expression: str) -> int:
    """Exact value of an expression of integers, + - * and parentheses (no eval())."""

    def walk(node: ast.AST) -> int:
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](walk(node.left), walk(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -walk(node.operand)
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        raise ValueError(f"not an integer expression of + - *: {expression!r}")

    return walk(ast.parse(expression, mode="eval").body)


def first_integer(text: str) -> int | None:
    match = re.search(r"-?\d+", text)
    return int(match.group()) if match else None


class ArithmeticTask:
    def __init__(self, config: ArithmeticTaskConfig) -> None:
        self._rows = read_jsonl(config.path, ("question",))
        self.num_prompts = len(self._rows)

    def prompt(self, prompt_id: int) -> Prompt:
        return Prompt(prompt_id=prompt_id, text=self._rows[prompt_id]["question"] + "=")

    def reward(self, prompt: Prompt, completion_text: str) -> float:
        return float(first_integer(completion_text) == evaluate(prompt.text.removesuffix("=")))
