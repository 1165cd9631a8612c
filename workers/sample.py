"""One completion as the worker builds it, and the wire Rollout it becomes (`to_rollout`)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from decentrl.api.wire import ExpertRouting, Lease, Rollout, SamplingParams


@dataclass
class Sample:
    """A completion in the making: it may span weight swaps (`versions` per token) and, for an
    episode, model and environment turns (`loss_mask` per token)."""

    prompt: list[int]
    budget: int  # most completion tokens
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    masks: list[list[int]] | None = None  # sampling masks (top-k/top-p kept ids), per token
    finish_reason: str | None = None
    loss_mask: list[int] | None = None  # episodes: 1 model token, 0 environment token
    claimed_reward: float | None = None
    routes: ExpertRouting | None = None  # MoE: experts of every token fed (decentrl/model/routing.py)
    # Deterministic runs: seed, place in group, group (never split across calls), lease's version.
    seed: int | None = None
    index: int | None = None
    group: str | None = None
    version: int | None = None

    def extend(
        self, token_ids: list[int], logprobs: list[float], versions: list[int], masks: list[list[int]] | None
    ) -> None:
        self.token_ids += token_ids
        self.logprobs += logprobs
        self.versions += versions
        if masks is not None:
            self.masks = (self.masks or []) + masks

    def extend_routes(self, routes: ExpertRouting | None) -> None:
        """Routes of a generation of prompt + the tokens before its `extend`. After a swap the rows
        already recorded stay (they routed the old weights' tokens); the continuation adds the rest."""
        if routes is None or self.routes is None:
            self.routes = routes
            return
        kept = self.routes.experts
        self.routes = routes.model_copy(update={"experts": list(kept) + list(routes.experts)[len(kept) :]})


def to_rollout(
    run_name: str, worker_id: str, lease: Lease, sample: Sample, sampling: SamplingParams, *, keep_routing: bool
) -> Rollout:
    """The rollout to post for `sample`; `token_versions` only when it spans a swap. MoE routes
    travel only in a keep_routing run: the trainer replays any routes it is given. A sub-lease of
    a unit of roles is a lease like any other: its samples carry its node."""
    mixed = len(set(sample.versions)) > 1
    return Rollout(
        rollout_id=uuid.uuid4().hex,
        run_name=run_name,
        lease_id=lease.lease_id,
        prompt_id=lease.prompt_id,
        worker_id=worker_id,
        sample_index=sample.index,
        policy_version=sample.versions[0],
        token_versions=sample.versions if mixed else None,
        prompt_token_ids=lease.prompt_token_ids,
        completion_token_ids=sample.token_ids,
        logprobs=sample.logprobs,
        finish_reason=sample.finish_reason,  # type: ignore[arg-type]
        sampling=sampling,
        sampling_mask=sample.masks,
        loss_mask=sample.loss_mask,  # type: ignore[arg-type]
        claimed_reward=sample.claimed_reward,
        expert_routing=sample.routes if keep_routing else None,
        node=lease.node,  # a unit of roles: the node (and role) the lease is of
    )
