"""aiohttp application: thin handlers that authenticate, validate with pydantic, call RunState.

`create_app` is called by `decentrl orchestrator` (and by tests, on loopback). Routes:
  GET  /v1/info      any token  what a worker needs to join (store URL, version, group size)
  POST /v1/leases    worker     lease prompt groups, learn the newest version and sampling
  POST /v1/rollouts  worker     post finished samples; answers per-rollout accept/reject
  GET  /v1/batch     trainer    long-poll for the next fresh batch (204 if none in time)
  POST /v1/version   trainer    announce a version complete in the store
  GET  /v1/status    any token  counters, for progress displays
  GET  /             no token   a small status page
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

from aiohttp import web
from pydantic import BaseModel, ValidationError

from decentrl.wire import (
    API_PREFIX,
    LeaseRequest,
    LeaseResponse,
    RolloutBatch,
    RunInfo,
    VersionAnnouncement,
)
from orchestrator.auth import Identity, Role, TokenRegistry
from orchestrator.state import RunState

log = logging.getLogger("decentrl.orchestrator")

STATE = web.AppKey("state", RunState)
TOKENS = web.AppKey("tokens", TokenRegistry)
STORE_URL = web.AppKey("store_url", str)
BATCH_READY = web.AppKey("batch_ready", asyncio.Condition)
IDENTITY = web.RequestKey("identity", Identity)
M = TypeVar("M", bound=BaseModel)

# Which role may call which route; routes not listed need no token.
ROUTE_ROLES: dict[str, tuple[Role, ...]] = {
    f"{API_PREFIX}/info": ("worker", "trainer", "admin"),
    f"{API_PREFIX}/status": ("worker", "trainer", "admin"),
    f"{API_PREFIX}/leases": ("worker",),
    f"{API_PREFIX}/rollouts": ("worker",),
    f"{API_PREFIX}/batch": ("trainer",),
    f"{API_PREFIX}/version": ("trainer",),
}


def json_response(model: BaseModel, status: int = 200) -> web.Response:
    return web.Response(text=model.model_dump_json(), status=status, content_type="application/json")


def error(kind: type[web.HTTPException], message: str) -> web.HTTPException:
    return kind(text=json.dumps({"error": message}), content_type="application/json")


async def parse_body(request: web.Request, model: type[M]) -> M:
    try:
        return model.model_validate_json(await request.read())
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in item['loc']) or 'body'}: {item['msg']}" for item in exc.errors()[:10]
        )
        raise error(web.HTTPBadRequest, f"invalid {model.__name__}: {problems}") from None


@web.middleware
async def auth_middleware(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    allowed = ROUTE_ROLES.get(request.path)
    if allowed is not None:
        header = request.headers.get("Authorization", "")
        scheme, _, token = header.partition(" ")
        identity = request.app[TOKENS].identify(token) if scheme == "Bearer" and token else None
        if identity is None:
            raise error(web.HTTPUnauthorized, "missing or unknown bearer token (Authorization: Bearer TOKEN)")
        if identity.role not in allowed:
            raise error(web.HTTPForbidden, f"role {identity.role!r} may not call {request.path}; needs {allowed}")
        request[IDENTITY] = identity
    return await handler(request)


def holder_of(request: web.Request, worker_id: str) -> str:
    identity: Identity = request[IDENTITY]
    return f"{identity.name}/{worker_id}"


async def info(request: web.Request) -> web.Response:
    state = request.app[STATE]
    return json_response(
        RunInfo(
            run_name=state.config.run_name,
            store_url=request.app[STORE_URL],
            policy_version=state.published_version,
            max_staleness=state.config.max_staleness,
            group_size=state.config.group_size,
        )
    )


async def leases(request: web.Request) -> web.Response:
    body = await parse_body(request, LeaseRequest)
    state = request.app[STATE]
    granted = state.grant_leases(holder_of(request, body.worker_id), body.max_groups)
    return json_response(
        LeaseResponse(
            policy_version=state.published_version,
            sampling=state.sampling,
            leases=granted,
            retry_after_s=0.0 if granted else 0.2,
        )
    )


async def rollouts(request: web.Request) -> web.Response:
    body = await parse_body(request, RolloutBatch)
    worker_ids = {r.worker_id for r in body.rollouts}
    if len(worker_ids) != 1:
        raise error(web.HTTPBadRequest, "all rollouts of one request must carry the same worker_id")
    state = request.app[STATE]
    result = state.ingest(body.rollouts, holder_of(request, worker_ids.pop()))
    if result.accepted:
        async with request.app[BATCH_READY]:
            request.app[BATCH_READY].notify_all()
    return json_response(result)


async def batch(request: web.Request) -> web.StreamResponse:
    try:
        trainer_version = int(request.query["trainer_version"])
    except (KeyError, ValueError):
        raise error(web.HTTPBadRequest, "query parameter trainer_version (an integer >= 0) is required") from None
    state = request.app[STATE]
    ready = request.app[BATCH_READY]
    deadline = asyncio.get_running_loop().time() + state.config.orchestrator.batch_wait_s
    async with ready:
        while (served := state.take_batch(trainer_version)) is None:
            remaining = deadline - asyncio.get_running_loop().time()
            if remaining <= 0:
                return web.Response(status=204)
            with contextlib.suppress(asyncio.TimeoutError):  # not the builtin before Python 3.11
                await asyncio.wait_for(ready.wait(), timeout=min(remaining, 1.0))
    return json_response(served)


async def version(request: web.Request) -> web.Response:
    body = await parse_body(request, VersionAnnouncement)
    state = request.app[STATE]
    state.announce(body.version)
    log.info("version %d published", body.version)
    return json_response(state.status())


async def status(request: web.Request) -> web.Response:
    return json_response(request.app[STATE].status())


async def status_page(request: web.Request) -> web.Response:
    rows = "".join(
        f"<tr><th>{k}</th><td>{v}</td></tr>" for k, v in request.app[STATE].status().model_dump().items()
    )
    html = f"<html><head><title>decentrl</title><meta http-equiv='refresh' content='2'></head><body><h1>decentrl orchestrator</h1><table>{rows}</table></body></html>"
    return web.Response(text=html, content_type="text/html")


async def _expire_leases_forever(app: web.Application) -> AsyncIterator[None]:
    async def loop() -> None:
        while True:
            await asyncio.sleep(1.0)
            app[STATE].expire_leases()

    task = asyncio.create_task(loop())
    yield
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


def create_app(*, state: RunState, tokens: TokenRegistry, store_url: str) -> web.Application:
    app = web.Application(
        middlewares=[auth_middleware], client_max_size=state.config.orchestrator.max_request_bytes
    )
    app[STATE] = state
    app[TOKENS] = tokens
    app[STORE_URL] = store_url
    app[BATCH_READY] = asyncio.Condition()
    app.cleanup_ctx.append(_expire_leases_forever)
    app.router.add_get(f"{API_PREFIX}/info", info)
    app.router.add_post(f"{API_PREFIX}/leases", leases)
    app.router.add_post(f"{API_PREFIX}/rollouts", rollouts)
    app.router.add_get(f"{API_PREFIX}/batch", batch)
    app.router.add_post(f"{API_PREFIX}/version", version)
    app.router.add_get(f"{API_PREFIX}/status", status)
    app.router.add_get("/", status_page)
    return app
