"""The reward guard: task reward code runs in a child process, each call bounded by a timeout.

Rewards are computed by the orchestrator only, and reward code is the user's (a dataset's
importable function, a reasoning-gym scorer, math-verify on an adversarial answer): it may raise,
loop forever or return nonsense. The guard runs it in a spawned child process, so a hang is
ended by killing the child (a thread cannot be killed) and a crash cannot reach the orchestrator.
A failed call scores 0, is counted in `failures` by kind and logged with its prompt id; the next
call starts a fresh child. The counts are exported by the orchestrator (`reward_failures`); they
are not journaled, so they count from the orchestrator's start.

Called by the file-based tasks (decentrl/tasks/dataset.py, reasoning_gym.py) from `Task.reward`;
the child builds its own scorer from a picklable factory, and each call sends the completion
with what scoring it needs (a reference answer, a generator's entry).
"""

from __future__ import annotations

import logging
import multiprocessing
import threading
from collections import Counter
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Protocol, runtime_checkable

logger = logging.getLogger(__name__)

Scorer = Callable[..., float]  # (decoded completion, what the task sends along) -> reward in [0, 1]
START_TIMEOUT_S = 120.0  # a child imports the task's libraries (math-verify, datasets) and reads its data


@runtime_checkable
class GuardedRewards(Protocol):
    """A task whose reward code runs in a RewardGuard (the dataset, reasoning_gym and verifiers
    sources): its failed calls by kind, which the orchestrator exports (orchestrator/metrics.py,
    /v1/status)."""

    @property
    def reward_failures(self) -> dict[str, int]: ...


def reward_failures(task: object) -> dict[str, int]:
    """The task's failed reward calls by kind ("timeout", "error", "out_of_range"); {} for a task
    whose reward is decentrl's own code (no guard)."""
    return task.reward_failures if isinstance(task, GuardedRewards) else {}


class RewardGuardError(RuntimeError):
    """The child could not build its scorer: the task's config or environment is broken."""


def _serve(conn: Connection, factory: Callable[[], Scorer]) -> None:
    """The child's loop: build the scorer once, then answer each request's arguments with a reward."""
    try:
        scorer = factory()
    except Exception as exc:  # reported to the parent as a clear error, not a silent dead child
        conn.send(("fatal", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ready", None))
    while True:
        try:
            request = conn.recv()
        except EOFError:  # the parent dropped its end (its task is gone, or it exited): nothing more to score
            return
        if request is None:
            return
        try:
            conn.send(("ok", float(scorer(*request))))
        except Exception as exc:  # the user's reward raised: counted by the parent, the child lives on
            conn.send(("error", f"{type(exc).__name__}: {exc}"))


class RewardGuard:
    """Calls a scorer in a child process; thread-safe (one call at a time)."""

    def __init__(self, factory: Callable[[], Scorer], *, timeout_s: float, name: str) -> None:
        self._factory = factory
        self.timeout_s = timeout_s
        self.name = name
        self.failures: Counter[str] = Counter()  # "timeout", "error", "out_of_range"
        self.calls = 0
        self._lock = threading.Lock()
        self._process: BaseProcess | None = None
        self._conn: Connection | None = None

    def __call__(self, prompt_id: int, *args: object) -> float:
        """scorer(*args) in the child; `prompt_id` names the call in logs. Arguments must pickle."""
        with self._lock:
            self.calls += 1
            conn = self._ensure_child()
            conn.send(args)
            if not conn.poll(self.timeout_s):
                self._stop_child()
                return self._failed("timeout", prompt_id, f"no answer within {self.timeout_s} s (child restarted)")
            kind, value = conn.recv()
        if kind == "error":
            return self._failed("error", prompt_id, str(value))
        if not 0.0 <= value <= 1.0:  # also NaN
            return self._failed("out_of_range", prompt_id, f"returned {value!r}, not a score in [0, 1]")
        return value

    def _failed(self, kind: str, prompt_id: int, detail: str) -> float:
        self.failures[kind] += 1
        logger.warning(
            "%s reward for prompt %d scored 0: %s (%s so far: %d of %d calls)",
            self.name, prompt_id, detail, kind, self.failures[kind], self.calls,
        )
        return 0.0

    def _ensure_child(self) -> Connection:
        if self._process is not None and self._process.is_alive() and self._conn is not None:
            return self._conn
        self._stop_child()
        # spawn, not fork: the orchestrator runs threads and an event loop a fork would copy mid-flight.
        context = multiprocessing.get_context("spawn")
        parent, child = context.Pipe()
        process = context.Process(target=_serve, args=(child, self._factory), name=f"reward-{self.name}", daemon=True)
        process.start()
        child.close()
        if not parent.poll(START_TIMEOUT_S):
            process.kill()
            raise RewardGuardError(f"{self.name} reward process did not start within {START_TIMEOUT_S} s")
        kind, detail = parent.recv()
        if kind == "fatal":
            process.join()
            raise RewardGuardError(f"{self.name} reward process could not build its scorer: {detail}")
        self._process, self._conn = process, parent
        return parent

    def _stop_child(self) -> None:
        if self._process is not None:
            self._process.kill()
            self._process.join()
        if self._conn is not None:
            self._conn.close()
        self._process = self._conn = None

    def close(self) -> None:
        with self._lock:
            self._stop_child()
