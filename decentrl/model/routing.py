"""The routing contract of mixture-of-experts models (Keep Routing; docs/routing.md).

Which layers of a model are sparse, how many experts each has and how many a token takes
(`RouteSpec`), whether a run records and replays routes (`keeps_routing`), and what a rollout's
routes must look like (`routing_problem`). No torch here: the orchestrator checks routes at
ingest with this module (orchestrator/checks.py); the torch side (recording in a worker,
replaying in the trainer and the verifier) is decentrl/model/routers.py.

Layout: `ExpertRouting` (decentrl/api/wire.py) holds, row-major, one row per token fed to the model
(the prompt's tokens, then every completion token but the last: the last sampled token is never
fed, so it has no route), each row `layers` x `top_k` expert ids, one block per sparse layer in
layer order. Dense layers send nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from decentrl.api.encoding import value_range

if TYPE_CHECKING:
    from decentrl.api.wire import ExpertRouting
    from decentrl.config import PretrainedModelConfig, TinyModelConfig

# The model types whose transformers router decentrl records and replays (decentrl/model/routers.py);
# their configs name the expert count differently.
EXPERT_COUNT_KEYS = {"qwen3_moe": "num_experts", "olmoe": "num_experts", "mixtral": "num_local_experts"}


@dataclass(frozen=True)
class RouteSpec:
    """The routed shape of an MoE model: `sparse_layers` (indices) each pick `top_k` of `num_experts`."""

    num_experts: int
    top_k: int
    sparse_layers: tuple[int, ...]

    @property
    def layers(self) -> int:
        return len(self.sparse_layers)

    @property
    def id_bytes(self) -> int:
        """Bytes of one expert id on the msgpack wire: uint8 up to 256 experts, else uint16."""
        return 1 if self.num_experts <= 256 else 2


def qwen3_sparse_layers(num_layers: int, every: int, dense: Sequence[int]) -> tuple[int, ...]:
    """Qwen3-MoE's rule: layer i is sparse unless listed dense, when (i + 1) is a multiple of `every`."""
    return tuple(i for i in range(num_layers) if i not in dense and (i + 1) % every == 0)


def spec_of_hf_config(config: dict[str, Any]) -> RouteSpec | None:
    """The route spec of a transformers config (config.json as a dict); None for a dense model.

    ValueError for an MoE architecture whose router decentrl does not know how to replay."""
    model_type = config.get("model_type")
    key = EXPERT_COUNT_KEYS.get(str(model_type))
    if key is None:
        if any(config.get(k) for k in ("num_experts", "num_local_experts", "n_routed_experts")):
            raise ValueError(
                f"model_type {model_type!r} is a mixture of experts whose router decentrl cannot record or "
                f"replay (known: {sorted(EXPERT_COUNT_KEYS)}); set [model] keep_routing = false to train it unreplayed"
            )
        return None
    layers = int(config["num_hidden_layers"])
    if model_type == "qwen3_moe":
        sparse = qwen3_sparse_layers(layers, int(config.get("decoder_sparse_step", 1)), list(config.get("mlp_only_layers") or []))
    else:
        sparse = tuple(range(layers))
    if not sparse or not config[key]:
        return None
    return RouteSpec(num_experts=int(config[key]), top_k=int(config["num_experts_per_tok"]), sparse_layers=sparse)


def spec_of(model: TinyModelConfig | PretrainedModelConfig) -> RouteSpec | None:
    """The route spec of the run's `[model]`; None for a dense model. Reads config.json of a
    pretrained directory (transformers fills in the architecture's defaults)."""
    from decentrl.config import TinyModelConfig

    if isinstance(model, TinyModelConfig):
        if model.moe is None:
            return None
        moe = model.moe
        sparse = qwen3_sparse_layers(model.num_layers, moe.sparse_every, moe.dense_layers)
        return RouteSpec(moe.num_experts, moe.top_k, sparse) if sparse else None
    from transformers import AutoConfig

    return spec_of_hf_config(AutoConfig.from_pretrained(model.path).to_dict())


def keeps_routing(model: TinyModelConfig | PretrainedModelConfig, spec: RouteSpec | None) -> bool:
    """Whether the run records and replays routes: `[model] keep_routing`, by default on exactly
    for MoE models. ValueError for keep_routing = true on a dense model."""
    if model.keep_routing and spec is None:
        raise ValueError("[model] keep_routing = true but the model has no sparse (mixture-of-experts) layer; drop it")
    return spec is not None if model.keep_routing is None else model.keep_routing


def routing_problem(routing: ExpertRouting | None, spec: RouteSpec | None, keep: bool, tokens: int) -> str | None:
    """Why a rollout's routes are unacceptable, or None. `tokens`: prompt + completion length.

    Reasons (rejection names): `bad_expert_routing:dense_model` (routes for a model with no
    sparse layer), `bad_expert_routing:missing` (none while keep_routing is on),
    `bad_expert_routing:not_kept` (routes in a run with keep_routing off: the trainer would replay them),
    `bad_expert_routing:shape` (not [tokens - 1, sparse layers, top_k]),
    `bad_expert_routing:expert_out_of_range`, `bad_expert_routing:repeated_expert` (a token
    routed twice to one expert in one layer: no router does that)."""
    if routing is None:
        return "bad_expert_routing:missing" if keep else None
    if spec is None:
        return "bad_expert_routing:dense_model"
    if not keep:
        return "bad_expert_routing:not_kept"
    rows = tokens - 1
    if routing.layers != spec.layers or routing.top_k != spec.top_k or len(routing.experts) != rows * spec.layers * spec.top_k:
        return "bad_expert_routing:shape"
    if not routing.experts:
        return None
    low, high = value_range(routing.experts)
    if low < 0 or high >= spec.num_experts:
        return "bad_expert_routing:expert_out_of_range"
    if spec.top_k > 1 and _repeats(routing.experts, spec.top_k):
        return "bad_expert_routing:repeated_expert"
    return None


def _repeats(experts: list[int], top_k: int) -> bool:
    import numpy as np  # not at import time: `decentrl --help` stays fast

    picks = np.asarray(experts, dtype=np.int64).reshape(-1, top_k)
    picks.sort(axis=1)
    return bool((picks[:, 1:] == picks[:, :-1]).any())
