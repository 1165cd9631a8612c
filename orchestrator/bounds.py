"""Size bounds of a rollout post derived from the run's config, checked before anything is kept.

Called once per POST /v1/rollouts by the rollouts handler (orchestrator/handlers.py), after the
body has validated against the wire models (decentrl/api/wire.py, whose bounds hold whatever the
config) and before RunState sees it: an oversized rollout is answered 400 and never ingested,
held or journaled. The bounds follow from the run: a top-k sampling mask keeps at most top_k ids
a token, any mask at most the vocabulary. (A completion longer than sampling.max_tokens, a prompt
not its lease's, ids outside the vocabulary: those are per-rollout rejections, RunState's checks;
each mask has one entry per completion token, decentrl/api/wire.py.)
"""

from __future__ import annotations

from collections.abc import Sequence

from decentrl.api.wire import Rollout, SamplingParams


def oversized(rollouts: Sequence[Rollout], sampling: SamplingParams, vocab_size: int) -> str | None:
    """What is too large in the first rollout that is (a message naming the field and the run's
    limit), or None when every rollout fits the run."""
    per_token = min(sampling.top_k, vocab_size) if sampling.top_k > 0 else vocab_size
    for index, rollout in enumerate(rollouts):
        if rollout.sampling_mask is not None:
            widest = max((len(entry) for entry in rollout.sampling_mask), default=0)
            if widest > per_token:
                return (
                    f"rollouts.{index}.sampling_mask keeps {widest} ids for one token; this run allows at most {per_token} "
                    f"(sampling.top_k={sampling.top_k}, vocabulary {vocab_size})"
                )
    return None
