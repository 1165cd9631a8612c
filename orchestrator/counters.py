"""Where the run stands: the policy versions it knows and the counters it reports.

RunState makes one `Versions` and one `Counters` and hands the same objects to the parts that read
or bump them. Both are journaled in the meta row, so /v1/status and /metrics agree across a restart.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field

RECENT_REWARDS = 512  # rewards served lately, for the status page's running mean (not journaled)


@dataclass
class Versions:
    published: int | None = None  # newest version complete in the store; None until version 0 is
    trainer: int = 0  # the version the trainer holds: its next step starts from it
    consumed: int = 0  # a run of two policies: units this stream's trainer took (its lease budget's "done")


@dataclass
class Tally:
    """Samples, their completion tokens and, where known, their rewards: what the staleness rule
    dropped since the last batch, to report against what the batch trains (the length bias)."""

    samples: int = 0
    tokens: int = 0
    rewarded: int = 0
    reward: float = 0.0

    def add(self, lengths: list[int], rewards: list[float] | None) -> None:
        self.samples += len(lengths)
        self.tokens += sum(lengths)
        if rewards is not None:
            self.rewarded += len(rewards)
            self.reward += sum(rewards)


@dataclass
class Counters:
    rollouts_accepted: int = 0
    tokens_accepted: int = 0  # prompt + completion tokens of the rollouts accepted
    duplicates: int = 0  # resends of rollout ids already acknowledged (counted once)
    rejected: Counter[str] = field(default_factory=Counter)  # rollouts refused at ingest, per reason
    dropped: Counter[str] = field(default_factory=Counter)  # accepted samples dropped later, per reason
    stale_dropped: int = 0  # samples dropped as stale, at ingest or in the buffer
    groups_served: int = 0
    groups_skipped: int = 0  # dynamic sampling: groups a step consumed and dropped (zero_signal, surplus)
    leases_expired: int = 0
    # Hedging (orchestrator/lease_policy.py); the /metrics help says what each counts.
    hedged_leases: int = 0
    hedge_duplicates: int = 0
    hedge_mismatches: int = 0
    hedge_copies_told: int = 0
    recoveries: int = 0  # times the state was rebuilt from the journal
    recent_rewards: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT_REWARDS))
    stale_since_batch: Tally = field(default_factory=Tally)  # not journaled: a restart starts it again

    @property
    def groups_consumed(self) -> int:
        """Complete groups the steps so far took from the front of the line, trained or not: the
        next place a deterministic run serves, and what the lease budget counts as done."""
        return self.groups_served + self.groups_skipped

