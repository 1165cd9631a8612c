"""Scorer backends: what turns a sample (prompt, completion, steps) into a score.

The scorer loop (workers/scorer.py) leases `ScoreItem`s (decentrl/api/wire.py) and hands them to a
`ScoreBackend`; each backend answers one `Verdict` per item, in order. Backends, chosen by
`[scorer] type` (decentrl/config/scorer.py; docs/rewards.md, "Scorer backends"):
- `hf` (hf.py): an AutoModelForSequenceClassification reward model; step scores are the scores
  of the completion's prefixes ending at each step;
- `openai` (judge.py): an LLM judge behind any OpenAI-compatible chat endpoint, with a prompt
  template and a verdict parser, retried when its reply does not parse;
- `python` (python.py): a function `module:function`, for tests and custom scorers;
- `teacher` (teacher.py): on-policy distillation's teacher, a causal LM giving the log-prob of
  every completion token the student sampled; it checks its tokenizer against the run's first. With
  `[scorer.server]` (teacher_server.py) the teacher is an OpenAI-compatible server answering prompt
  log-probs (vLLM's `prompt_logprobs`, or `echo` with `logprobs`).

A backend reports what it got, not what the run allows: the loop checks every verdict against
the lease's score range and the item's steps (NaN, out of range, a step list of the wrong length
-> a parse failure) before anything is posted.
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
    the run's /v1/info, which a teacher needs (its tokenizer is checked against the run's)."""
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
