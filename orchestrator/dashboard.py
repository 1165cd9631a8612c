"""The orchestrator's live dashboard: the page at `/`, the JSON it polls, the trainer's step metrics.

The page (orchestrator/static/dashboard.html) holds no data, so it needs no token; its script
polls GET /v1/dashboard for what is new since its last poll (`since`). Tokens never appear: the
page and the JSON name workers by token name. The reader's guide: docs/observability.md.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import asdict
from importlib.resources import files
from typing import Any

from aiohttp import web

from decentrl.api.wire import TrainerStep
from orchestrator.appstate import HISTORY, INFLIGHT, STATE, run_status
from orchestrator.body import error, parse_body
from orchestrator.history import SAMPLE_INTERVAL_S, History

PAGE = files("orchestrator").joinpath("static", "dashboard.html").read_bytes()
MAX_SINCE = 1e12  # a time stamp, in seconds


async def sample(app: web.Application) -> None:
    history, state, inflight = app[HISTORY], app[STATE], app[INFLIGHT]
    while True:
        history.sample(state.status(), inflight.count)
        await asyncio.sleep(SAMPLE_INTERVAL_S)


async def page(request: web.Request) -> web.Response:
    return web.Response(body=PAGE, content_type="text/html", charset="utf-8", headers={"Cache-Control": "no-cache"})


async def trainer_steps(request: web.Request) -> web.Response:
    body = await parse_body(request, TrainerStep)
    steps = request.app[STATE].config.trainer.steps
    if body.step > steps:  # the curves' x axis is the run's steps: nothing past its end
        raise error(web.HTTPBadRequest, f"step {body.step} is past this run's last step (trainer.steps = {steps})")
    request.app[HISTORY].trainer_step(body.step, body.metrics)
    return web.json_response({"step": body.step})


def _since(request: web.Request) -> float:
    text = request.query.get("since", "0")
    try:
        since = float(text)
    except ValueError:
        raise error(web.HTTPBadRequest, f"query parameter since must be a number of seconds, got {text[:40]!r}") from None
    if not 0 <= since <= MAX_SINCE:
        raise error(web.HTTPBadRequest, f"query parameter since must be between 0 and {MAX_SINCE:g}")
    return since


def workers_table(app: web.Application, history: History) -> list[dict[str, Any]]:
    """One row per worker token (its name, never the token): posts, strikes, bans, samples served."""
    integrity = app[STATE].integrity.summary()
    now, rows = history.clock(), []
    for token_name in sorted(set(integrity) | set(history.workers)):
        record, activity = integrity.get(token_name, {}), history.workers.get(token_name)
        rows.append({
            "worker": token_name,
            "accepted": activity.accepted if activity else 0,
            "rejections": dict(activity.rejections) if activity else {},
            "strikes": record.get("strikes", 0),
            "banned": record.get("banned", False),
            "served": record.get("served", 0),
            "version": activity.newest_version if activity else None,
            "last_seen_s": now - activity.last_seen if activity else None,
            "tokens_per_s": history.token_rate(token_name),
        })
    return rows


async def dashboard(request: web.Request) -> web.Response:
    since = _since(request)
    app, history = request.app, request.app[HISTORY]
    tokenizer = app[STATE].tokenizer
    # JSON has no NaN
    points = [{k: v if math.isfinite(v) else None for k, v in p.items()} for p in history.points if p["t"] > since]
    return web.json_response({
        "now": history.clock(),
        "status": run_status(app).model_dump(exclude={"workers"}),
        "points": points,
        "steps": [step for step in history.steps if step["t"] > since],
        "versions": [
            asdict(e) for e in history.versions if e.announced > since or e.first_rollout is None or e.first_rollout > since
        ],
        "staleness": {str(lag): count for lag, count in sorted(history.staleness.items())},
        "workers": workers_table(app, history),
        "samples": [
            {
                "time": s.time, "policy_version": s.policy_version, "trainer_version": s.trainer_version,
                "reward": s.reward, "advantage": s.advantage,
                "prompt": tokenizer.decode(s.prompt_token_ids, skip_special_tokens=True),
                "completion": tokenizer.decode(s.completion_token_ids, skip_special_tokens=True),
            }
            for s in history.samples if s.time > since
        ],
    })
