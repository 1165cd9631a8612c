"""The one door to the worker's backend (workers/worker.py): generation batched across its slots
(flat combining, docs/workers.md "Slots and batched generation") and the soft pause of a swap.

Invariants: rows in one call share their tokens left and sampling; first come, first served; a
backend error ends the requests of its batch, raised in each slot; generation and weight swaps
never overlap. Deterministic runs: a round takes requests of one version only, every call has
`fixed_rows` rows, and rows of an `abandoned` group leave the queue before their round.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from decentrl.api.wire import SamplingParams
from workers.backends import Backend
from workers.sample import Sample


@dataclass(eq=False)
class Request:
    """One slot's unfinished rows."""

    rows: list[Sample]
    sampling: SamplingParams
    version: int | None = None  # deterministic runs: the version every row must be sampled under
    done: bool = False  # generated this round (each row finished or was interrupted by a swap)
    error: BaseException | None = None

    def raise_error(self) -> None:
        if self.error is not None:
            raise self.error


@dataclass(frozen=True)
class Call:
    """One backend call: `rows` share their tokens left and sampling; `filler` rows (deterministic
    runs) are repeats of `rows` that bring the call to its fixed shape, generated and discarded."""

    left: int
    sampling: SamplingParams
    rows: list[Sample]
    filler: int = 0

    def prompts(self) -> list[list[int]]:
        prompts = [s.prompt + s.token_ids for s in self.rows]
        return prompts + [prompts[i % len(prompts)] for i in range(self.filler)]

    def seeds(self) -> list[int | None]:
        seeds = [s.seed for s in self.rows]
        return seeds + [seeds[i % len(seeds)] for i in range(self.filler)]


class Batcher:
    def __init__(
        self,
        *,
        max_rows: int,
        fixed_rows: int | None = None,
        abandoned: Callable[[str], bool] = lambda group: False,
        combine: bool = True,
    ) -> None:
        if max_rows < 1:
            raise ValueError(f"max_batch_rows must be at least 1 (got {max_rows}): it caps the rows generated at once")
        self.max_rows = max_rows
        # Deterministic runs: the rows of every call (whole groups + filler); None: a group per call.
        self.fixed_rows = fixed_rows
        self.abandoned = abandoned  # whether a group (a lease id) is no longer wanted
        self.combine = combine  # False: the backend batches concurrent calls itself
        self._queue: deque[Request] = deque()
        # Guards the queue, every request's `done`, `_rounds` and `paused`; notified when any changes.
        self._changed = threading.Condition()
        self._rounds = 0  # rounds generating now: at most one when combining
        self.paused = False  # a swap waits for the rounds running, or runs: no round starts
        self._deadline: float | None = None  # time.monotonic() after which the rounds running are interrupted
        self._waiting = 0  # slots waiting for a round to start (in `lead` or `round_of_its_own`)

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
        """Block until `request` is done (False) or a round may start (True: the caller calls
        `generate_next`, then `lead` again): no swap is due and, when combining, no round runs."""
        with self._changed:
            self._waiting += 1
            while not request.done and (self.paused or (self.combine and self._rounds)):
                self._changed.wait()
            self._waiting -= 1
            if not request.done:
                self._drop_abandoned()
            if request.done:
                return False
            self._rounds += 1
            return True

    @contextmanager
    def round_of_its_own(self) -> Iterator[None]:
        """A round generated outside the queue (a tree lease, workers/tree.py): it starts once no
        swap is due and no other round runs, and a swap waits for its end (it is never cut at the
        swap's deadline: a tree's branches keep their prefix's weights)."""
        with self._changed:
            self._waiting += 1
            while self.paused or self._rounds:
                self._changed.wait()
            self._waiting -= 1
            self._rounds += 1
        try:
            yield
        finally:
            with self._changed:
                self._rounds -= 1
                self._changed.notify_all()

    def wanted(self) -> bool:
        """Whether a swap or another slot waits for the rounds running to end: a round of its own
        that could go on (a tree round across lease answers) ends instead."""
        with self._changed:
            return self.paused or self._waiting > 0

    @contextmanager
    def swapping(self, deadline_s: float) -> Iterator[None]:
        """A weight swap's soft pause: the block runs once no round runs; until then none starts,
        and those running are interrupted `deadline_s` from now. One swapper: swaps never nest."""
        with self._changed:
            self.paused, self._deadline = True, time.monotonic() + deadline_s
            while self._rounds:
                self._changed.wait()
        try:
            yield
        finally:
            with self._changed:
                self.paused, self._deadline = False, None
                self._changed.notify_all()

    def pause_due(self) -> bool:
        """Whether a swap's deadline has passed: the backend stops the rows in flight."""
        deadline = self._deadline
        return deadline is not None and time.monotonic() >= deadline

    def _drop_abandoned(self) -> None:
        """(Under `_changed`.) Rows of abandoned groups leave the queue; a request left empty is done."""
        queue, emptied = deque[Request](), False
        for request in self._queue:
            request.rows = [row for row in request.rows if row.group is None or not self.abandoned(row.group)]
            if request.rows:
                queue.append(request)
            else:
                request.done = emptied = True
        self._queue = queue
        if emptied:
            self._changed.notify_all()

    def fail_next(self, error: BaseException) -> None:
        """The next round's version cannot be loaded: its queued requests end with `error`."""
        with self._changed:
            version = self._queue[0].version
            failed = [request for request in self._queue if request.version == version]
            self._queue = deque(request for request in self._queue if request.version != version)
            for request in failed:
                request.error, request.done = error, True
            self._rounds -= 1
            self._changed.notify_all()

    def generate_next(
        self, backend: Backend, version: int, should_stop: Callable[[], bool] | None = None, own: Request | None = None
    ) -> None:
        """The lead's round: queued requests of the head's version (whole, first come first served, at
        least one) while they fit in `max_rows`, generated under `version`; none left (all abandoned):
        the round ends at once. Not combining, the round is the lead's `own` request alone."""
        with self._changed:
            self._drop_abandoned()
            if own is not None and not self.combine:
                queued = [own] if own in self._queue else []
            else:
                queued = [r for r in self._queue if r.version is None or r.version == version][: None if self.combine else 1]
            taken: list[Request] = []  # none (the head was abandoned): the round ends at once
            rows = 0
            for request in queued:
                if taken and request.version != taken[0].version:
                    continue
                if taken and rows + len(request.rows) > self.max_rows:
                    break  # full: this request and all behind it wait for the next round, in order
                taken.append(request)
                rows += len(request.rows)
            self._queue = deque(request for request in self._queue if request not in taken)
        try:
            for call in batches(taken, self.max_rows, self.fixed_rows):
                budget = call.sampling.model_copy(update={"max_tokens": call.left})
                seeded = {} if None in (seeds := call.seeds()) else {"seeds": seeds}  # only the hf backend takes seeds
                completions = backend.generate(call.prompts(), budget, should_stop or self.pause_due, **seeded)
                for sample, completion in zip(call.rows, completions[: len(call.rows)], strict=True):
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
                self._rounds -= 1
                self._changed.notify_all()


def batches(requests: list[Request], max_rows: int, fixed_rows: int | None = None) -> list[Call]:
    """The backend calls for `requests`: rows grouped by tokens left and sampling, in order of
    first appearance, cut into chunks of at most `max_rows` rows. Rows that name their group
    (deterministic runs): grouped by prompt length too, in calls of whole groups (`fixed_shape`)."""
    keyed: dict[tuple[int, str, int | None], tuple[SamplingParams, list[Sample]]] = {}
    for request in requests:
        key = request.sampling.model_dump_json()
        for sample in request.rows:
            left = sample.budget - len(sample.token_ids)
            width = None if sample.group is None else len(sample.prompt) + len(sample.token_ids)
            keyed.setdefault((left, key, width), (request.sampling, []))[1].append(sample)
    calls: list[Call] = []
    for (left, _, width), (sampling, rows) in keyed.items():
        if width is None:
            calls += [Call(left, sampling, rows[start : start + max_rows]) for start in range(0, len(rows), max_rows)]
        else:
            for chunk in fixed_shape(rows, fixed_rows):
                calls.append(Call(left, sampling, chunk, (fixed_rows or len(chunk)) - len(chunk)))
    return calls


def fixed_shape(rows: list[Sample], fixed_rows: int | None) -> list[list[Sample]]:
    """`rows` cut into chunks of whole groups (a group never sees two shapes), as many as fit in
    `fixed_rows` rows (None: one group per chunk)."""
    groups: dict[str | None, list[Sample]] = {}
    for sample in rows:
        groups.setdefault(sample.group, []).append(sample)
    chunks: list[list[Sample]] = [[]]
    for group in groups.values():
        if fixed_rows is not None and len(group) > fixed_rows:
            raise ValueError(f"a group of {len(group)} rows does not fit a fixed shape of {fixed_rows} rows")
        if chunks[-1] and (fixed_rows is None or len(chunks[-1]) + len(group) > fixed_rows):
            chunks.append([])
        chunks[-1] += group
    return chunks
