"""Prometheus metrics of one orchestrator app (GET /metrics, text format 0.0.4).

Every app has its own CollectorRegistry (tests create many apps in one process). The run's
counters are read from RunState at scrape time, so they agree with /v1/status; per-worker series
are labelled by token name, never a client-picked worker id, so the tokens file bounds them.
"""

from __future__ import annotations

from collections.abc import Iterator

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from decentrl.tasks.guard import reward_failures
from orchestrator.score_queue import COUNTS
from orchestrator.state import RunState

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


# The score queue's COUNTS, each exported as decentrl_<name>_total.
SCORING_HELP = {
    "scores_posted": "Scores taken from scorers (duplicates not counted).",
    "scores_duplicate": "Scores posted again for samples already scored.",
    "scores_reassigned": "Samples whose score lease expired unanswered, leased again.",
    "score_leases_expired": "Score leases that expired before every item was scored.",
    "judge_parse_failures": "Samples a scorer could not score: the judge's reply did not parse after its retries.",
    "judge_parse_retries": "Judge replies that did not parse and were asked again, as scorers report them.",
    "steps_scored": "Verdicts taken on partial steps of samples still being generated (tree units).",
}


class StateCollector(Collector):
    """The run's own counters and gauges, read from RunState when Prometheus scrapes."""

    def __init__(self, state: RunState) -> None:
        self.state = state

    def collect(self) -> Iterator[Metric]:
        s, c = self.state, self.state.counters
        for name, help_text, value in (
            ("rollouts_accepted", "Rollouts acknowledged (journaled) since the run began.", c.rollouts_accepted),
            ("ingest_tokens", "Prompt + completion tokens of acknowledged rollouts.", c.tokens_accepted),
            ("rollouts_duplicate", "Resends of rollouts already acknowledged (counted once).", c.duplicates),
            ("stale_dropped", "Samples dropped as stale (ingest or buffer).", c.stale_dropped),
            ("lease_expirations", "Leases that expired unanswered.", c.leases_expired),
            ("hedged_leases", "Deterministic runs: second leases of a lagging place of the next batch.", c.hedged_leases),
            ("hedge_duplicates", "Samples of a hedge's losing copy posted after its place was filled.", c.hedge_duplicates),
            ("hedge_mismatches", "Of those, samples not bit for bit the winner's.", c.hedge_mismatches),
            ("hedge_copies_told", "Losing copies their holders were told of, to stop generating them.", c.hedge_copies_told),
            ("groups_served", "Groups served to the trainer.", c.groups_served),
            ("groups_skipped", "Dynamic sampling: groups a step consumed and did not train (no signal, or surplus).", c.groups_skipped),
        ):
            yield CounterMetricFamily(f"decentrl_{name}", help_text, value=value)
        for name, help_text, label, counts in (
            ("rollouts_rejected", "Rollouts rejected at ingest, by reason.", "reason", c.rejected),
            ("samples_dropped", "Acknowledged samples dropped later, by reason.", "reason", c.dropped),
            ("reward_failures", "Reward calls that failed and scored 0 (reward guard), by kind.", "kind", reward_failures(s.task)),
        ):
            family = CounterMetricFamily(f"decentrl_{name}", help_text, labels=[label])
            for key, count in sorted(counts.items()):
                family.add_metric([key], count)
            yield family
        gauges = [
            ("buffer_groups", "Complete groups waiting for the trainer.", len(s.ready)),
            ("buffer_limit", "Depth bound: ready groups plus open leases.", s.buffer_limit),
            ("leases_open", "Leases granted and not yet answered.", len(s.leases)),
            ("policy_version", "Newest published version (-1 before version 0).",
             -1 if s.published_version is None else s.published_version),
            ("trainer_version", "Version the trainer holds.", s.trainer_version),
            ("recoveries", "Times this run's state was recovered from the journal.", c.recoveries),
        ]
        if s.scores():
            scoring = s.score_queue.summary()
            gauges += [
                ("scores_waiting", "Samples of complete groups not yet scored.", scoring["waiting"]),
                ("scores_leased", "Of those, samples leased to a scorer now.", scoring["leased"]),
                ("groups_scoring", "Complete groups pending for their scores.", s.buffer.pending_for("scores")),
            ]
            for name in COUNTS:
                yield CounterMetricFamily(f"decentrl_{name}", SCORING_HELP[name], value=scoring[name])
        for name, help_text, value in gauges:
            yield GaugeMetricFamily(f"decentrl_{name}", help_text, value=value)


class Metrics:
    def __init__(self, state: RunState) -> None:
        self.registry = r = CollectorRegistry(auto_describe=True)
        r.register(StateCollector(state))
        self.requests = Counter(
            "decentrl_http_requests", "HTTP requests answered, by route and status.", ["route", "method", "status"], registry=r
        )
        self.latency = Histogram(
            "decentrl_http_request_seconds", "Time to answer, by route.", ["route"], buckets=LATENCY_BUCKETS, registry=r
        )
        self.worker_rollouts = Counter(
            "decentrl_worker_rollouts", "Rollouts posted per token, by outcome.", ["token", "outcome"], registry=r
        )
        self.rate_limited = Counter("decentrl_rate_limited", "Requests answered 429, per token.", ["token"], registry=r)
        self.backpressure = Counter("decentrl_backpressure", "Requests answered 503 to shed load, by reason.", ["reason"], registry=r)
        self.staleness = Histogram(
            "decentrl_served_staleness_versions", "Staleness (trainer version - policy version) of every sample served to the trainer.",
            buckets=(0, 1, 2, 3, 4, 6, 8, 16, 32), registry=r,
        )
        self.journal_commit = Histogram(
            "decentrl_journal_commit_seconds", "Time of one journal transaction (group commit, fsync included).",
            buckets=LATENCY_BUCKETS, registry=r,
        )
        self.journal_statements = Counter("decentrl_journal_statements", "Statements committed to the journal.", registry=r)
        self.journal_failed = Gauge("decentrl_journal_failed", "1 once a journal commit failed (restart to recover).", registry=r)

    def on_commit(self, seconds: float, statements: int) -> None:
        self.journal_commit.observe(seconds)
        self.journal_statements.inc(statements)

    def render(self) -> bytes:
        return generate_latest(self.registry)


METRICS = web.AppKey("metrics", Metrics)  # set by create_app
