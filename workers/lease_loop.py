"""The client side of a lease, shared by the worker and the scorer: ask (`answers`; how many groups
a worker asks for, `RequestSize`), hold (`Renewals`: every lease held is renewed until let go, so
a long generation or a slow machine loses nothing; a holder that dies stops renewing and its
leases expire), post (`Spool`, the worker only: a scorer's posts die with their lease).
"""

from __future__ import annotations

import contextlib
import glob
import logging
import os
import signal
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from decentrl.api.client import OrchestratorError, Stopped
from decentrl.api.wire import RolloutBatch
from decentrl.backoff import backoff

log = logging.getLogger("decentrl.lease_loop")
A = TypeVar("A")
LEASE_GONE = (403, 404, 409)  # the lease expired, was closed, or is held by another
MIN_RENEW_S = 0.5
RENEWALS_AT_ONCE = 8  # renewals in flight together: a round costs about one round trip, not one per lease
REQUEST_SHARE = 0.5  # a request's groups take at most this share of the lease timeout (RequestSize)
SIZE_WINDOW = 16  # the requests a worker's request size is estimated from


def default_id() -> str:
    return f"{os.uname().nodename}-{os.getpid()}"


def on_signals(handler: Callable[..., object], *signals: signal.Signals) -> None:
    """Call `handler` on `signals`; outside the main thread nothing is installed (Python forbids it)."""
    if threading.current_thread() is threading.main_thread():
        for number in signals:
            signal.signal(number, handler)


def answers(ask: Callable[[], A], *, stop: threading.Event, passing: tuple[type[Exception], ...] = ()) -> Iterator[A]:
    """The answers to `ask` until `stop` is set (or the client stopped: Stopped); an error in
    `passing` is logged and asked again after a backoff (cut short by `stop`), any other propagates."""
    failures = 0
    while not stop.is_set():
        try:
            answer = ask()
        except Stopped:
            return
        except passing as exc:
            failures += 1
            delay = backoff(failures)
            log.warning("lease request failed (%s); asking again in %.1fs", exc, delay)
            stop.wait(delay)
            continue
        failures = 0
        yield answer


class RequestSize:
    """How many groups a worker asks for in a lease request (`LeaseRequest.max_groups`): at most
    `most` ([worker] groups_per_request), and no more than it generates in `target_s` (REQUEST_SHARE
    of the lease timeout) at what each group adds to a request's time. A slow worker then holds few
    prompts at a time, so the groups it takes are not held back long while faster workers wait.

    A request takes a fixed part (a decode's sequential steps, set-up) plus a part per group; only
    the part per group shrinks with fewer groups, so only it is held to the target:
    max_groups = clamp(floor(target_s / seconds per group), 1, most). Seconds per group is the
    slope of request time over groups across the last SIZE_WINDOW requests that differ in size;
    while they all had one size, their mean time per group (as if nothing were fixed: an upper
    bound), the request shrinking by at most half so that the next one measures the slope. An
    engine whose time hardly grows with rows (a GPU decoding long completions) keeps asking for
    `most`; a CPU whose time grows with every row asks for what fits the target. The first request
    (a cold start: compilation, caches) is not counted. Shared by the slots (thread-safe)."""

    def __init__(self, *, most: int, target_s: float | None) -> None:
        self.most = most
        self.target_s = target_s  # None: the orchestrator did not say its lease timeout; always `most`
        self._lock = threading.Lock()
        self._seen: deque[tuple[int, float]] = deque(maxlen=SIZE_WINDOW)  # (groups, seconds) of recent requests
        self._cold = True  # the next request finished is the first: not counted
        self._groups = most

    def groups(self) -> int:
        with self._lock:
            return self._groups

    def finished(self, groups: int, seconds: float) -> None:
        """A request of `groups` groups took `seconds` to generate (leases abandoned: not called)."""
        with self._lock:
            if self._cold:
                self._cold = False
                return
            self._seen.append((groups, seconds))
            before, per_group = self._groups, per_group_s(list(self._seen))
            self._groups = self._size(per_group)
        if self._groups != before:
            log.info(
                "asking for %d groups a request (was %d): %.2fs a group, the target %.1fs (%.0f%% of the lease timeout)",
                self._groups, before, per_group or 0.0, self.target_s or 0.0, 100 * REQUEST_SHARE,
            )

    def per_group_s(self) -> float | None:
        """Seconds each group adds to a request, from the requests seen (None: none yet)."""
        with self._lock:
            return per_group_s(list(self._seen))

    def _size(self, per_group: float | None) -> int:
        if self.target_s is None or per_group is None:
            return self.most
        fits = self.most if per_group <= 0 else int(self.target_s / per_group)
        if len({g for g, _ in self._seen}) == 1:  # one size seen: shrink by half at most, to measure the slope
            fits = max(fits, (self._seen[-1][0] + 1) // 2)
        return min(max(fits, 1), self.most)


def per_group_s(seen: list[tuple[int, float]]) -> float | None:
    """What each group adds to a request's seconds, from (groups, seconds) of requests: the slope
    where their sizes differ, else the mean time per group (None: no request)."""
    if not seen:
        return None
    sizes = [g for g, _ in seen]
    if min(sizes) == max(sizes):
        return sum(t / g for g, t in seen) / len(seen)
    mean_g, mean_t = sum(sizes) / len(seen), sum(t for _, t in seen) / len(seen)
    slope = sum((g - mean_g) * (t - mean_t) for g, t in seen) / sum((g - mean_g) ** 2 for g in sizes)
    return min(max(slope, 0.0), max(t / g for g, t in seen))  # above every request's own rate: noise


class Renewals:
    """The leases held, each renewed at half the time left (room for clock skew and a slow answer)
    until let go, by one thread (`run`); the leases due together are renewed concurrently, at most
    RENEWALS_AT_ONCE at a time, so a round over a slow link costs about one round trip.

    `renew(lease_id)` answers the lease's new deadline (`clock` time), or None: not renewed now
    (its holder makes no progress; the lease may run out), asked again in MIN_RENEW_S. A lease gone
    (403/404/409) is let go and `gone(lease_id, error)` told. An error in `passing` is logged and
    the round tried again after a backoff, every lease still held (one that ran out meanwhile is
    found gone then). Any other error ends `run`: it is kept in `error` and `failed()` is called,
    so that the owner stops rather than generate on for leases nobody renews."""

    def __init__(
        self,
        renew: Callable[[str], float | None],
        *,
        failed: Callable[[], None],
        gone: Callable[[str, OrchestratorError], None] | None = None,
        passing: tuple[type[Exception], ...] = (),
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._renew = renew  # lease id -> its new deadline, or None: not renewed now
        self._failed = failed
        self._gone = gone or _leased_again
        self._passing = passing
        self._clock = clock
        self._changed = threading.Condition()  # guards `_due` and `_closed`; notified when either changes
        self._due: dict[str, float] = {}  # lease id -> when to renew it (`clock` time)
        self._closed = False
        self.error: Exception | None = None

    def hold(self, lease_id: str, deadline: float) -> None:
        with self._changed:
            self._due[lease_id] = self._renew_at(deadline)
            self._changed.notify_all()

    def let_go(self, lease_id: str) -> None:
        with self._changed:
            self._due.pop(lease_id, None)

    def _renew_at(self, deadline: float) -> float:
        now = self._clock()
        return now + max(MIN_RENEW_S, (deadline - now) / 2)

    def renew_due(self) -> float | None:
        """Renew every lease due now; when the next one is due (None: none held). The first error
        that is not a lease gone is raised once the round is over."""
        with self._changed:
            now = self._clock()
            due = [lease_id for lease_id, at in self._due.items() if at <= now]
        if len(due) > 1:
            with ThreadPoolExecutor(min(len(due), RENEWALS_AT_ONCE), thread_name_prefix="renew") as pool:
                errors = list(pool.map(self._renew_one, due))
        else:
            errors = [self._renew_one(lease_id) for lease_id in due]
        if raised := next((error for error in errors if error is not None), None):
            raise raised
        with self._changed:
            return min(self._due.values(), default=None)

    def _renew_one(self, lease_id: str) -> Exception | None:
        """Renew one lease; the error to raise for the round, if any."""
        try:
            deadline = self._renew(lease_id)
        except OrchestratorError as exc:
            if exc.status not in LEASE_GONE:
                return exc
            with self._changed:
                held = self._due.pop(lease_id, None) is not None
            if held:  # (not let go meanwhile: a lease posted and completed is no news)
                self._gone(lease_id, exc)
            return None
        except Exception as exc:  # noqa: BLE001 - handed to `run`, which retries it or ends and tells the owner
            return exc
        with self._changed:
            if lease_id in self._due:  # not let go meanwhile
                self._due[lease_id] = self._clock() + MIN_RENEW_S if deadline is None else self._renew_at(deadline)
        return None

    def run(self) -> None:
        failures, not_before = 0, 0.0  # after a passing error: no round before `not_before`, even when woken
        while True:
            if self._clock() >= not_before:
                try:
                    self.renew_due()
                    failures = 0
                except self._passing as exc:
                    failures += 1
                    delay = backoff(failures, cap_s=10.0)
                    log.warning("renewing leases failed (%s); trying again in %.1fs", exc, delay)
                    not_before = self._clock() + delay
                except Exception as exc:  # noqa: BLE001 - the thread ends; its owner is told, never silently
                    self.error = exc
                    self._failed()
                    return
            with self._changed:  # (a lease held since `renew_due` is in `_due` already)
                next_at = min(self._due.values(), default=None)
                if self._closed:
                    return
                wait = 60.0 if next_at is None else max(0.0, max(next_at, not_before) - self._clock())
                self._changed.wait(wait)

    def close(self) -> None:
        with self._changed:
            self._closed = True
            self._changed.notify_all()


def _leased_again(lease_id: str, error: OrchestratorError) -> None:
    log.warning("lease %s is no longer renewed (%s); it is leased again", lease_id, error.message)


class Spool:
    """Rollout batches on their way, in `directory`: each written before it is sent (never a half
    file) and removed once acknowledged. A ConnectionError from `send` leaves it spooled and
    `unsent` set; `resend` sends what waits, also after a restart (rollout ids make resends idempotent)."""

    def __init__(self, directory: str, send: Callable[[RolloutBatch], object]) -> None:
        self.directory = directory
        self._send = send
        self.unsent = False  # a send failed: batches wait here
        os.makedirs(directory, exist_ok=True)

    def post(self, batch: RolloutBatch) -> bool:
        """Spool `batch` and send it; False: it stays spooled."""
        # Named by creation time, so the oldest work is resent first.
        path = os.path.join(self.directory, f"{time.time_ns():020d}-{uuid.uuid4().hex[:8]}.json")
        with open(path + ".partial", "w", encoding="utf-8") as file:
            file.write(batch.model_dump_json())
            file.flush()
            os.fsync(file.fileno())
        os.replace(path + ".partial", path)
        return self._deliver(path, batch)

    def pending(self) -> list[str]:
        return sorted(glob.glob(os.path.join(self.directory, "*.json")))

    def resend(self) -> None:
        """Send what is spooled, oldest first, until a send fails."""
        self.unsent = False
        for path in self.pending():
            try:
                with open(path, encoding="utf-8") as file:
                    batch = RolloutBatch.model_validate_json(file.read())
            except FileNotFoundError:  # another thread sent it meanwhile
                continue
            if not self._deliver(path, batch):
                return

    def _deliver(self, path: str, batch: RolloutBatch) -> bool:
        try:
            self._send(batch)
        except ConnectionError as exc:
            log.warning("orchestrator unreachable (%s); %d rollouts stay spooled", exc, len(batch.rollouts))
            self.unsent = True
            return False
        with contextlib.suppress(FileNotFoundError):  # two threads may resend one file: one removes it
            os.remove(path)
        return True
