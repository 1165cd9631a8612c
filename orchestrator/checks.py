"""The ingest checks: why a posted rollout is refused, or None to accept it.

The first stage of RunState.ingest (orchestrator/state.py), run on every rollout that is not a
resend. Before it, once per POST /v1/rollouts, the rollouts handler (orchestrator/handlers.py)
holds the whole post to the size bounds that follow from the run's config (`oversized`, a 400:
nothing of it is ingested, held or journaled). Cheap checks come first (the lease, the prompt, the sampling params, the versions, the
token ranges); an episode is replayed against its environment (orchestrator/rewards.py); with
verification on, finish reasons and replays of content kept before are refused too
(orchestrator/integrity.py). The reasons are the `reason` of a `Rejection` on the wire and are
listed in docs/api.md.

Size bounds. The wire models (decentrl/api/wire.py) hold bounds that hold whatever the config;
the run adds its own: a top-k sampling mask keeps at most top_k ids a token, any mask at most the
vocabulary. (A completion longer than sampling.max_tokens, a prompt not its lease's, ids outside
the vocabulary: those are per-rollout rejections; each mask has one entry per completion token.)

MoE routes (Keep Routing; docs/routing.md): the rules are decentrl/model/routing.py's
`routing_problem`; this module resolves, once per model config, which layers of the run's model
are sparse and whether the run keeps routing.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from typing import NamedTuple

from decentrl.api.wire import Rollout, SamplingParams, value_range
from decentrl.config import PretrainedModelConfig, RunConfig, TinyModelConfig
from decentrl.model.routing import RouteSpec, keeps_routing, routing_problem, spec_of
from decentrl.rl.staleness import is_fresh
from decentrl.tasks import Task
from decentrl.tasks.episodes import EpisodeMismatch, EpisodeTask
from orchestrator.counters import Versions
from orchestrator.integrity import Integrity
from orchestrator.leases import CLOSED_REASON, LeaseBook
from orchestrator.rewards import Rewards

log = logging.getLogger("decentrl.orchestrator.checks")


class CheckResult(NamedTuple):
    reason: str | None  # why the rollout is refused; None: accepted
    digest: bytes | None  # its content hash, to keep for replay detection (verification on only)


class IngestChecks:
    def __init__(
        self,
        *,
        config: RunConfig,
        task: Task | EpisodeTask,
        sampling: SamplingParams,
        vocab_size: int,
        versions: Versions,
        lease_book: LeaseBook,
        integrity: Integrity,
        rewards: Rewards,
    ) -> None:
        self.config = config
        self.task = task
        self.sampling = sampling  # every rollout must have been sampled with exactly these
        self.vocab_size = vocab_size
        self.versions = versions
        self.lease_book = lease_book
        self.integrity = integrity
        self.rewards = rewards

    def check(self, rollout: Rollout, holder: str) -> CheckResult:
        if self.integrity.is_banned(holder):
            return CheckResult("banned", None)
        reason = self.reason(rollout, holder)
        if reason is not None or not self.config.orchestrator.verification.enabled:
            return CheckResult(reason, None)
        digest = self.integrity.replay_of(rollout)
        return CheckResult("replay", None) if digest is None else CheckResult(None, digest)

    def reason(self, rollout: Rollout, holder: str) -> str | None:
        """The reason to reject a rollout, or None to accept it."""
        if rollout.run_name != self.config.run_name:
            return "wrong_run"
        open_lease = self.lease_book.open.get(rollout.lease_id)
        if open_lease is None:
            closed = self.lease_book.closed_lease(rollout.lease_id)
            return CLOSED_REASON[closed.status] if closed is not None else "unknown_or_expired_lease"
        lease = open_lease.lease
        if open_lease.holder != holder:
            return "not_lease_holder"
        if rollout.prompt_id != lease.prompt_id or rollout.prompt_token_ids != lease.prompt_token_ids:
            return "prompt_mismatch"
        if rollout.sampling != self.sampling:
            return "sampling_mismatch"
        if lease.policy_version is not None and (
            rollout.policy_version != lease.policy_version or rollout.token_versions is not None
        ):
            return "wrong_version"  # a deterministic run: the lease names the one version to sample under
        if lease.index is not None and (
            rollout.sample_index is None or rollout.sample_index >= lease.group_size
            or any(sample.sample_index == rollout.sample_index for sample in open_lease.samples)
        ):
            return "bad_sample_index"  # a deterministic run: each seed of the group once (the verifier re-draws)
        published = self.versions.published
        if published is None or rollout.policy_version > published:
            return "future_version"
        if not is_fresh(self.versions.trainer, rollout.policy_version, self.config.train_staleness):
            return "stale"
        ids = rollout.completion_token_ids
        low, high = value_range(ids)  # numpy over the packed bytes when they came packed
        if low < 0 or high >= self.vocab_size:
            return "token_out_of_vocabulary"
        if len(ids) > self.sampling.max_tokens:
            return "too_many_tokens"
        if rollout.token_versions is not None:
            low, high = value_range(rollout.token_versions)
            if low < rollout.policy_version or high > published:
                return "bad_token_versions"
        if rollout.sampling_mask is not None and any(
            mask and (min(mask) < 0 or max(mask) >= self.vocab_size) for mask in rollout.sampling_mask
        ):
            return "token_out_of_vocabulary"
        if (problem := routing_problem_of(rollout, self.config.model)) is not None:
            return problem
        if isinstance(self.task, EpisodeTask):  # the replay checks the ending too
            try:
                self.rewards.episode_reward(rollout)
            except EpisodeMismatch as exc:
                log.info("rollout %s: %s", rollout.rollout_id, exc)
                return "episode_mismatch"
        elif rollout.loss_mask is not None:
            return "loss_mask_without_episodes"  # a single-turn task has no environment tokens
        elif self.config.orchestrator.verification.enabled and self.integrity.finish_reason_problem(rollout):
            return "bad_finish_reason"
        return None


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
