"""Scorer backends (`[scorer] type`, docs/rewards_backends.md): a `ScoreBackend` answers one
`Verdict` per leased `ScoreItem`, in order. A backend reports what it got, not what the run allows:
the loop (workers/scorer.py) checks every verdict before anything is posted.
"""

from __future__ import annotations

from decentrl.api.wire import RunInfo
from decentrl.config import HFScorerConfig, OpenAIScorerConfig, PythonScorerConfig, TeacherScorerConfig
from workers.scorers.base import BackendConfigError, ScoreBackend, Verdict

__all__ = ["BackendConfigError", "ScoreBackend", "Verdict", "build_scorer_backend"]


def build_scorer_backend(
    config: HFScorerConfig | OpenAIScorerConfig | PythonScorerConfig | TeacherScorerConfig, run: RunInfo | None = None
) -> ScoreBackend:
    """The backend `[scorer] type` names; heavy imports (torch, transformers) happen here. `run`:
    the run's /v1/info, against which a teacher checks its tokenizer."""
    if isinstance(config, HFScorerConfig):
        from workers.scorers.hf import HFScoreBackend

        return HFScoreBackend(config)
    if isinstance(config, OpenAIScorerConfig):
        from workers.scorers.judge import JudgeBackend

        return JudgeBackend(config)
    if isinstance(config, TeacherScorerConfig):
        if run is None:
            raise BackendConfigError("a teacher scorer needs the run's /v1/info to check its tokenizer against")
        if config.server is not None:
            from workers.scorers.teacher_server import TeacherServerBackend

            return TeacherServerBackend(config, run)
        from workers.scorers.teacher import TeacherBackend

        return TeacherBackend(config, run)
    from workers.scorers.python import PythonScoreBackend

    return PythonScoreBackend(config)
