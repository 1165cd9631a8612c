"""The `python` scorer backend: an importable function scores, for tests and custom scorers.

Built by workers/scorers/__init__.py from `[scorer] type = "python"`: `function =
"package.module:name"` is imported once and called as `name(items, **options)`, returning one
`Verdict` per item, in order. It runs in the scorer loop's thread, so it may block.
"""

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
