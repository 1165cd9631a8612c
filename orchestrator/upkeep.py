"""Background upkeep of the orchestrator's app: the journal's writer and lease expiry.

Both are `cleanup_ctx` entries of create_app (orchestrator/app.py), set up when the app starts
and torn down when it stops, in reverse order (lease upkeep stops before the journal's writer).
- `journal_writer`: the journal's writer thread (orchestrator/journal.py) runs while the app
  does; each commit's duration goes to the metrics.
- `lease_upkeep`: every half second, expire overdue leases (their prompts are leased again
  first) and forget leases closed longer than `dedupe_window_s`, then commit. A journal failure
  here trips JOURNAL_FAILED as a request's would.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from aiohttp import web

from orchestrator.appstate import JOURNAL_FAILED, STATE, commit
from orchestrator.journal import JournalError
from orchestrator.metrics import METRICS

log = logging.getLogger("decentrl.orchestrator")

UPKEEP_INTERVAL_S = 0.5  # at most this late does an overdue lease expire


async def journal_writer(app: web.Application) -> AsyncIterator[None]:
    journal = app[STATE].journal
    journal.on_commit = app[METRICS].on_commit
    journal.start(asyncio.get_running_loop())
    yield
    await journal.stop()


async def _expire_and_forget(app: web.Application) -> None:
    state = app[STATE]
    while True:
        await asyncio.sleep(UPKEEP_INTERVAL_S)
        try:
            state.expire_leases()
            state.forget_closed()
            await commit(state)
        except JournalError as exc:
            log.critical("journal failed: %s", exc)
            app[JOURNAL_FAILED](exc)
            return
        except Exception:  # a bug here must not stop lease expiry for good
            log.exception("lease upkeep failed; trying again")


async def lease_upkeep(app: web.Application) -> AsyncIterator[None]:
    task = asyncio.create_task(_expire_and_forget(app))
    yield
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
