"""RunView: the run's state read under the names other modules use, and the /v1/status answer.

RunState (orchestrator/state.py) is a RunView: it builds the parts declared here and changes them;
this class only reads them, for the handlers, the verification loop, the metrics, benchmarks and
tests, and builds `status()` (GET /v1/status, `decentrl status`). Its two setters replace a part
whole (`sampling`: tests; `verify_queue`: orchestrator/verification.py).
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable

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


class RunView:
    # The parts, built by RunState.__init__.
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

    @property
    def buffer_limit(self) -> int:
        return self.config.orchestrator.max_buffer_groups

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
            groups_verifying=self.buffer.held_back_for("check"),
            groups_scoring=self.buffer.held_back_for("scores"),
            scoring=self.score_queue.summary() if self.config.orchestrator.rewards.uses_model else None,
            workers=self.integrity.summary(),
            reward_failures=reward_failures(self.task),
        )

    @property
    def sampling(self) -> SamplingParams:
        return self.checks.sampling

    @sampling.setter
    def sampling(self, value: SamplingParams) -> None:
        self.checks.sampling = value

    @property
    def published_version(self) -> int | None:
        return self.versions.published

    @property
    def trainer_version(self) -> int:
        return self.versions.trainer

    @property
    def leases(self) -> dict[str, OpenLease]:
        return self.lease_book.open

    @property
    def ready(self) -> deque[Group]:
        return self.buffer.ready

    @property
    def pending(self) -> dict[str, Group]:
        return self.buffer.pending

    @property
    def verify_queue(self) -> deque[VerifyJob]:
        return self.buffer.verify_queue

    @verify_queue.setter
    def verify_queue(self, value: deque[VerifyJob]) -> None:
        self.buffer.verify_queue = value

    @property
    def rollouts_accepted(self) -> int:
        return self.counters.rollouts_accepted

    @property
    def rejected(self) -> Counter[str]:
        return self.counters.rejected

    @property
    def dropped(self) -> Counter[str]:
        return self.counters.dropped

    @property
    def stale_dropped(self) -> int:
        return self.counters.stale_dropped

    @property
    def groups_served(self) -> int:
        return self.counters.groups_served

    @property
    def leases_expired(self) -> int:
        return self.counters.leases_expired
