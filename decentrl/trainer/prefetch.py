"""Rank 0's batch source: fetches the next step's batch while the current step trains.

Without it the trainer sat idle for the orchestrator's long-poll, the transfer, the decoding and
the journaling of every batch: 0.01-0.75 s of 0.5-0.8 s steps in benchmarks/async_vs_sync.py
(docs/benchmarks.md). As soon as step s's
batch is taken, a background thread asks for step s+1's (`trainer_version = s`) and journals it.
Freshness is unchanged: the orchestrator checks it against `trainer_version = s`, the weights step
s+1 starts from, whenever the request arrives. With `max_staleness = 0` nothing of version s exists
before the trainer publishes it, so the request simply waits, as it would have. A batch journaled
ahead of its step is replayed after a crash like any other journaled batch. Called by the
training loop (decentrl/trainer/train.py).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future

from decentrl.api.wire import TrainBatch


class BatchPrefetcher:
    def __init__(self, fetch: Callable[[int], TrainBatch], last_step: int) -> None:
        """`fetch(step)` returns (and journals) step `step`'s batch; none is fetched past `last_step`."""
        self._fetch = fetch
        self._last_step = last_step
        self._pending: tuple[int, Future[TrainBatch]] | None = None

    def take(self, step: int, wait_s: float | None = None) -> TrainBatch | None:
        """Step `step`'s batch (waiting for it if it is still on its way, at most `wait_s`: then
        None, and the fetch goes on); starts fetching the next."""
        if self._pending is None or self._pending[0] != step:
            self._start(step)
        assert self._pending is not None
        try:
            batch = self._pending[1].result(timeout=wait_s)  # a failed fetch raises here, in the training loop
        except TimeoutError:
            return None
        self._pending = None
        if step < self._last_step:
            self._start(step + 1)
        return batch

    def _start(self, step: int) -> None:
        future: Future[TrainBatch] = Future()

        def run() -> None:
            try:
                future.set_result(self._fetch(step))
            except BaseException as exc:  # handed to the loop by take()
                future.set_exception(exc)

        # A daemon thread: a trainer stopping on an error does not wait out a long-poll.
        threading.Thread(target=run, name=f"batch-prefetch-{step}", daemon=True).start()
        self._pending = (step, future)
