"""The `python` scorer backend: `function = "package.module:name"`, imported once and called as
`name(items, **options)`, returns one `Verdict` per item, in order; it may block."""

from __future__ import annotations

import importlib
from collections.abc import Callable

from decentrl.api.wire import ScoreItem
from decentrl.config import PythonScorerConfig
from workers.scorers.base import Verdict


class PythonScoreBackend:
    def __init__(self, config: PythonScorerConfig) -> None:
        module, _, name = config.function.partition(":")
        self.function: Callable[..., list[Verdict]] = getattr(importlib.import_module(module), name)
        self.options = config.options

    def score(self, items: list[ScoreItem]) -> list[Verdict]:
        verdicts = self.function(items, **self.options)
        if len(verdicts) != len(items):
            raise ValueError(f"{self.function.__qualname__} returned {len(verdicts)} verdicts for {len(items)} items")
        return verdicts
