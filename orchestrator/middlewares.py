"""The orchestrator's middlewares, outermost first: errors (and request metrics), then auth.

`errors_middleware` turns every failure into a JSON error a client can act on and counts the
request (a refused lease or score operation: its error's `status`; a full journal disk: 503, the
run goes on; a journal failure: 503, JOURNAL_FAILED tripped); `auth_middleware` checks the bearer
token against the route's roles, then its rate limit, and records the caller's IDENTITY.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable

from aiohttp import web

from decentrl.api.encoding import MEDIA_JSON
from decentrl.api.wire import API_PREFIX
from orchestrator.appstate import JOURNAL_FAILED, LIMITER, ROUTE_ROLES, STATE, TOKENS
from orchestrator.auth import IDENTITY
from orchestrator.body import error
from orchestrator.journal import JournalError, JournalFull
from orchestrator.leases import LeaseError
from orchestrator.metrics import METRICS
from orchestrator.protocol import client_faults
from orchestrator.score_queue import ScoreError

log = logging.getLogger("decentrl.orchestrator")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _template(request: web.Request) -> str | None:
    """The matched route's template; None when nothing matched (404/405)."""
    info = request.match_info
    return None if info.http_exception is not None else info.route.resource.canonical  # type: ignore[union-attr]


def _as_json(request: web.Request, exc: web.HTTPException) -> web.Response:
    """aiohttp's own errors (no route, wrong method, body too large) as JSON, headers kept."""
    if exc.status == 404:
        message = f"no route {request.method} {request.path}; see /openapi.json"
    elif exc.status == 405:
        message = f"{request.method} is not allowed on {request.path}; allowed: {exc.headers.get('Allow', '')}"
    elif exc.status == 413:
        message = f"{exc.text}; the limit is orchestrator.max_request_bytes"
    else:
        message = exc.text or exc.reason
    headers = {k: v for k, v in exc.headers.items() if k.lower() not in ("content-type", "content-length")}
    return web.Response(status=exc.status, text=json.dumps({"error": message}), content_type=MEDIA_JSON, headers=headers)


@web.middleware
async def errors_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """JSON errors for everything, one log line for a bug, and the request metrics."""
    started = time.perf_counter()
    route = _template(request) or "unmatched"
    metrics = request.app[METRICS]
    status = 500
    try:
        response = await handler(request)
        status = response.status
        return response
    except web.HTTPException as exc:
        status = exc.status
        if exc.status < 400 or exc.content_type == MEDIA_JSON:
            raise
        return _as_json(request, exc)
    except (LeaseError, ScoreError) as exc:
        status = exc.status
        return web.Response(status=status, text=json.dumps({"error": str(exc)}), content_type=MEDIA_JSON)
    except JournalFull as exc:  # the journal says so once; the run goes on when space returns
        status = 503
        raise error(web.HTTPServiceUnavailable, str(exc), retry_after=5) from None
    except JournalError as exc:
        status = 503
        request.app[JOURNAL_FAILED](exc)
        raise error(web.HTTPServiceUnavailable, f"{exc}; restart the orchestrator (it recovers from the journal)", retry_after=5) from None
    except asyncio.CancelledError:
        status = 499
        raise
    except ConnectionResetError:  # the client went away mid-request: its fault, one throttled line
        status = 499
        client_faults.warning("disconnect", "client %s went away during %s %s", request.remote, request.method, route)
        return web.Response(status=499, text=json.dumps({"error": "the client closed the connection"}), content_type=MEDIA_JSON)
    except Exception:
        log.exception("%s %s failed", request.method, request.path)  # never logs headers (tokens)
        raise error(web.HTTPInternalServerError, "internal error; see the orchestrator's log") from None
    finally:
        metrics.requests.labels(route, request.method, str(status)).inc()
        metrics.latency.labels(route).observe(time.perf_counter() - started)


@web.middleware
async def auth_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """401 without a known bearer token, 403 for a role the route does not allow, 429 over the
    token's rate; routes whose roles are None (the dashboard page, /healthz, /openapi.json) pass."""
    template = _template(request)
    allowed = None if template is None else request.app[ROUTE_ROLES].get((request.method, template))
    if allowed is not None:
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        token = token.strip()
        # RFC 9110 11.1: the scheme is case-insensitive ("bearer" is "Bearer").
        identity = request.app[TOKENS].identify(token) if scheme.lower() == "bearer" and token else None
        if identity is None:
            raise error(web.HTTPUnauthorized, "missing or unknown bearer token (Authorization: Bearer TOKEN)")
        if identity.role not in allowed:
            raise error(web.HTTPForbidden, f"role {identity.role!r} may not call {request.path}; needs {allowed}")
        limiter = request.app[LIMITER]
        if (wait := limiter.check(identity.name)) > 0:
            request.app[METRICS].rate_limited.labels(identity.name).inc()
            raise error(
                web.HTTPTooManyRequests,
                f"token {identity.name!r} is over its rate limit of {limiter.rate_per_s:g} requests/s",
                retry_after=wait,
            )
        request[IDENTITY] = identity
        journal = request.app[STATE].journal
        if journal.full and (request.method != "GET" or request.path == f"{API_PREFIX}/batch"):
            # Nothing changes while it cannot be journaled: the state stays what the disk holds
            # plus what the full commit held (written first when space returns), and no more.
            raise journal.full_error()
    return await handler(request)
