"""The typed state of the orchestrator's app (`web.AppKey`s) and the small helpers that act on it.

`create_app` (orchestrator/app.py) sets every key before the app starts; the handlers, the
middlewares and the background tasks read them. The keys live here, not in app.py, so that those
modules can import them without importing the app factory.

Handlers and background tasks wake one another instead of polling: BATCH_READY wakes the
trainer's long-poll, LEASES_FREED the workers' lease long-polls, VERSION_PUBLISHED their version
long-polls, SCORES_WAITING the scorers', and `wake_checks` the verification scheduler (CHECKS_WANTED).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from decentrl.api.wire import StatusResponse
from decentrl.store.checkpoints import CheckpointStore
from orchestrator.auth import TokenRegistry
from orchestrator.history import History
from orchestrator.limits import InFlight, RateLimiter
from orchestrator.state import RunState
from orchestrator.verify import Verifier

log = logging.getLogger("decentrl.orchestrator")


@dataclass
class IdleScorers:
    """Score lease requests from scorers with nothing in hand, long-polling now: a request asked
    `ahead` (its scorer still has samples to score) leases only while there are none, so waiting
    samples go first to a scorer that can start on them (orchestrator/score_handlers.py)."""

    count: int = 0


@dataclass
class JournalFailed:
    """What happens when the journal fails (a request's commit or the upkeep's): `mark()` sets the
    metric each time, and the service's `callback(exc)` is called once (`decentrl orchestrator`
    then shuts down, so that a restart recovers from the journal)."""

    mark: Callable[[], None]
    callback: Callable[[BaseException], Any] | None

    def __call__(self, exc: BaseException) -> None:
        self.mark()
        callback, self.callback = self.callback, None
        if callback is not None:
            callback(exc)


STATE = web.AppKey("state", RunState)
TOKENS = web.AppKey("tokens", TokenRegistry)
STORE_URL = web.AppKey("store_url", str)
STORE: web.AppKey[CheckpointStore | None] = web.AppKey("store")  # announced versions must exist in it
STOPPING = web.AppKey("stopping", asyncio.Event)  # set when the app shuts down: long-polls answer now
LIMITER = web.AppKey("limiter", RateLimiter)
INFLIGHT = web.AppKey("inflight", InFlight)
JOURNAL_FAILED = web.AppKey("journal_failed", JournalFailed)
# (method, route template) -> the roles allowed to call it; None: no token needed.
ROUTE_ROLES: web.AppKey[dict[tuple[str, str], tuple[str, ...] | None]] = web.AppKey("route_roles")
OPENAPI: web.AppKey[dict[str, Any]] = web.AppKey("openapi")
VERIFIER = web.AppKey("verifier", Verifier)  # present when orchestrator.verification.enabled
BATCH_READY = web.AppKey("batch_ready", asyncio.Condition)  # notified when a batch may have formed
LEASES_FREED = web.AppKey("leases_freed", asyncio.Condition)  # notified when a lease may be grantable
VERSION_PUBLISHED = web.AppKey("version_published", asyncio.Condition)  # notified when a version is announced
SCORES_WAITING = web.AppKey("scores_waiting", asyncio.Condition)  # notified when samples may wait for scorers
IDLE_SCORERS = web.AppKey("idle_scorers", IdleScorers)
VERDICTS = web.AppKey("verdicts", asyncio.Condition)  # notified when a verdict on a posted step is taken
CHECKS_WANTED = web.AppKey("checks_wanted", asyncio.Event)  # set when pending groups may be due a check
HISTORY = web.AppKey("history", History)  # bounded curves and samples for the dashboard


def run_status(app: web.Application) -> StatusResponse:
    """The /v1/status answer: the run's (RunState.status), with the verifier's summary when it runs
    and what each worker token's worker computes on."""
    found = app[STATE].status()
    if VERIFIER in app:
        found.verification = app[VERIFIER].summary()
    for name, machine in app[HISTORY].machines.items():
        found.workers.setdefault(name, {})["machine"] = machine.model_dump()
    return found


async def commit(app: web.Application) -> None:
    """After a change to the state: revoke the tokens it banned (their next request gets 401;
    what they left waiting is already dropped, RunState `_apply_bans`), then wait until everything
    the state recorded is on disk (no-op without a journal)."""
    state = app[STATE]
    while state.new_bans:
        name = state.new_bans.pop(0)
        try:
            app[TOKENS].revoke(name)
        except PermissionError as exc:  # an environment token: only its operator can remove it
            log.error("worker token %r is banned but cannot be revoked here (%s); its rollouts are refused", name, exc)
    await state.journal.commit()


async def notify_all(condition: asyncio.Condition) -> None:
    async with condition:
        condition.notify_all()


async def wait_awhile(app: web.Application, condition: asyncio.Condition, deadline: float, most_s: float) -> bool:
    """One wait of a long-poll that holds `condition`: until notified, `most_s` or `deadline` (loop
    time). False at once when the deadline has passed or the app is stopping: the long-poll answers."""
    remaining = deadline - asyncio.get_running_loop().time()
    if remaining <= 0 or app[STOPPING].is_set():
        return False
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(condition.wait(), timeout=min(remaining, most_s))
    return True


async def stop_waiting(app: web.Application) -> None:
    """The app is shutting down (on_shutdown): every long-poll answers now, as if its wait ran out,
    instead of holding the shutdown for up to batch_wait_s."""
    app[STOPPING].set()
    await notify_all(app[BATCH_READY])
    await notify_all(app[LEASES_FREED])
    await notify_all(app[VERSION_PUBLISHED])
    await notify_all(app[SCORES_WAITING])
    await notify_all(app[VERDICTS])


def wake_checks(app: web.Application) -> None:
    """A group may have become pending for its logprob check, or the ready queue ahead of one moved: the
    verification scheduler looks again (orchestrator/verification.py)."""
    if app[STATE].verify_queue:
        app[CHECKS_WANTED].set()
