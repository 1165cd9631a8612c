"""The client side of a lease, shared by the worker and the scorer: ask (`answers`), hold
(`Renewals`, the scorer only: no slow worker holds a group past the lease timeout), post (`Spool`,
the worker only: a scorer's posts die with their lease).
"""

from __future__ import annotations

import contextlib
import glob
import logging
import os
import random
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import TypeVar

from decentrl.api.client import OrchestratorError
from decentrl.api.wire import RolloutBatch

log = logging.getLogger("decentrl.lease_loop")
A = TypeVar("A")
LEASE_GONE = (403, 404, 409)  # the lease expired, was closed, or is held by another
MIN_RENEW_S = 0.5


def default_id() -> str:
    return f"{os.uname().nodename}-{os.getpid()}"


def backoff(failures: int, base_s: float = 0.5, cap_s: float = 30.0) -> float:
    """Exponential backoff with full jitter."""
    return random.uniform(0.0, min(cap_s, base_s * 2.0 ** min(failures, 16)))


def on_signals(handler: Callable[..., object], *signals: signal.Signals) -> None:
    """Call `handler` on `signals`; outside the main thread nothing is installed (Python forbids it)."""
    if threading.current_thread() is threading.main_thread():
        for number in signals:
            signal.signal(number, handler)


def answers(ask: Callable[[], A], *, stop: threading.Event, passing: tuple[type[Exception], ...] = ()) -> Iterator[A]:
    """The answers to `ask` until `stop` is set; an error in `passing` is logged and asked again
    after a backoff (cut short by `stop`), any other propagates."""
    failures = 0
    while not stop.is_set():
        try:
            answer = ask()
        except passing as exc:
            failures += 1
            delay = backoff(failures)
            log.warning("lease request failed (%s); asking again in %.1fs", exc, delay)
            stop.wait(delay)
            continue
        failures = 0
        yield answer


class Renewals:
    """The leases held, each renewed by one thread (`run`) at half the time left (room for clock
    skew) until let go; a lease gone (403/404/409) is let go, any other error ends `run`, calls `failed`."""

    def __init__(
        self, renew: Callable[[str], float], *, failed: Callable[[], None], clock: Callable[[], float] = time.time
    ) -> None:
        self._renew = renew  # lease id -> its new deadline
        self._failed = failed
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
        """Renew every lease due now; when the next one is due (None: none held)."""
        with self._changed:
            now = self._clock()
            due = [lease_id for lease_id, at in self._due.items() if at <= now]
        for lease_id in due:
            try:
                deadline = self._renew(lease_id)
            except OrchestratorError as exc:
                if exc.status not in LEASE_GONE:
                    raise
                with self._changed:
                    if self._due.pop(lease_id, None) is not None:
                        log.warning("lease %s could not be renewed (%s); it is leased again", lease_id, exc)
                continue
            with self._changed:
                if lease_id in self._due:  # not let go meanwhile
                    self._due[lease_id] = self._renew_at(deadline)
        with self._changed:
            return min(self._due.values(), default=None)

    def run(self) -> None:
        while True:
            try:
                self.renew_due()
            except (OrchestratorError, ConnectionError) as exc:
                self.error = exc
                self._failed()
                return
            with self._changed:  # (a lease held since `renew_due` is in `_due` already)
                next_at = min(self._due.values(), default=None)
                if self._closed:
                    return
                self._changed.wait(60.0 if next_at is None else max(0.0, next_at - self._clock()))

    def close(self) -> None:
        with self._changed:
            self._closed = True
            self._changed.notify_all()


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
