"""The HTTP wire contract between workers, the orchestrator and the trainer.

Every request and response body is one of these pydantic models; the orchestrator validates
with them, workers and the trainer build them. Token ids and logprobs travel as plain lists.
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

API_PREFIX = "/v1"
WORKER_ID = r"^[A-Za-z0-9._:@-]{1,128}$"  # no "/": lease holders are "token-name/worker-id"


class Wire(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SamplingParams(Wire):
    """The sampling the worker actually applied; logprobs are of this distribution."""

    temperature: float = Field(gt=0, description="Softmax temperature.")
    max_tokens: int = Field(ge=1, description="Most completion tokens.")
    top_k: int = Field(0, ge=0, description="0 = no top-k truncation.")
    top_p: float = Field(1.0, gt=0, le=1, description="1.0 = no nucleus truncation.")
    stop: list[str] = Field(
        default_factory=list, description="Stop strings; the token completing one is the last token kept."
    )


class RunInfo(Wire):
    """GET /v1/info: what a worker needs to join with only a URL and a token."""

    run_name: str
    store_url: str = Field(description="fsspec URL of the checkpoint store.")
    policy_version: int | None = Field(description="Newest published version; None before v0 exists.")
    max_staleness: int = Field(ge=0)
    group_size: int = Field(ge=1)


class LeaseRequest(Wire):
    worker_id: str = Field(pattern=WORKER_ID, description="Stable name of the worker.")
    max_groups: int = Field(ge=1, le=1024, description="Most prompt groups wanted.")


class Lease(Wire):
    """One prompt leased to one worker: it owes `group_size` samples before `deadline`."""

    lease_id: str
    prompt_id: int = Field(ge=0)
    prompt_token_ids: list[int]
    group_size: int = Field(ge=1)
    deadline: float = Field(description="Unix time after which the prompt is leased again.")


class LeaseResponse(Wire):
    policy_version: int | None = Field(description="Newest published version; generate with it.")
    sampling: SamplingParams
    leases: list[Lease] = Field(description="Empty when the run needs no more rollouts right now.")
    retry_after_s: float = Field(0.0, ge=0, description="When empty: wait this long before asking again.")


FinishReason = Literal["stop", "length"]


class Rollout(Wire):
    """One sample of a group, as the worker produced it."""

    rollout_id: str = Field(min_length=1, max_length=128, description="Unique; resends are idempotent.")
    run_name: str
    lease_id: str = Field(description="The lease this sample answers; also its group id.")
    prompt_id: int = Field(ge=0)
    worker_id: str = Field(pattern=WORKER_ID)
    policy_version: int = Field(ge=0, description="Version of the weights that sampled the first token.")
    token_versions: list[int] | None = Field(
        None, description="Per completion token version, when generation spanned a weight swap."
    )
    prompt_token_ids: list[int] = Field(min_length=1)
    completion_token_ids: list[int] = Field(min_length=1)
    logprobs: list[float] = Field(description="Sampling logprob of each completion token.")
    finish_reason: FinishReason
    sampling: SamplingParams
    sampling_mask: list[list[int]] | None = Field(
        None, description="Per token, the vocabulary ids kept by top-k/top-p truncation (None: all)."
    )
    expert_routing: list[list[int]] | None = Field(None, description="MoE routing per token, if any.")
    claimed_reward: float | None = Field(None, description="The worker's own reward; never trusted.")

    @model_validator(mode="after")
    def _lengths_agree(self) -> Rollout:
        n = len(self.completion_token_ids)
        for name in ("logprobs", "token_versions", "sampling_mask"):
            values = getattr(self, name)
            if values is not None and len(values) != n:
                raise ValueError(f"{name} has {len(values)} entries but completion_token_ids has {n}")
        # NaN compares false with everything, so test finiteness first: one NaN or -inf would
        # otherwise reach the trainer's loss.
        if not all(math.isfinite(lp) and lp <= 1e-4 for lp in self.logprobs):
            raise ValueError("logprobs must be finite and <= 0 (log of a probability)")
        return self


class RolloutBatch(Wire):
    """POST /v1/rollouts body."""

    rollouts: list[Rollout] = Field(min_length=1, max_length=4096)


class Rejection(Wire):
    rollout_id: str
    reason: str


class IngestResponse(Wire):
    accepted: int = Field(ge=0)
    duplicates: int = Field(0, ge=0, description="Already acknowledged earlier; counted once.")
    rejected: list[Rejection] = Field(default_factory=list)


class TrainSample(Wire):
    """One sample as the trainer consumes it: tokens, sampling logprobs and its advantage."""

    prompt_token_ids: list[int]
    completion_token_ids: list[int]
    logprobs: list[float]
    advantage: float
    reward: float
    policy_version: int
    group_id: str | None = Field(None, description="The group (lease) it belongs to; the trainer filters by group.")


class TrainBatch(Wire):
    """GET /v1/batch answer: complete groups, fresh for the trainer's current version."""

    trainer_version: int = Field(ge=0)
    samples: list[TrainSample]
    staleness_histogram: dict[str, int] = Field(description="Samples per (trainer_version - policy_version).")
    rollouts_accepted: int = Field(ge=0, description="Run total acknowledged so far.")
    stale_dropped: int = Field(ge=0, description="Run total dropped as stale (ingest or buffer).")


class VersionAnnouncement(Wire):
    """POST /v1/version (trainer): version N is complete in the store."""

    version: int = Field(ge=0)


class StatusResponse(Wire):
    """GET /v1/status: counters for progress displays."""

    run_name: str
    policy_version: int | None
    trainer_version: int
    rollouts_accepted: int
    rollouts_rejected: dict[str, int]
    stale_dropped: int
    groups_ready: int
    groups_served: int
    leases_active: int
    leases_expired: int
    reward_mean_recent: float | None
    uptime_s: float
