"""Scoring functions for the `python` scorer backend (workers/scorers/python.py) in tests that
start real `decentrl scorer` processes (tests/pipeline/test_pipeline_scorer_kill9.py, test_pipeline_scorers.py): the
process imports them as `tests.scorer_functions:NAME` with the repository root on its path."""

from __future__ import annotations

import time

from decentrl.api.wire import ScoreItem
from workers.scorers import Verdict


def by_length(items: list[ScoreItem], delay_s: float = 0.0) -> list[Verdict]:
    """Longer completions score higher (in [0, 1]), after `delay_s` a batch: a slow model."""
    time.sleep(delay_s)
    return [Verdict(score=min(1.0, len(item.completion) / 10)) for item in items]
