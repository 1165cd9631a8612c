"""The staleness rule shared by the orchestrator (ingest, eviction, lease budget) and the tests.

Policy version 0 is the initial model; the trainer publishes version N after optimizer step N,
so the step that produces version N+1 starts from weights at version N (its `trainer_version`).
A rollout sampled under version v may train that step iff 0 <= N - v <= max_staleness.
max_staleness = 0 is the synchronous, on-policy baseline.
"""

from __future__ import annotations


def staleness(trainer_version: int, rollout_version: int) -> int:
    return trainer_version - rollout_version


def is_fresh(trainer_version: int, rollout_version: int, max_staleness: int) -> bool:
    return 0 <= staleness(trainer_version, rollout_version) <= max_staleness


def lease_budget(published_version: int, max_staleness: int, groups_per_step: int, groups_committed: int) -> int:
    """Groups that may still be started without any of them becoming stale by construction.

    Groups are consumed in order, `groups_per_step` a step. A group started now is sampled
    under `published_version`; it must be consumed by the step starting from version
    published_version + max_staleness at the latest, i.e. be among the first
    (published_version + max_staleness + 1) * groups_per_step groups of the run.
    `groups_committed` counts groups served to the trainer, complete in the buffer, or leased
    and not expired; dropped and expired groups free their slot again.
    """
    return max(0, (published_version + max_staleness + 1) * groups_per_step - groups_committed)
