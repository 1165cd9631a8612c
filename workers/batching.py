"""Generation batched across a worker's slots (flat combining).

Called by the worker loop (workers/worker.py `_complete`). Each slot queues its unfinished rows
(prompt + tokens so far, budget left, sampling) as a request; one slot at a time leads: it takes
the queued requests of every slot (up to `max_rows` rows), runs them as few backend calls as
their budgets and sampling allow, hands each completion back to its sample, and wakes the
slots whose requests are done. A slot whose request is still queued when the lead finishes
leads the next round. So N slots with one group each cost one batched decode instead of N
sequential ones, and the rows in memory at once stay bounded by `max_rows`.

Invariants: rows in one backend call share their tokens left (no row can exceed its budget) and
their sampling parameters; requests are served first come, first served; a backend error ends
the requests of the batch it hit, and each of their slots raises it.

Deterministic runs (docs/reproducibility.md): a request names the version its rows must be
sampled under, and a round takes only requests of the version at the head of the queue (the
lead loads it first: `next_version`); rows carry their own seeds, and each group's rows are one
backend call of their own, so a row's logits and tokens do not depend on what else was queued.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from decentrl.wire import SamplingParams
from workers.backends import Backend
from workers.sample import Sample


@dataclass(eq=False)
class Request:
    """One slot's unfinished rows for one round of generation."""

    rows: list[Sample]
    sampling: SamplingParams
    version: int | None = None  # deterministic runs: the version every row must be sampled under
    done: bool = False  # generated this round (each row finished or was interrupted by a swap)
    error: BaseException | None = None

    def raise_error(self) -> None:
        if self.error is not None:
            raise self.error


class Batcher:
    def __init__(self, *, max_rows: int) -> None:
        if max_rows < 1:
            raise ValueError(f"max_batch_rows must be at least 1 (got {max_rows}): it caps the rows generated at once")
        self.max_rows = max_rows
        self._queue: deque[Request] = deque()
        self._changed = threading.Condition()  # guards the queue, `_leading` and every request's `done`
        self._leading = False

    def submit(self, rows: list[Sample], sampling: SamplingParams, version: int | None = None) -> Request:
        request = Request(rows, sampling, version)
        with self._changed:
            self._queue.append(request)
        return request

    def next_version(self) -> int | None:
        """The version the lead's next round samples under (deterministic runs), None: any."""
        with self._changed:
            return self._queue[0].version

    def lead(self, request: Request) -> bool:
        """Block until `request` is done (False) or no slot leads and it is not done (True:
        the caller leads the next round, calls `generate_next`, then `lead` again)."""
        with self._changed:
            while not request.done and self._leading:
                self._changed.wait()
            if request.done:
                return False
            self._leading = True
            return True

    def fail_next(self, error: BaseException) -> None:
        """The lead cannot serve the next round (deterministic runs: its version cannot be
        loaded): every queued request of that version ends with `error`, and the lead passes on."""
        with self._changed:
            version = self._queue[0].version
            failed = [request for request in self._queue if request.version == version]
            self._queue = deque(request for request in self._queue if request.version != version)
            for request in failed:
                request.error, request.done = error, True
            self._leading = False
            self._changed.notify_all()

    def generate_next(self, backend: Backend, version: int, should_stop: Callable[[], bool]) -> None:
        """The lead's round: take queued requests (whole, first come first served, at least
        one) while they fit in `max_rows`, generate them with `backend` (whose weights are
        `version`: the caller holds the lock that excludes swaps), and mark them done. Only
        requests of the head's version (deterministic runs) join it."""
        with self._changed:
            taken = [self._queue.popleft()]
            rows = len(taken[0].rows)
            while (
                self._queue
                and rows + len(self._queue[0].rows) <= self.max_rows
                and self._queue[0].version == taken[0].version
            ):
                rows += len(self._queue[0].rows)
                taken.append(self._queue.popleft())
        try:
            for (left, sampling), group in batches(taken, self.max_rows):
                budget = sampling.model_copy(update={"max_tokens": left})
                prompts = [s.prompt + s.token_ids for s in group]
                seeds = [s.seed for s in group]
                completions = (
                    backend.generate(prompts, budget, should_stop)
                    if None in seeds
                    else backend.generate(prompts, budget, should_stop, seeds=seeds)  # type: ignore[call-arg]
                )
                for sample, completion in zip(group, completions, strict=True):
                    sample.extend_routes(completion.routes)
                    sample.extend(
                        completion.token_ids, completion.logprobs, [version] * len(completion.token_ids),
                        completion.sampling_mask,
                    )
                    if completion.finish_reason != "interrupted":
                        sample.finish_reason = completion.finish_reason
        except BaseException as exc:
            for request in taken:
                request.error = exc
            raise
        finally:
            with self._changed:
                for request in taken:
                    request.done = True
                self._leading = False
                self._changed.notify_all()


def batches(requests: list[Request], max_rows: int) -> list[tuple[tuple[int, SamplingParams], list[Sample]]]:
    """The backend calls for `requests`: rows grouped by (tokens left, sampling, and in
    deterministic runs their group), in order of first appearance, each cut into chunks of at
    most `max_rows` rows."""
    groups: dict[tuple[int, str, str | None], tuple[SamplingParams, list[Sample]]] = {}
    for request in requests:
        key = request.sampling.model_dump_json()
        for sample in request.rows:
            left = sample.budget - len(sample.token_ids)
            groups.setdefault((left, key, sample.group), (request.sampling, []))[1].append(sample)
    return [
        ((left, sampling), rows[start : start + max_rows])
        for (left, _, _), (sampling, rows) in groups.items()
        for start in range(0, len(rows), max_rows)
    ]
