"""The ingest check of a rollout's MoE routes (Keep Routing; docs/routing.md).

Called once per rollout from the orchestrator's ingest checks (`RunState._check`). The rules
are decentrl/model/routing.py's `routing_problem`; this module resolves, once per model config, which
layers of the run's model are sparse and whether the run keeps routing.
"""

from __future__ import annotations

import functools

from decentrl.api.wire import Rollout
from decentrl.config import PretrainedModelConfig, TinyModelConfig
from decentrl.model.routing import RouteSpec, keeps_routing, routing_problem, spec_of


@functools.cache
def _resolved(model: TinyModelConfig | PretrainedModelConfig) -> tuple[RouteSpec | None, bool]:
    # Config sections are frozen (hashable): a pretrained config.json is read once per run.
    spec = spec_of(model)
    return spec, keeps_routing(model, spec)


def routing_problem_of(rollout: Rollout, model: TinyModelConfig | PretrainedModelConfig) -> str | None:
    """The rejection reason of a rollout's routes (`bad_expert_routing:...`), or None."""
    if rollout.expert_routing is None and model.keep_routing is False:
        return None  # the common dense case, without resolving the model
    spec, keep = _resolved(model)
    tokens = len(rollout.prompt_token_ids) + len(rollout.completion_token_ids)
    return routing_problem(rollout.expert_routing, spec, keep, tokens)


def run_keeps_routing(model: TinyModelConfig | PretrainedModelConfig) -> bool:
    """Whether the run's rollouts must carry routes (told to workers in /v1/info). Also resolves
    the model once at start-up, so a `keep_routing = true` on a dense model stops the service there."""
    return _resolved(model)[1]
