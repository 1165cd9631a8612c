"""The scorer role's request handlers: lease samples to score, renew, post scores.

Thin, as orchestrator/handlers.py: validate, call RunState, commit the journal, answer (a refused
lease or score post raises, and the errors middleware answers with its status). The client
is workers/scorer.py; the protocol is docs/rewards.md.
"""

from __future__ import annotations

import asyncio

from aiohttp import web

from decentrl.api.wire import ScoreLease, ScoreLeaseRequest, ScorePost
from orchestrator.appstate import (
    BATCH_READY,
    IDLE_SCORERS,
    LEASES_FREED,
    SCORES_WAITING,
    STATE,
    VERDICTS,
    commit,
    notify_all,
    wait_awhile,
    wake_checks,
)
from orchestrator.body import holder_of, parse_body, query_id, respond


async def score_leases(request: web.Request) -> web.Response:
    body = await parse_body(request, ScoreLeaseRequest)
    state = request.app[STATE]
    holder, wait_s = holder_of(request, body.scorer_id), state.config.orchestrator.lease_wait_s
    score_range = state.config.orchestrator.rewards.score_range
    # Long-poll as workers' leases do: a scorer starts the moment a group completes. A request
    # asked ahead (its scorer is still busy) yields to scorers with nothing in hand.
    waiting, idle = request.app[SCORES_WAITING], request.app[IDLE_SCORERS]
    deadline = asyncio.get_running_loop().time() + wait_s
    async with waiting:
        if not body.ahead:
            idle.count += 1
        try:
            while (entry := None if body.ahead and idle.count else state.lease_scores(holder, body.max_items)) is None:
                if not await wait_awhile(request.app, waiting, deadline, 0.5):  # every 0.5 s at least: leases expire unannounced
                    break
        finally:
            if not body.ahead:
                idle.count -= 1
                waiting.notify_all()  # requests asked ahead may lease what this one left
    if entry is None:
        return respond(request, ScoreLease(
            lease_id="", deadline=0.0, items=[], score_range=score_range, retry_after_s=0.0 if wait_s > 0 else 0.2
        ))
    items = state.score_queue.items(entry)
    return respond(request, ScoreLease(lease_id=entry.lease_id, deadline=entry.deadline, items=items, score_range=score_range))


async def score_renew(request: web.Request) -> web.Response:
    return respond(request, request.app[STATE].renew_scores(request.match_info["lease_id"], query_id(request, "scorer_id")))


async def scores(request: web.Request) -> web.Response:
    body = await parse_body(request, ScorePost)
    app, state = request.app, request.app[STATE]
    ready_before = len(state.ready)
    ack = state.post_scores(holder_of(request, body.scorer_id), body)
    await commit(app)
    await notify_all(app[VERDICTS])  # a worker may be waiting for a verdict on its step
    wake_checks(app)  # a scored group may still wait for its check, now due
    if len(state.ready) > ready_before:
        await notify_all(app[BATCH_READY])
    await notify_all(app[LEASES_FREED])  # a group dropped (stale, a judge reply unparsed) frees its place
    return respond(request, ack)

