"""Scorer backends: what turns a sample (prompt, completion, steps) into a score.

The scorer loop (workers/scorer.py) leases `ScoreItem`s (decentrl/api/wire.py) and hands them to a
`ScoreBackend`; each backend answers one `Verdict` per item, in order. Backends, chosen by
`[scorer] type` (decentrl/config/scorer.py; docs/rewards.md, "Scorer backends"):
- `hf` (hf.py): an AutoModelForSequenceClassification reward model; step scores are the scores
  of the completion's prefixes ending at each step;
- `openai` (judge.py): an LLM judge behind any OpenAI-compatible chat endpoint, with a prompt
  template and a verdict parser, retried when its reply does not parse;
- `python` (python.py): a function `module:function`, for tests and custom scorers.

A backend reports what it got, not what the run allows: the loop checks every verdict against
the lease's score range and the item's steps (NaN, out of range, a step list of the wrong length
-> a parse failure) before anything is posted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from decentrl.api.wire import ScoreItem
from decentrl.config import HFScorerConfig, OpenAIScorerConfig, PythonScorerConfig


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


class ScoreBackend(Protocol):
    def score(self, items: list[ScoreItem]) -> list[Verdict]:
        """One verdict per item, in order. May block (the loop calls it in a thread); raises only
        when the backend cannot score at all (the lease is then left to expire and be reassigned)."""
        ...


def build_scorer_backend(config: HFScorerConfig | OpenAIScorerConfig | PythonScorerConfig) -> ScoreBackend:
    """The backend `[scorer] type` names; heavy imports (torch, transformers) happen here."""
    if isinstance(config, HFScorerConfig):
        from workers.scorers.hf import HFScoreBackend

        return HFScoreBackend(config)
    if isinstance(config, OpenAIScorerConfig):
        from workers.scorers.judge import JudgeBackend

        return JudgeBackend(config)
    from workers.scorers.python import PythonScoreBackend

    return PythonScoreBackend(config)
