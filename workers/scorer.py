"""The scorer loop (`decentrl scorer`, `run_scorer`): lease samples, score them with the backend,
post the scores (docs/rewards_backends.md). So that the backend never waits for HTTP, one thread
leases ahead, one checks and posts, one renews every lease held. A verdict that fails its check is
posted as `failure = "parse"`, never a silent 0; a transient one is not posted. A backend that
raises stops the scorer; the leases it held expire. An orchestrator unreachable (or answering 503
from a proxy) past the client's `max_wait_s` is waited out as a worker waits it out: leases asked
for, renewed and posted again after a backoff, until it answers or the scorer stops.
"""

from __future__ import annotations

import logging
import math
import signal
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from decentrl.api.client import InvalidAnswer, OrchestratorClient, OrchestratorError, Stopped
from decentrl.api.wire import ScoreAck, ScoreItem, ScoreLease, ScoreLeaseRequest, ScorePost, ScoreResult
from decentrl.backoff import backoff
from decentrl.config import ScorerConfig
from workers.lease_loop import LEASE_GONE, Renewals, answers, on_signals
from workers.scorers import ScoreBackend, Verdict, build_scorer_backend

log = logging.getLogger("decentrl.scorer")

# Errors that mean the orchestrator could not be heard from (unreachable, a proxy's 503, an answer
# rewritten on the way): asked again after a backoff, never a reason to stop.
PASSING = (ConnectionError, InvalidAnswer)


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
        self._halt = threading.Event()  # this run's: set on stop and when the run ends; cuts the asking waits short
        self._renewals = self._new_renewals()
        self._scored = 0  # leases scored over every run: `counts.leases - _scored` are in hand

    def _new_renewals(self) -> Renewals:
        return Renewals(lambda lease_id: self.client.renew_score_lease(lease_id, self.scorer_id).deadline,
                        failed=self.request_stop, passing=PASSING)

    def request_stop(self, *_: object) -> None:
        """SIGTERM/SIGINT: the leases in hand (even one answered after the stop) are scored and
        posted, then `run` returns; a request that fails from now on is not retried (scores not
        posted are lost: their samples are leased again)."""
        self.stopping = True
        self._halt.set()
        self.client.stop()

    def run(self, max_leases: int | None = None) -> ScorerCounts:
        """Lease, score and post until stopped (or `max_leases` leases, counted over every run)."""
        on_signals(self.request_stop, signal.SIGTERM, signal.SIGINT)
        self._halt, self._renewals, self._scored = threading.Event(), self._new_renewals(), self.counts.leases
        if self.stopping:
            self._halt.set()
        renewer = threading.Thread(target=self._renewals.run, name="score-renew", daemon=True)
        renewer.start()
        asking = ThreadPoolExecutor(1, thread_name_prefix="score-fetch")  # one at a time: answered in order
        posting = ThreadPoolExecutor(1, thread_name_prefix="score-post")
        try:
            # The next lease to score and `leases_ahead` beyond it, asked for (or answered) already.
            asked = deque(asking.submit(self._next_lease, max_leases) for _ in range(self.config.leases_ahead + 1))
            posts: deque[Future[None]] = deque()  # in order: one post thread finishes them first to last
            while (lease := asked.popleft().result()) is not None:  # None: stopped, or max_leases reached
                verdicts = self.backend.score(lease.items)
                self._scored += 1
                asked.append(asking.submit(self._next_lease, max_leases))
                while posts and posts[0].done():
                    posts.popleft().result()  # a post that failed stops the scorer
                posts.append(posting.submit(self.post, lease, verdicts))
            for future in posts:
                future.result()
            if self._renewals.error is not None and not isinstance(self._renewals.error, Stopped):
                raise self._renewals.error
        finally:
            self._halt.set()
            asking.shutdown(cancel_futures=True)
            posting.shutdown()
            self._renewals.close()
            renewer.join()
        log.info("scorer %s stopping: %s", self.scorer_id, self.counts)
        return self.counts

    def _next_lease(self, max_leases: int | None) -> ScoreLease | None:
        """The asking thread: the next lease with items, renewed from now on; None once stopped
        or `max_leases` were leased."""

        def ask() -> ScoreLease | None:
            if max_leases is not None and self.counts.leases >= max_leases:
                return None
            ahead = self.counts.leases > self._scored
            return self.client.score_lease(ScoreLeaseRequest(scorer_id=self.scorer_id, max_items=self.config.max_items, ahead=ahead))

        for lease in answers(ask, stop=self._halt, passing=PASSING):
            if lease is None:
                return None
            if lease.items:
                self.counts.leases += 1
                self._renewals.hold(lease.lease_id, lease.deadline)
                return lease
            self._halt.wait(max(lease.retry_after_s, self.config.min_wait_s))
        return None

    def post(self, lease: ScoreLease, verdicts: list[Verdict]) -> None:
        """The post thread: check the verdicts and post them, then let the lease go."""
        try:
            low, high = lease.score_range
            results = []
            for item, verdict in zip(lease.items, verdicts, strict=True):
                self.counts.parse_retries += verdict.retries
                if verdict.transient:
                    log.warning("sample %s not scored (%s); it is leased again", item.rollout_id, verdict.error)
                    self.counts.transient += 1
                    continue
                result = checked(item, verdict, low, high)
                if result is None:  # a partial step the judge could not read: leased again after expiry
                    self.counts.transient += 1
                    continue
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
                ack = self._post_scores(post)
            except Stopped:
                log.warning("scores of lease %s not posted: the scorer stops; its samples are leased again", lease.lease_id)
                self.counts.lost += len(results)
                return
            except OrchestratorError as exc:
                if exc.status not in LEASE_GONE:
                    raise
                log.warning("scores of lease %s refused (%s): its samples were leased again", lease.lease_id, exc)
                self.counts.lost += len(results)
                return
            self.counts.scored += sum(result.failure is None for result in results)
            self.counts.duplicates += ack.duplicates
        finally:
            self._renewals.let_go(lease.lease_id)

    def _post_scores(self, post: ScorePost) -> ScoreAck:
        """Post, again after a backoff while the orchestrator cannot be heard from (the lease is
        renewed meanwhile; one that ran out is answered gone). Stopped once the scorer stops."""
        failures = 0
        while True:
            try:
                return self.client.post_scores(post)
            except Stopped:
                raise
            except PASSING as exc:
                failures += 1
                delay = backoff(failures)
                log.warning("scores of lease %s not posted (%s); posting again in %.1fs", post.lease_id, exc, delay)
                if self._halt.wait(delay):
                    raise Stopped(f"scorer stopping with the scores of lease {post.lease_id} not posted") from exc


def checked(item: ScoreItem, verdict: Verdict, low: float, high: float) -> ScoreResult | None:
    """The result to post for a verdict: its score, or a parse failure saying (in the log) why;
    None for a partial step without a readable score (a step's verdict is never a failure)."""
    problem = verdict_problem(item, verdict, low, high)
    if problem is not None and item.step is not None:
        log.warning("sample %s step %d: %s; not posted", item.rollout_id, item.step, problem)
        return None
    if problem is not None:
        log.warning("sample %s: %s; posted as a parse failure", item.rollout_id, problem)
        return ScoreResult(rollout_id=item.rollout_id, score=None, failure="parse")
    assert verdict.score is not None  # verdict_problem said so
    if item.step is not None:  # a partial step's verdict: its score alone
        return ScoreResult(rollout_id=item.rollout_id, score=float(verdict.score), step=item.step)
    steps = None if item.steps is None else [float(value) for value in verdict.step_scores or ()]
    logprobs = None if item.completion_token_ids is None else [float(value) for value in verdict.token_logprobs or ()]
    return ScoreResult(rollout_id=item.rollout_id, score=float(verdict.score), step_scores=steps, token_logprobs=logprobs)


def verdict_problem(item: ScoreItem, verdict: Verdict, low: float, high: float) -> str | None:
    """Why a verdict cannot be posted as a score, or None. Step scores of an item without steps
    (token log-probs of an item without token ids) are not wanted and are left out, not a problem."""
    if verdict.score is None:
        return verdict.error or "the backend gave no score"
    if item.completion_token_ids is not None:
        logprobs = verdict.token_logprobs
        if logprobs is None or len(logprobs) != len(item.completion_token_ids):
            return f"{len(item.completion_token_ids)} completion tokens but {'none' if logprobs is None else len(logprobs)} token log-probs"
        if not all(isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and v <= 0 for v in logprobs):
            return "a token log-prob is not a finite number <= 0"
    steps = verdict.step_scores if item.steps is not None and item.step is None else []  # a partial step: its score alone
    if steps is None or len(steps) != (len(item.steps or ()) if item.step is None else 0):
        return f"{len(item.steps or ())} steps but {'none' if steps is None else len(steps)} step scores"
    for value in [verdict.score, *steps]:
        if isinstance(value, bool) or not isinstance(value, int | float):
            return f"a score is not a number ({value!r})"
        if not (math.isfinite(value) and low <= value <= high):
            return f"score {value!r} is not within the run's score_range [{low}, {high}]"
    return None


def run_scorer(config: ScorerConfig, *, orchestrator_url: str, token: str, scorer_id: str) -> ScorerCounts:
    """`decentrl scorer`: build the backend `[scorer] type` names and score until SIGTERM."""
    client = OrchestratorClient(orchestrator_url, token)
    backend = build_scorer_backend(config, run=client.info() if config.type == "teacher" else None)
    return Scorer(config, scorer_id=scorer_id, client=client, backend=backend).run()
