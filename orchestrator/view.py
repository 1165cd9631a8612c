"""RunView: the run's state read under the names other modules use, and the /v1/status answer.

RunState (orchestrator/state.py) is a RunView: it builds and changes the parts declared here; this
class only reads them, and builds `status()` (GET /v1/status, `decentrl status`).
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable
from operator import attrgetter
from typing import Any

from decentrl.api.wire import SamplingParams, StatusResponse
from decentrl.config import RunConfig
from decentrl.tasks import Task
from decentrl.tasks.episodes import EpisodeTask
from decentrl.tasks.guard import reward_failures
from orchestrator.buffer import Buffer, Group, VerifyJob
from orchestrator.checks import IngestChecks
from orchestrator.counters import Counters, Versions
from orchestrator.integrity import Integrity
from orchestrator.journal import RunJournal
from orchestrator.leases import LeaseBook, OpenLease
from orchestrator.score_queue import ScoreQueue


def _alias(path: str, *, settable: bool = False) -> Any:
    """A property reading `self.<path>`; `settable`: one that replaces the field whole."""
    owner, name = path.rsplit(".", 1)

    def replace(self: RunView, value: object) -> None:
        setattr(attrgetter(owner)(self), name, value)

    return property(attrgetter(path), replace if settable else None)


class RunView:
    config: RunConfig
    task: Task | EpisodeTask
    clock: Callable[[], float]
    started_at: float
    journal: RunJournal
    versions: Versions
    counters: Counters
    integrity: Integrity
    lease_book: LeaseBook
    checks: IngestChecks
    buffer: Buffer
    score_queue: ScoreQueue

    # Parts' fields under the names callers use.
    buffer_limit: int = _alias("config.orchestrator.max_buffer_groups")
    sampling: SamplingParams = _alias("checks.sampling", settable=True)
    published_version: int | None = _alias("versions.published")
    trainer_version: int = _alias("versions.trainer")
    leases: dict[str, OpenLease] = _alias("lease_book.open")
    ready: deque[Group] = _alias("buffer.ready")
    pending: dict[str, Group] = _alias("buffer.pending")
    verify_queue: deque[VerifyJob] = _alias("buffer.verify_queue")
    rollouts_accepted: int = _alias("counters.rollouts_accepted")
    rejected: Counter[str] = _alias("counters.rejected")
    dropped: Counter[str] = _alias("counters.dropped")
    stale_dropped: int = _alias("counters.stale_dropped")
    groups_served: int = _alias("counters.groups_served")
    leases_expired: int = _alias("counters.leases_expired")

    def buffer_full(self) -> bool:
        return len(self.buffer.ready) >= self.buffer_limit

    def status(self) -> StatusResponse:
        counters, rewards = self.counters, list(self.counters.recent_rewards)
        return StatusResponse(
            run_name=self.config.run_name,
            policy_version=self.versions.published,
            trainer_version=self.versions.trainer,
            rollouts_accepted=counters.rollouts_accepted,
            rollouts_rejected=dict(counters.rejected),
            stale_dropped=counters.stale_dropped,
            groups_ready=len(self.buffer.ready),
            groups_served=counters.groups_served,
            groups_skipped=counters.groups_skipped,
            leases_active=len(self.lease_book.open),
            leases_expired=counters.leases_expired,
            hedged_leases=counters.hedged_leases,
            hedge_duplicates=counters.hedge_duplicates,
            hedge_mismatches=counters.hedge_mismatches,
            hedge_copies_told=counters.hedge_copies_told,
            reward_mean_recent=sum(rewards) / len(rewards) if rewards else None,
            uptime_s=self.clock() - self.started_at,
            rollouts_duplicate=counters.duplicates,
            dropped=dict(counters.dropped),
            buffer_limit=self.buffer_limit,
            journal=self.journal.durable,
            recoveries=counters.recoveries,
            groups_verifying=self.buffer.pending_for("check"),
            groups_scoring=self.buffer.pending_for("scores"),
            scoring=self.score_queue.summary() if self.config.orchestrator.rewards.uses_model else None,
            workers=self.integrity.summary(),
            reward_failures=reward_failures(self.task),
        )
