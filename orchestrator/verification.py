"""The verification scheduler: when pending groups get their logprob check, and what follows.

A `cleanup_ctx` entry of create_app. It sleeps on CHECKS_WANTED (set by handlers through
`wake_checks`) until a check is due (RunState `checks_due`, a full forward queued, or
`check_wait_s` waited), runs the Verifier on one thread off the event loop, hands the verdicts
back (`verification_done`) and wakes the long-polls they may serve. Details: docs/security.md.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
from collections.abc import AsyncIterator

from aiohttp import web

from orchestrator.appstate import (
    BATCH_READY,
    CHECKS_WANTED,
    JOURNAL_FAILED,
    LEASES_FREED,
    STATE,
    VERIFIER,
    commit,
    notify_all,
)
from orchestrator.journal import JournalError, JournalFull
from orchestrator.state import VerifyJob
from orchestrator.verify import Verifier

log = logging.getLogger("decentrl.orchestrator")


async def _judge(app: web.Application, executor: concurrent.futures.Executor, jobs: list[VerifyJob]) -> None:
    """Check `jobs` in one forward on the verifier's thread; verdicts to RunState, bans revoked."""
    state = app[STATE]
    rollouts = [rollout for job in jobs for rollout in job.rollouts]
    try:
        failed = await asyncio.get_running_loop().run_in_executor(executor, app[VERIFIER].check, rollouts)
    except Exception:  # a bug must not hold groups back for good: they are dropped, unjudged
        log.exception("verification failed; dropping %d groups unjudged", len(jobs))
        failed = {rollout.rollout_id: "unverifiable" for rollout in rollouts}
    state.verification_done(
        {job.lease_id: {r.rollout_id: failed[r.rollout_id] for r in job.rollouts if r.rollout_id in failed} for job in jobs}
    )
    await commit(app)
    # A batch may form now, and a dropped group frees its place for a new lease.
    await notify_all(app[BATCH_READY])
    await notify_all(app[LEASES_FREED])


async def _check_when_due(app: web.Application, executor: concurrent.futures.Executor) -> None:
    state, wanted = app[STATE], app[CHECKS_WANTED]
    options = state.config.orchestrator.verification
    loop = asyncio.get_running_loop()
    waiting_since: float | None = None  # when the oldest job still queued was first seen
    while True:
        wanted.clear()  # before looking: a wake-up from here on is seen by the next wait
        if not state.verify_queue:
            waiting_since = None
            await wanted.wait()
            continue
        now = loop.time()
        waiting_since = now if waiting_since is None else waiting_since
        queued = sum(len(job.rollouts) for job in state.verify_queue)
        waited = now - waiting_since
        if not state.checks_due() and queued < options.check_batch_rollouts and waited < options.check_wait_s:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(wanted.wait(), timeout=options.check_wait_s - waited)
            continue
        jobs = state.take_checks(options.check_batch_rollouts)
        if not state.verify_queue:
            waiting_since = None  # else what is left waited as long: it goes next, at once
        try:
            await _judge(app, executor, jobs)
        except JournalFull:  # the verdicts are applied; the journal writes them once space returns
            continue
        except JournalError as exc:
            log.critical("journal failed: %s", exc)
            app[JOURNAL_FAILED](exc)
            return


def _warm_up(verifier: Verifier) -> None:
    try:
        verifier.warm_up()
    except Exception:  # the first check then loads what it needs itself
        log.exception("verifier warm-up failed")


async def verification(app: web.Application) -> AsyncIterator[None]:
    """The logprob spot-checks, while the app runs (only with a Verifier: verification enabled)."""
    if VERIFIER not in app:
        yield
        return
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="verifier") as executor:
        executor.submit(_warm_up, app[VERIFIER])
        task = asyncio.create_task(_check_when_due(app, executor))
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
