"""The scorer loop: lease samples to score, score them with the backend, post the scores.

Run by `decentrl scorer` (through `run_scorer` below), by tests and benchmarks. The scorer
protocol (docs/rewards.md): `POST /v1/score/leases` long-polls for up to `max_items` samples;
`POST /v1/score/leases/{id}/renew` pushes the lease's deadline out; `POST /v1/scores` posts
them (idempotent by rollout id, so the client's retries of a post whose answer was lost are
counted once). One loop, top to bottom:

    lease -> score (in a thread; the lease renewed while it runs) -> check -> post

- An empty lease: wait the orchestrator's `retry_after_s` (at least `min_wait_s`), ask again.
- Renewal: at half the time left before the deadline (the orchestrator's clock: clocks are
  assumed NTP-close; renewing at the half leaves room for a skew below half the lease timeout).
  A renewal refused (the lease expired, 409) is not tried again: the post will be refused too,
  and the items are already with another scorer.
- Checks (`checked`): a verdict without a score, with a NaN or out-of-range score or step score
  (the lease's `score_range`), or without one step score per step of an item that has steps, is
  posted as `failure = "parse"`: the run's `on_parse_failure` decides what it becomes (a default
  score or a drop, counted by the orchestrator), never a silent 0. A transient verdict (the judge
  unreachable after its retries) is not posted: its lease expires and it is leased again.
- A post the orchestrator refuses because the lease is gone (403/404/409) is counted as `lost`
  and the loop goes on; the samples were leased again.
- SIGTERM/SIGINT: no new lease; the batch being scored is finished and posted, then it exits.
A backend that raises (a judge refusing every request, a model that does not fit) stops the
scorer with its message; its lease expires and is leased again.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from decentrl.client import OrchestratorClient, OrchestratorError
from decentrl.config import ScorerConfig
from decentrl.wire import ScoreItem, ScoreLease, ScoreLeaseRequest, ScorePost, ScoreResult
from workers.scorers import ScoreBackend, Verdict, build_scorer_backend

log = logging.getLogger("decentrl.scorer")
LEASE_GONE = (403, 404, 409)  # the lease expired, closed, or is held by another scorer
MIN_RENEW_S = 0.5


@dataclass
class ScorerCounts:
    leases: int = 0
    scored: int = 0  # posted with a score
    failed: int = 0  # posted as a parse failure
    transient: int = 0  # not posted (the backend could not be reached); leased again after expiry
    lost: int = 0  # posted, but the lease was gone
    duplicates: int = 0  # posted again after a lost answer; counted once by the orchestrator
    parse_retries: int = 0


class Scorer:
    def __init__(
        self, config: ScorerConfig, *, scorer_id: str, client: OrchestratorClient, backend: ScoreBackend
    ) -> None:
        self.config = config
        self.scorer_id = scorer_id
        self.client = client
        self.backend = backend
        self.counts = ScorerCounts()
        self.stopping = False
        self._wake = threading.Event()  # set on stop: cuts a wait short

    def request_stop(self, *_: object) -> None:
        """SIGTERM/SIGINT: the batch in hand is finished and posted, then `run` returns."""
        self.stopping = True
        self._wake.set()

    def run(self, max_leases: int | None = None) -> ScorerCounts:
        """Lease, score and post until stopped (or `max_leases` leases, counted over every run).
        A lease answered after a stop was asked for is still scored and posted (one batch)."""
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self.request_stop)
            signal.signal(signal.SIGINT, self.request_stop)
        request = ScoreLeaseRequest(scorer_id=self.scorer_id, max_items=self.config.max_items)
        with ThreadPoolExecutor(1, thread_name_prefix="score") as pool:
            while not self.stopping and (max_leases is None or self.counts.leases < max_leases):
                lease = self.client.score_lease(request)
                if not lease.items:
                    self._wake.wait(max(lease.retry_after_s, self.config.min_wait_s))
                    continue
                self.counts.leases += 1
                verdicts = self.score_renewing(pool, lease)
                self.post(lease, verdicts)
        log.info("scorer %s stopping: %s", self.scorer_id, self.counts)
        return self.counts

    def score_renewing(self, pool: ThreadPoolExecutor, lease: ScoreLease) -> list[Verdict]:
        """The backend's verdicts for the lease's items (scored in `pool`), renewing the lease meanwhile."""
        future = pool.submit(self.backend.score, lease.items)
        deadline, renewing = lease.deadline, True
        while True:
            wait = max(MIN_RENEW_S, (deadline - time.time()) / 2) if renewing else None
            try:
                return future.result(timeout=wait)
            except TimeoutError:
                pass
            try:
                deadline = self.client.renew_score_lease(lease.lease_id, self.scorer_id).deadline
            except OrchestratorError as exc:
                if exc.status not in LEASE_GONE:
                    raise
                log.warning("lease %s could not be renewed (%s); its items are leased again", lease.lease_id, exc)
                renewing = False

    def post(self, lease: ScoreLease, verdicts: list[Verdict]) -> None:
        low, high = lease.score_range
        results = []
        for item, verdict in zip(lease.items, verdicts, strict=True):
            self.counts.parse_retries += verdict.retries
            if verdict.transient:
                log.warning("sample %s not scored (%s); it is leased again", item.rollout_id, verdict.error)
                self.counts.transient += 1
                continue
            result = checked(item, verdict, low, high)
            if result.failure is not None:
                self.counts.failed += 1
            results.append(result)
        if not results:
            return
        post = ScorePost(
            lease_id=lease.lease_id, scorer_id=self.scorer_id, scores=results,
            parse_retries=sum(verdict.retries for verdict in verdicts),
        )
        try:
            ack = self.client.post_scores(post)
        except OrchestratorError as exc:
            if exc.status not in LEASE_GONE:
                raise
            log.warning("scores of lease %s refused (%s): its samples were leased again", lease.lease_id, exc)
            self.counts.lost += len(results)
            return
        self.counts.scored += sum(result.failure is None for result in results)
        self.counts.duplicates += ack.duplicates


def checked(item: ScoreItem, verdict: Verdict, low: float, high: float) -> ScoreResult:
    """The result to post for a verdict: its score, or a parse failure saying (in the log) why."""
    problem = verdict_problem(item, verdict, low, high)
    if problem is not None:
        log.warning("sample %s: %s; posted as a parse failure", item.rollout_id, problem)
        return ScoreResult(rollout_id=item.rollout_id, score=None, failure="parse")
    assert verdict.score is not None  # verdict_problem said so
    steps = None if item.steps is None else [float(value) for value in verdict.step_scores or ()]
    return ScoreResult(rollout_id=item.rollout_id, score=float(verdict.score), step_scores=steps)


def verdict_problem(item: ScoreItem, verdict: Verdict, low: float, high: float) -> str | None:
    """Why a verdict cannot be posted as a score, or None. Step scores of an item without steps
    are not wanted and are left out, not a problem."""
    if verdict.score is None:
        return verdict.error or "the backend gave no score"
    wanted = item.steps is not None
    if wanted and (verdict.step_scores is None or len(verdict.step_scores) != len(item.steps or ())):
        got = "none" if verdict.step_scores is None else len(verdict.step_scores)
        return f"{len(item.steps or ())} steps but {got} step scores"
    values = [verdict.score, *(verdict.step_scores or ())] if wanted else [verdict.score]
    for value in values:
        if isinstance(value, bool) or not isinstance(value, int | float):
            return f"a score is not a number ({value!r})"
        if not (math.isfinite(value) and low <= value <= high):
            return f"score {value!r} is not within the run's score_range [{low}, {high}]"
    return None


def default_scorer_id() -> str:
    return f"{os.uname().nodename}-{os.getpid()}"


def run_scorer(config: ScorerConfig, *, orchestrator_url: str, token: str, scorer_id: str) -> ScorerCounts:
    """`decentrl scorer`: build the backend `[scorer] type` names and score until SIGTERM."""
    backend = build_scorer_backend(config)
    client = OrchestratorClient(orchestrator_url, token)
    return Scorer(config, scorer_id=scorer_id, client=client, backend=backend).run()
