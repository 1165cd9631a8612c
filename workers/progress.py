"""A worker's own progress, logged as one line every `interval_s`: the newest version it
generated with, rollouts accepted, completion tokens a second, rejections by reason, and (hedged
deterministic runs) the copies it abandoned because another copy of their place won.

`Worker._send` (workers/worker.py) calls `posted` after each acknowledged post; the line goes to
the worker's log (stderr of `decentrl worker`, logs/worker-N.log under `decentrl run`), so a
volunteer sees their contribution without opening the orchestrator's dashboard.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable

from decentrl.api.wire import IngestResponse, RolloutBatch

log = logging.getLogger("decentrl.worker.progress")


class Progress:
    def __init__(self, interval_s: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval_s = interval_s
        self.clock = clock
        self.accepted = 0
        self.tokens = 0
        self.version = -1
        self.rejected: Counter[str] = Counter()
        self.abandoned = 0  # hedging: leases not posted, another copy of their place filled it first
        self._mark = (clock(), 0)  # (time, tokens) at the last line

    def posted(self, batch: RolloutBatch, result: IngestResponse) -> None:
        self.accepted += result.accepted
        self.rejected.update(rejection.reason for rejection in result.rejected)
        self.tokens += sum(len(rollout.completion_token_ids) for rollout in batch.rollouts)
        self.version = max(self.version, *(rollout.policy_version for rollout in batch.rollouts))
        now = self.clock()
        if now - self._mark[0] >= self.interval_s:
            log.info("%s", self.line(now))
            self._mark = (now, self.tokens)

    def line(self, now: float) -> str:
        rate = (self.tokens - self._mark[1]) / max(now - self._mark[0], 1e-9)
        rejected = ", ".join(f"{reason} {count}" for reason, count in sorted(self.rejected.items())) or "none"
        abandoned = f"  lost copies abandoned {self.abandoned}" if self.abandoned else ""
        return f"progress: v{self.version}  rollouts accepted {self.accepted}  {rate:.0f} tokens/s  rejected: {rejected}{abandoned}"
