"""What every scorer backend shares: the `Verdict` it answers per item, the `ScoreBackend` protocol
and `BackendConfigError`. Its own module so that the backends (hf.py, judge.py, python.py) and the
package's `build_scorer_backend`, which imports them, do not import each other."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from decentrl.api.wire import ScoreItem


class BackendConfigError(ValueError):
    """A backend cannot start as configured (a label the model lacks, an unset API key variable);
    the message says which [scorer] key to change. `decentrl scorer` prints it and exits 2."""


@dataclass(frozen=True)
class Verdict:
    """One item's score from a backend. `score` None: no score could be read (`error` says why)."""

    score: float | None
    step_scores: list[float] | None = None  # one per step of the item, when it has steps and the backend scores them
    error: str | None = None
    retries: int = 0  # replies that did not parse and were asked again (reported to the orchestrator)
    transient: bool = False  # no score for now (the judge unreachable): not posted, leased again after expiry
    token_logprobs: list[float] | None = None  # a distillation teacher's: one per completion token of the item


class ScoreBackend(Protocol):
    def score(self, items: list[ScoreItem]) -> list[Verdict]:
        """One verdict per item, in order. May block (the loop calls it in a thread); raises only
        when the backend cannot score at all (the lease is then left to expire and be reassigned)."""
        ...
