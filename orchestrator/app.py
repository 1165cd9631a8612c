"""The orchestrator's aiohttp application: `create_app` wires the parts together.

Called by `serve` (orchestrator/service.py, behind `decentrl orchestrator`), and by tests and
benchmarks on loopback. Where each part lives:

  orchestrator/routes.py       the route table: paths, roles, bodies, answers; /openapi.json
  orchestrator/middlewares.py  JSON errors and request metrics, then auth and rate limits
  orchestrator/handlers.py     one thin handler per route: validate, call RunState, commit, answer
  orchestrator/body.py         request bodies (JSON, msgpack, gzip) and answers
  orchestrator/appstate.py     the app's typed state (web.AppKey) and its wake-ups
  orchestrator/upkeep.py       background: the journal's writer, lease expiry
  orchestrator/verification.py background: the logprob spot-check scheduler
  orchestrator/dashboard.py    the live page at /, the JSON it polls; history.py its curves
  orchestrator/state.py        the run itself (leases, ingest, groups, batches), no HTTP in it

A request passes errors_middleware -> auth_middleware -> its handler; every change a handler
makes is journaled and committed before it answers. Errors are JSON {"error": "..."} with the
status saying which: 400 malformed (naming the field), 401/403 auth, 404/409 unknown or closed
lease/token or another run, 413 too big, 415 unknown Content-Type, 429 over the token's rate
(Retry-After), 503 overloaded or journal failed (Retry-After). docs/api.md has the details.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from aiohttp import web

from decentrl.store.checkpoints import CheckpointStore
from orchestrator.appstate import (
    BATCH_READY,
    CHECKS_WANTED,
    HISTORY,
    IDLE_SCORERS,
    INFLIGHT,
    JOURNAL_FAILED,
    LEASES_FREED,
    LIMITER,
    OPENAPI,
    ROUTE_ROLES,
    SCORES_WAITING,
    STATE,
    STOPPING,
    STORE,
    STORE_URL,
    TOKENS,
    VERIFIER,
    IdleScorers,
    JournalFailed,
    stop_waiting,
)
from orchestrator.auth import TokenRegistry
from orchestrator.body import BODY_LIMITS, BodyLimits
from orchestrator.checks import run_keeps_routing
from orchestrator.dashboard import sampler
from orchestrator.history import History
from orchestrator.limits import InFlight, RateLimiter
from orchestrator.metrics import METRICS, Metrics
from orchestrator.middlewares import auth_middleware, errors_middleware
from orchestrator.routes import add_routes, openapi_spec, route_roles
from orchestrator.state import RunState
from orchestrator.upkeep import journal_writer, lease_upkeep
from orchestrator.verification import verification
from orchestrator.verify import Verifier


def create_app(
    *,
    state: RunState,
    tokens: TokenRegistry,
    store_url: str,
    on_fatal: Callable[[BaseException], Any] | None = None,
    verifier: Verifier | None = None,
    store: CheckpointStore | None = None,
) -> web.Application:
    """The orchestrator's app over `state` (its config is the run's). `on_fatal` is called (once)
    when the journal fails. `verifier` runs the logprob spot-checks; required when
    orchestrator.verification.enabled. `store`: the run's checkpoint store, in which every
    announced version must exist (`serve` always passes it; without one, announcements are taken
    on the trainer's word, as unit tests of other behaviour do). Serve the app with
    OrchestratorRunner (orchestrator/protocol.py)."""
    options = state.config.orchestrator
    run_keeps_routing(state.config.model)  # a keep_routing the model cannot honour fails here, at start-up
    app = web.Application(
        middlewares=[errors_middleware, auth_middleware], client_max_size=options.max_request_bytes,
        # Bodies are decompressed by orchestrator/body.py (bounded, and a bad one is a 400).
        handler_args={"auto_decompress": False},
    )
    app[STATE] = state
    app[BODY_LIMITS] = BodyLimits(options.max_request_bytes, options.body_timeout_s)
    app[TOKENS] = tokens
    app[STORE_URL] = store_url
    app[METRICS] = metrics = Metrics(state)
    app[LIMITER] = RateLimiter(options.rate_limit_per_s, options.rate_limit_burst)
    app[INFLIGHT] = InFlight(options.max_inflight_requests, options.max_inflight_per_token)
    app[STORE] = store
    app[JOURNAL_FAILED] = JournalFailed(lambda: metrics.journal_failed.set(1), on_fatal)
    app[ROUTE_ROLES] = route_roles(metrics_public=options.metrics_public)
    app[OPENAPI] = openapi_spec(metrics_public=options.metrics_public)
    app[BATCH_READY] = asyncio.Condition()
    app[LEASES_FREED] = asyncio.Condition()
    app[SCORES_WAITING] = asyncio.Condition()
    app[IDLE_SCORERS] = IdleScorers()
    app[CHECKS_WANTED] = asyncio.Event()
    app[HISTORY] = History(clock=state.clock)
    app[STOPPING] = asyncio.Event()
    if options.verification.enabled:
        if verifier is None:
            raise ValueError("orchestrator.verification.enabled needs a Verifier (orchestrator/verify.py)")
        app[VERIFIER] = verifier
    # Set up in this order when the app starts, torn down in reverse when it stops.
    app.cleanup_ctx.append(journal_writer)
    app.cleanup_ctx.append(lease_upkeep)
    app.cleanup_ctx.append(verification)
    app.cleanup_ctx.append(sampler)
    app.on_shutdown.append(stop_waiting)  # long-polls answer at once: SIGTERM stops in well under 2 s
    add_routes(app)
    return app
