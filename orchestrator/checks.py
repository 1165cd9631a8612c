"""The ingest checks: why a posted rollout is refused, or None to accept it.

The second stage of RunState.ingest, run on each rollout with what the owner looked up for it
(its open lease, or the status its lease closed with, and the versions); it holds no other part.
Cheap checks come first; an episode is replayed against its environment; with verification on, a
finish reason the tokens contradict is refused too. The reasons are a `Rejection`'s on the wire
(docs/api.md). MoE routes are checked by decentrl/model/routing.py's rules, resolved here once
per model config.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Protocol

from decentrl.api.wire import ROOT_NODE, BranchParent, Lease, RolesUnit, Rollout, SamplingParams, TreeUnit, Unit, value_range
from decentrl.config import PretrainedModelConfig, RunConfig, TinyModelConfig
from decentrl.model.routing import RouteSpec, keeps_routing, routing_problem, spec_of
from decentrl.rl.staleness import is_fresh
from decentrl.tasks import Task
from decentrl.tasks.episodes import EpisodeMismatch, EpisodeTask, TextCodec, replay_episode

log = logging.getLogger("decentrl.orchestrator.checks")

PROPOSER = "proposer"  # the role of a unit of roles' root node (orchestrator/leases.py `ROOT`)

# The rejection of a rollout whose lease closed, by the status it closed with.
CLOSED_REASON = {
    "complete": "group_full",
    "served": "group_full",
    "expired": "lease_expired",
    "released": "lease_released",
    "dropped": "group_dropped",
    "superseded": "hedge_lost",  # another copy of its place completed first (its holder's posts: duplicates)
    "skipped": "group_full",  # complete, and dropped by dynamic sampling when a step consumed it
    "filled": "group_full",  # a sub-lease of a unit of roles that took all its samples
    "node_closed": "node_closed",  # a sub-lease whose node closed (its unit complete, or closed short)
}


class OpenGroup(Protocol):
    """What the checks read of an open lease (orchestrator/leases.py `OpenLease`)."""

    lease: Lease
    holder: str
    samples: list[Rollout]
    posted: int


# A finished sample's journaled verdict on each step it names (None where none is in), or None
# when its posted steps are not its steps (orchestrator/score_queue.py StepBook.verdicts_of).
StepVerdicts = Callable[[Rollout], "list[float | None] | None"]


class IngestChecks:
    def __init__(
        self, *, config: RunConfig, task: Task | EpisodeTask, sampling: SamplingParams, vocab_size: int,
        ends: Callable[[list[int]], bool], episode_codec: TextCodec | None, verdicts: StepVerdicts,
    ) -> None:
        """`ends`: whether a completion's tokens end its generation (end-of-sequence or a stop
        string, decentrl/model/stopping.py); `episode_codec`: a multi-turn task's text codec;
        `verdicts`: the journaled verdicts on a sample's posted steps (tree units)."""
        self.verdicts = verdicts
        self.config = config
        self.task = task
        self.sampling = sampling  # every rollout must have been sampled with exactly these
        self.vocab_size = vocab_size
        self.ends = ends
        self.episode_codec = episode_codec

    def reason(
        self, rollout: Rollout, holder: str, *, lease: OpenGroup | None, closed: str | None, published: int | None,
        trainer: int,
    ) -> str | None:
        """The reason to reject a rollout, or None to accept it. `lease`: its open lease, or None
        and the status it `closed` with (None: unknown or expired long ago); `published`, `trainer`:
        the newest published version and the trainer's."""
        if rollout.run_name != self.config.run_name:
            return "wrong_run"
        if lease is None:
            return CLOSED_REASON[closed] if closed is not None else "unknown_or_expired_lease"
        if lease.holder != holder:
            return "not_lease_holder"
        granted = lease.lease
        if rollout.prompt_id != granted.prompt_id:
            return "prompt_mismatch"
        if granted.unit is None and (rollout.node is not None or rollout.step_ends is not None):
            return "node_without_unit"  # this run's leases are plain groups
        if rollout.node is None or rollout.node.parent is None:
            if rollout.prompt_token_ids != granted.prompt_token_ids:
                return "prompt_mismatch"
        if isinstance(granted.unit, RolesUnit) and (problem := self.roles_problem(rollout, lease)) is not None:
            return problem
        if isinstance(granted.unit, TreeUnit) and (problem := node_problem(rollout, granted.unit, lease, self.verdicts)) is not None:
            return problem
        if rollout.sampling != self.sampling:
            return "sampling_mismatch"
        if granted.policy_version is not None and (
            rollout.policy_version != granted.policy_version or rollout.token_versions is not None
        ):
            return "wrong_version"  # a deterministic run: the lease names the one version to sample under
        if granted.index is not None and (
            rollout.sample_index is None or rollout.sample_index >= granted.group_size
            or any(sample.sample_index == rollout.sample_index for sample in lease.samples)
        ):
            return "bad_sample_index"  # a deterministic run: each seed of the group once (the verifier re-draws)
        if published is None or rollout.policy_version > published:
            return "future_version"
        if not is_fresh(trainer, rollout.policy_version, self.config.train_staleness):
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
        episode = isinstance(self.task, EpisodeTask)
        if not episode and rollout.loss_mask is not None:
            return "loss_mask_without_episodes"  # a single-turn task has no environment tokens
        if rollout.finish_reason == "wrong_step" and (rollout.step_ends is None or rollout.step_ends[-1] != len(ids)):
            return "bad_finish_reason"  # a chain stopped at a wrong step ends with that step (a tree unit's)
        if rollout.finish_reason == "wrong_step" and (problem := wrong_step_problem(granted.unit, self.verdicts(rollout))):
            return problem
        if not episode and self.config.orchestrator.verification.enabled and (
            # "length" means exactly max_tokens tokens; "stop" means the last token is
            # end-of-sequence or completes a stop string. (An episode's replay checks its ending.)
            len(ids) != rollout.sampling.max_tokens if rollout.finish_reason == "length"
            else rollout.finish_reason == "stop" and not self.ends(ids)
        ):
            return "bad_finish_reason"
        if episode:
            assert isinstance(self.task, EpisodeTask) and self.episode_codec is not None
            try:
                replay_episode(
                    self.task, self.task.prompt(rollout.prompt_id), ids, rollout.loss_mask, rollout.finish_reason,
                    rollout.sampling, self.episode_codec, ends=self.ends,
                )
            except EpisodeMismatch as exc:
                log.info("rollout %s: %s", rollout.rollout_id, exc)
                return "episode_mismatch"
        return None

    def roles_problem(self, rollout: Rollout, lease: OpenGroup) -> str | None:
        """A unit of roles' rules (docs/architecture.md, "The unit of work, widened"): a sample of
        the unit's own lease is its proposer's, one, of the root node; a sub-lease's samples are
        of the node it names, exactly, at most as many as it holds. A derived node's prompt is the
        orchestrator's (checked against the sub-lease's like any lease's prompt); a worker never names one."""
        granted, node = lease.lease, rollout.node
        if granted.unit_id is None:
            policy = granted.node.policy if granted.node is not None else None  # a run of two policies: the proposer's
            if (node.policy if node is not None else None) != policy or node is not None and (
                node.parent is not None or node.node_id != ROOT_NODE or node.role not in (None, PROPOSER)
            ):
                return "node_mismatch"
            return "node_full" if lease.samples else None
        if node != granted.node:
            return "node_mismatch"
        if rollout.prompt_token_ids != granted.prompt_token_ids:
            return "prompt_mismatch"  # the derived prompt is the orchestrator's, on the sub-lease
        return "node_full" if lease.posted >= granted.group_size else None


def node_problem(rollout: Rollout, unit: Unit, lease: OpenGroup, verdicts: StepVerdicts) -> str | None:
    """The rejection reason of a sample of a widened unit by its node's rules, or None
    (docs/architecture.md, "The unit of work, widened"). A tree's root samples are the lease's
    prompt (node absent, or node `root` without a parent); a branch continues an acknowledged root
    sample of the same unit after one of the step boundaries it named (`at`), its prompt that
    sample's prompt plus its first `at` completion ids, at most `k` samples a branch node and
    `pivots` branch nodes a unit. Its prefix is prompt: it carries no gradient. A unit that
    branches `all_failed` takes branches after all its roots, and none once a root is known right
    by its journaled `verdicts` (orchestrator/leases.py `tree_pivots`)."""
    node = rollout.node
    if not isinstance(unit, TreeUnit):
        return "node_mismatch"  # units of roles: IngestChecks.roles_problem
    if node is not None and (node.role is not None or node.policy is not None):
        return "node_mismatch"  # a tree's nodes have no roles
    samples = lease.samples
    if node is None or node.parent is None:
        if node is not None and node.node_id != ROOT_NODE:
            return "node_mismatch"
        roots = sum(1 for sample in samples if sample.node is None or sample.node.parent is None)
        return "node_full" if roots >= lease.lease.group_size else None
    parent = node.parent
    if not isinstance(parent, BranchParent):
        return "node_mismatch"  # a derived node is the orchestrator's to make, never a worker's
    if unit.branch == "all_failed":
        roots = [sample for sample in samples if sample.node is None or sample.node.parent is None]
        if len(roots) < lease.lease.group_size:
            return "branch_before_roots"  # whether it branches at all is known from its roots
        if any(unit.known_right(verdicts(root)) for root in roots):
            return "root_known_right"
    source = next((sample for sample in samples if sample.rollout_id == parent.rollout_id), None)
    if source is None or (source.node is not None and source.node.parent is not None):
        return "unknown_parent"  # not an acknowledged root sample of this unit
    if source.step_ends is None or parent.at not in source.step_ends or parent.at >= len(source.completion_token_ids):
        return "bad_pivot"  # a pivot is a step boundary the parent posted, before its end
    prefix = source.completion_token_ids[: parent.at]
    if list(rollout.prompt_token_ids) != [*source.prompt_token_ids, *prefix]:
        return "prompt_mismatch"
    if rollout.expert_routing is not None and source.expert_routing is not None:
        # Keep Routing: the prefix was fed to the parent's model already; it routes as it did there.
        routing, theirs = rollout.expert_routing, source.expert_routing
        width = routing.layers * routing.top_k
        rows = (len(source.prompt_token_ids) + parent.at) * width
        if (routing.layers, routing.top_k) != (theirs.layers, theirs.top_k) or routing.experts[:rows] != theirs.experts[:rows]:
            return "bad_expert_routing:prefix"
    siblings, branch_nodes = 0, set()
    for sample in samples:
        other = sample.node
        if other is None or other.parent is None:
            continue
        branch_nodes.add(other.node_id)
        if other.node_id == node.node_id:
            if other.parent != parent:
                return "node_mismatch"  # one node, one parent
            siblings += 1
        elif other.parent == parent:
            return "node_mismatch"  # one pivot, one node
    if siblings >= unit.k:
        return "node_full"
    if node.node_id not in branch_nodes and len(branch_nodes) >= unit.pivots:
        return "too_many_pivots"
    return None


def wrong_step_problem(unit: Unit | None, verdicts: list[float | None] | None) -> str | None:
    """Why a chain stopped early (finish `wrong_step`) may not have been, or None: the step it ends
    with must have a journaled verdict under the unit's `stop_below`, so that a worker cannot stop
    chains at will. `verdicts`: the sample's, one per step it names (None: its posted steps are not
    its steps)."""
    if not isinstance(unit, TreeUnit) or unit.stop_below is None:
        return "bad_finish_reason"  # this run's chains are never stopped early
    if verdicts is None:
        return "wrong_step_unposted"  # its steps were not posted as it names them (POST /v1/steps)
    if verdicts[-1] is None:
        return "wrong_step_unjudged"  # no verdict on its last step is journaled
    if verdicts[-1] >= unit.stop_below:
        return "wrong_step_judged_right"
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
