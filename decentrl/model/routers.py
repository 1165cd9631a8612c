"""Recording and replaying MoE routes on stock transformers models (Keep Routing; docs/routing.md).

transformers' MoE blocks (Qwen3-MoE, OLMoE, Mixtral) call a router module, the block's `gate`,
that returns (router logits, top-k gate weights, top-k expert ids). Both directions work on
those modules, per instance, with forward hooks:
- `RouteRecorder` (the hf worker backend) keeps each call's expert ids;
- `replaying` (the trainer's forward, the verifier's recomputation) replaces the ids by the
  recorded ones and recomputes the gate weights from the router's current logits over those
  experts (softmax, gathered, renormalized where the architecture renormalizes), so the router
  still gets a gradient. The hooks stay in place for the whole step, so activation
  checkpointing's recomputation in the backward replays the same routes.
Rows with no recorded route (padding, a sample's last token) keep the router's own choice:
their outputs reach no trained logprob (causal attention).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from decentrl.api.wire import ExpertRouting


def _renormalizes() -> dict[type[torch.nn.Module], Callable[[torch.nn.Module], bool]]:
    """Router class -> whether its top-k gate weights are renormalized to sum to 1."""
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    from transformers.models.olmoe.modeling_olmoe import OlmoeTopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    return {
        Qwen3MoeTopKRouter: lambda router: bool(router.norm_topk_prob),
        OlmoeTopKRouter: lambda router: bool(router.norm_topk_prob),
        MixtralTopKRouter: lambda router: True,
    }


def routers(model: torch.nn.Module) -> list[tuple[torch.nn.Module, bool]]:
    """The model's routers in layer order, each with whether it renormalizes; [] for a dense model."""
    kinds = _renormalizes()
    found = []
    for module in model.modules():
        for kind, renormalizes in kinds.items():
            if isinstance(module, kind):  # FSDP2 subclasses a module's class: isinstance still holds
                found.append((module, renormalizes(module)))
    return found


class RouteRecorder:
    """Forward hooks on every router; `take()` returns what the forwards since the last take chose."""

    def __init__(self, model: torch.nn.Module) -> None:
        self._routers = routers(model)
        self._chosen: list[list[torch.Tensor]] = [[] for _ in self._routers]
        self._handles = [
            router.register_forward_hook(self._hook(layer)) for layer, (router, _) in enumerate(self._routers)
        ]

    @property
    def layers(self) -> int:
        """Routers hooked: the model's sparse layers (0 for a dense model)."""
        return len(self._routers)

    def _hook(self, layer: int) -> Callable[..., None]:
        def keep(module: torch.nn.Module, args: object, output: tuple[torch.Tensor, ...]) -> None:
            self._chosen[layer].append(output[2].detach())  # (N, K) expert ids

        return keep

    def take(self) -> torch.Tensor:
        """(N, layers, K) expert ids of the tokens of the last forward (one forward per take)."""
        chosen = torch.stack([calls.pop() for calls in self._chosen], dim=1)
        if any(self._chosen):
            raise RuntimeError("RouteRecorder.take: more than one forward since the last take")
        return chosen

    def __enter__(self) -> RouteRecorder:
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()


def _replay_hook(routes: torch.Tensor, renormalize: bool, drift: list[int]) -> Callable[..., tuple[torch.Tensor, ...]]:
    """`routes`: (N, K) recorded expert ids of this layer, -1 rows where none was recorded."""

    def replay(module: torch.nn.Module, args: object, output: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        logits, weights, own = output  # (N, E), (N, K), (N, K)
        if routes.shape != own.shape:
            raise ValueError(f"recorded routes of shape {tuple(routes.shape)} for a router call of {tuple(own.shape)}")
        recorded = routes[:, :1] >= 0  # (N, 1)
        chosen = torch.where(recorded, routes, own)  # (N, K)
        drift[0] += int(recorded.sum())
        drift[1] += int((recorded.squeeze(-1) & (chosen.sort(-1).values != own.sort(-1).values).any(-1)).sum())
        gates = logits.float().softmax(dim=-1).gather(-1, chosen)  # (N, K)
        if renormalize:
            gates = gates / gates.sum(dim=-1, keepdim=True)
        return logits, gates.to(weights.dtype), chosen

    return replay


@contextmanager
def replaying(model: torch.nn.Module, routes: torch.Tensor | None) -> Iterator[list[int]]:
    """Within the block, the model's routers use `routes` (B, T, layers, K; -1 rows: the router's
    own choice) for inputs of shape (B, T). Yields [rows replayed, rows whose recorded expert set
    differs from the router's own], counted over every forward in the block. `None`: no replay."""
    drift = [0, 0]
    if routes is None:
        yield drift
        return
    found = routers(model)
    if len(found) != routes.shape[2]:
        raise ValueError(f"routes for {routes.shape[2]} sparse layers, but the model has {len(found)}")
    handles = [
        router.register_forward_hook(_replay_hook(routes[:, :, layer].reshape(-1, routes.shape[-1]), renorm, drift))
        for layer, (router, renorm) in enumerate(found)
    ]
    try:
        yield drift
    finally:
        for handle in handles:
            handle.remove()


def routes_tensor(routings: list[ExpertRouting | None], width: int, spec_layers: int, top_k: int) -> torch.Tensor:
    """(B, width, layers, K) long: each sample's routes from position 0 (right padding), -1 elsewhere."""
    out = torch.full((len(routings), width, spec_layers, top_k), -1, dtype=torch.long)
    for row, routing in enumerate(routings):
        if routing is not None and routing.experts:
            rows = torch.tensor(routing.experts, dtype=torch.long).view(-1, spec_layers, top_k)
            out[row, : rows.shape[0]] = rows
    return out


def batch_routes(routings: list[ExpertRouting | None], width: int) -> torch.Tensor | None:
    """`routes_tensor` for a micro-batch, or None when no sample carries routes."""
    shaped = [r for r in routings if r is not None]
    if not shaped:
        return None
    return routes_tensor(routings, width, shaped[0].layers, shaped[0].top_k)


def to_wire(routes: torch.Tensor) -> ExpertRouting:
    """(T, layers, K) expert ids as the wire's ExpertRouting."""
    return ExpertRouting(layers=routes.shape[1], top_k=routes.shape[2], experts=routes.reshape(-1).tolist())
