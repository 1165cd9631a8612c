"""aiohttp application: thin handlers that authenticate, validate with pydantic, call RunState.

`create_app` is called by `decentrl orchestrator` (and by tests, on loopback). Every route is
in ROUTES (method, path, roles, body model, answers), which also generates /openapi.json;
docs/api.md is the reference for clients. In short:

  GET    /v1/info                    any token  what a worker needs to join
  GET    /v1/status                  any token  counters, for progress displays
  POST   /v1/leases                  worker     lease prompt groups, learn the newest version
  GET    /v1/leases/{lease_id}       worker     where one of my leases stands
  POST   /v1/leases/{lease_id}/renew worker     push my lease's deadline out (slow generation)
  DELETE /v1/leases/{lease_id}       worker     give my lease back (its prompt goes out again)
  POST   /v1/rollouts                worker     post samples; per-rollout accept/reject
  GET    /v1/batch                   trainer    long-poll for the next fresh batch (204 if none in time)
  POST   /v1/version                 trainer    announce a version complete in the store
  GET    /v1/admin/tokens            admin      token names and roles
  POST   /v1/admin/tokens            admin      create a token
  DELETE /v1/admin/tokens/{name}     admin      revoke a token, at once
  GET    /metrics                    trainer, admin (or none: metrics_public)  Prometheus text
  GET    /openapi.json, /healthz, /  none

Every change a handler makes is journaled; the handler awaits the journal's commit before it
answers (orchestrator/journal.py), so an acknowledged rollout, lease or batch survives a crash.
Bodies may be JSON or msgpack (Content-Type), gzip-compressed or not; answers are msgpack when
the request's Accept names it. Errors are JSON {"error": "..."} with the status saying which:
400 malformed (naming the field), 401/403 auth, 404/409 unknown or closed lease/token or
another run, 413 too big, 415 unknown Content-Type, 429 over the token's rate (Retry-After),
503 overloaded or journal failed (Retry-After).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import re
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from aiohttp import web
from pydantic import BaseModel, ValidationError

import decentrl
from decentrl.tasks.episodes import EpisodeTask
from decentrl.wire import (
    API_PREFIX,
    EXT_FLOAT32,
    EXT_FLOAT64,
    EXT_INT32,
    EXT_INT64,
    MAX_VERSION,
    MEDIA_JSON,
    MEDIA_MSGPACK,
    MSGPACK_TYPES,
    TOKEN_NAME,
    WORKER_ID,
    EncodingError,
    Health,
    IngestResponse,
    LeaseRequest,
    LeaseResponse,
    LeaseState,
    Lease,
    RolloutBatch,
    RunInfo,
    StatusResponse,
    TokenCreate,
    TokenCreated,
    TokenEntry,
    TokenList,
    TrainBatch,
    TypedList,
    VersionAnnouncement,
    encode_model,
    unpack_msgpack,
)
from orchestrator.auth import Identity, TokenRegistry
from orchestrator.codec import Packed
from orchestrator.journal import JournalError
from orchestrator.limits import RateLimiter, retry_after_header
from orchestrator.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from orchestrator.metrics import Metrics
from orchestrator.openapi import Param, RouteSpec, build_openapi
from orchestrator.integrity import token_of
from orchestrator.state import LeaseError, RunState, VerifyJob
from orchestrator.verify import Verifier

log = logging.getLogger("decentrl.orchestrator")

STATE = web.AppKey("state", RunState)
TOKENS = web.AppKey("tokens", TokenRegistry)
STORE_URL = web.AppKey("store_url", str)
BATCH_READY = web.AppKey("batch_ready", asyncio.Condition)  # notified when a batch may have formed
LEASES_FREED = web.AppKey("leases_freed", asyncio.Condition)  # notified when a lease may be grantable
METRICS = web.AppKey("metrics", Metrics)
LIMITER = web.AppKey("limiter", RateLimiter)
INFLIGHT = web.AppKey("inflight", list)  # [rollout posts being processed]
OPENAPI = web.AppKey("openapi", dict)
ON_FATAL = web.AppKey("on_fatal", list)  # callables, each called once when the journal fails
ROUTE_ROLES = web.AppKey("route_roles", dict)  # (method, route template) -> roles, None = no token
VERIFIER = web.AppKey("verifier", Verifier)  # present when orchestrator.verification.enabled
IDENTITY = web.RequestKey("identity", Identity)
M = TypeVar("M", bound=BaseModel)

REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
JSON_TYPES = frozenset({MEDIA_JSON, "text/plain", "application/octet-stream", ""})
ANY = ("worker", "trainer", "admin")


def error(
    kind: type[web.HTTPException], message: str, *, retry_after: float | None = None
) -> web.HTTPException:
    headers = {"Retry-After": retry_after_header(retry_after)} if retry_after is not None else None
    return kind(text=json.dumps({"error": message}), content_type="application/json", headers=headers)


def wants_msgpack(request: web.Request) -> bool:
    accept = request.headers.get("Accept", "")
    return any(media in accept for media in MSGPACK_TYPES)


def respond(request: web.Request, model: BaseModel, status: int = 200) -> web.Response:
    if wants_msgpack(request):
        return web.Response(body=encode_model(model, MEDIA_MSGPACK), status=status, content_type=MEDIA_MSGPACK)
    return web.Response(body=model.model_dump_json().encode(), status=status, content_type=MEDIA_JSON)


def _problems(exc: ValidationError) -> str:
    return "; ".join(
        f"{'.'.join(str(p) for p in item['loc']) or 'body'}: {item['msg']}" for item in exc.errors()[:10]
    )


async def parse_body(request: web.Request, model: type[M], raw: list[Any] | None = None) -> M:
    """The body as `model`: JSON or msgpack by Content-Type (gzip undone by aiohttp).

    For msgpack, the decoded object is appended to `raw` when given (its typed arrays keep
    the bytes they came in, see `packed_arrays`)."""
    media = request.content_type
    msgpack = media in MSGPACK_TYPES
    if not msgpack and media not in JSON_TYPES and not media.endswith("+json"):
        raise error(
            web.HTTPUnsupportedMediaType,
            f"Content-Type {media!r} is not supported; send {MEDIA_JSON} or {MEDIA_MSGPACK} (optionally gzip-encoded)",
        )
    body = await request.read()  # 413 above client_max_size, counted after decompression
    try:
        if msgpack:
            decoded = unpack_msgpack(body)
            if raw is not None:
                raw.append(decoded)
            return model.model_validate(decoded)
        return model.model_validate_json(body)
    except EncodingError as exc:
        raise error(web.HTTPBadRequest, f"invalid {model.__name__}: body: {exc}") from None
    except ValidationError as exc:
        raise error(web.HTTPBadRequest, f"invalid {model.__name__}: {_problems(exc)}") from None


def packed_arrays(raw: Any) -> list[Packed | None] | None:
    """Per rollout of a decoded msgpack RolloutBatch: its completion ids and logprobs as the typed
    arrays they came in, to be journaled and served as they are (None where they were not)."""
    try:
        found: list[Packed | None] = []
        for rollout in raw["rollouts"]:
            ids, logprobs = rollout.get("completion_token_ids"), rollout.get("logprobs")
            typed = (
                isinstance(ids, TypedList) and ids.ext.code in (EXT_INT32, EXT_INT64)
                and isinstance(logprobs, TypedList) and logprobs.ext.code in (EXT_FLOAT32, EXT_FLOAT64)
            )
            found.append((ids.ext, logprobs.ext) if typed else None)
        return found
    except (TypeError, KeyError, AttributeError):
        return None


def query_int(request: web.Request, name: str, *, low: int = 0, high: int = MAX_VERSION) -> int:
    try:
        value = int(request.query[name])
    except (KeyError, ValueError):
        raise error(web.HTTPBadRequest, f"query parameter {name} (an integer >= {low}) is required") from None
    if not low <= value <= high:
        raise error(web.HTTPBadRequest, f"query parameter {name} must be between {low} and {high}, got {value}")
    return value


def query_worker(request: web.Request) -> str:
    worker_id = request.query.get("worker_id", "")
    if not re.fullmatch(WORKER_ID, worker_id):
        raise error(web.HTTPBadRequest, f"query parameter worker_id is required and must match {WORKER_ID}")
    return holder_of(request, worker_id)


def holder_of(request: web.Request, worker_id: str) -> str:
    identity: Identity = request[IDENTITY]
    return f"{identity.name}/{worker_id}"


async def commit(request: web.Request) -> None:
    """Wait until everything the state recorded is on disk (no-op without a journal)."""
    journal = request.app[STATE].journal
    if journal is not None:
        await journal.commit()


# -- middlewares --------------------------------------------------------------------------


def _route_of(request: web.Request) -> tuple[str, tuple[str, ...] | None] | None:
    """(route template, roles) of the matched route; None when nothing matched (404/405)."""
    info = request.match_info
    if info.http_exception is not None:
        return None
    resource = info.route.resource
    template = resource.canonical if resource is not None else request.path
    return template, request.app[ROUTE_ROLES].get((request.method, template))


@web.middleware
async def errors_middleware(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """JSON errors for everything, one log line for a bug, and the request metrics."""
    started = time.perf_counter()
    matched = _route_of(request)
    route = matched[0] if matched is not None else "unmatched"
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
        # aiohttp's own errors (no route, wrong method, body too large) as JSON, headers kept.
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
    except JournalError as exc:
        status = 503
        _fatal(request.app, exc)
        raise error(web.HTTPServiceUnavailable, f"{exc}; restart the orchestrator (it recovers from the journal)", retry_after=5) from None
    except (asyncio.CancelledError, ConnectionResetError):
        status = 499
        raise
    except Exception:
        log.exception("%s %s failed", request.method, request.path)  # never logs headers (tokens)
        raise error(web.HTTPInternalServerError, "internal error; see the orchestrator's log") from None
    finally:
        metrics.requests.labels(route, request.method, str(status)).inc()
        metrics.latency.labels(route).observe(time.perf_counter() - started)


def _fatal(app: web.Application, exc: BaseException) -> None:
    app[METRICS].journal_failed.set(1)
    callbacks, app[ON_FATAL][:] = list(app[ON_FATAL]), []
    for callback in callbacks:
        callback(exc)


@web.middleware
async def auth_middleware(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    matched = _route_of(request)
    allowed = matched[1] if matched is not None else None
    if allowed is not None:
        header = request.headers.get("Authorization", "")
        scheme, _, token = header.partition(" ")
        identity = request.app[TOKENS].identify(token.strip()) if scheme == "Bearer" and token.strip() else None
        if identity is None:
            raise error(web.HTTPUnauthorized, "missing or unknown bearer token (Authorization: Bearer TOKEN)")
        if identity.role not in allowed:
            raise error(web.HTTPForbidden, f"role {identity.role!r} may not call {request.path}; needs {allowed}")
        wait = request.app[LIMITER].check(identity.name)
        if wait > 0:
            request.app[METRICS].rate_limited.labels(identity.name).inc()
            raise error(
                web.HTTPTooManyRequests,
                f"token {identity.name!r} is over its rate limit of {request.app[LIMITER].rate_per_s:g} requests/s",
                retry_after=wait,
            )
        request[IDENTITY] = identity
    return await handler(request)


# -- handlers -----------------------------------------------------------------------------


async def info(request: web.Request) -> web.Response:
    state = request.app[STATE]
    return respond(
        request,
        RunInfo(
            run_name=state.config.run_name,
            store_url=request.app[STORE_URL],
            policy_version=state.published_version,
            max_staleness=state.config.max_staleness,
            group_size=state.config.group_size,
            episode_task=state.config.task.model_dump() if isinstance(state.task, EpisodeTask) else None,
        ),
    )


async def leases(request: web.Request) -> web.Response:
    body = await parse_body(request, LeaseRequest)
    state = request.app[STATE]
    if state.integrity.is_banned(request[IDENTITY].name):  # a token from DECENTRL_TOKENS outlives its ban
        raise error(web.HTTPForbidden, f"token {request[IDENTITY].name!r} is banned (docs/security.md)")
    holder, wait_s = holder_of(request, body.worker_id), state.config.orchestrator.lease_wait_s
    # Long-poll: with nothing to grant, wait for a version, a served batch or a release to free
    # groups, so a worker's slots start the moment the staleness budget allows and do not poll.
    freed = request.app[LEASES_FREED]
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    async with freed:
        while not (granted := state.grant_leases(holder, body.max_groups)):
            remaining = deadline - loop.time()
            if remaining <= 0:
                break
            with contextlib.suppress(asyncio.TimeoutError):  # every 0.5 s at least: leases expire unannounced
                await asyncio.wait_for(freed.wait(), timeout=min(remaining, 0.5))
    await commit(request)
    return respond(
        request,
        LeaseResponse(
            policy_version=state.published_version,
            sampling=state.sampling,
            leases=granted,
            retry_after_s=0.0 if granted or wait_s > 0 else 0.2,
        ),
    )


async def notify_all(condition: asyncio.Condition) -> None:
    async with condition:
        condition.notify_all()


def _lease_error(exc: LeaseError) -> web.HTTPException:
    kinds: dict[int, type[web.HTTPException]] = {403: web.HTTPForbidden, 404: web.HTTPNotFound, 409: web.HTTPConflict}
    return error(kinds[exc.status], str(exc))


async def _on_lease(request: web.Request, operation: Callable[[RunState, str, str], BaseModel]) -> web.Response:
    """`operation(state, lease_id, holder)` on the route's lease; what it changed is committed
    before the answer (a read commits nothing, and answers with only committed state)."""
    holder = query_worker(request)
    try:
        answer = operation(request.app[STATE], request.match_info["lease_id"], holder)
    except LeaseError as exc:
        raise _lease_error(exc) from None
    await commit(request)
    return respond(request, answer)


async def lease_get(request: web.Request) -> web.Response:
    return await _on_lease(request, RunState.lease_state)


async def lease_renew(request: web.Request) -> web.Response:
    return await _on_lease(request, RunState.renew_lease)


async def lease_release(request: web.Request) -> web.Response:
    answer = await _on_lease(request, RunState.release_lease)
    await notify_all(request.app[LEASES_FREED])
    return answer


async def rollouts(request: web.Request) -> web.Response:
    app = request.app
    state = app[STATE]
    inflight = app[INFLIGHT]
    if inflight[0] >= state.config.orchestrator.max_inflight_requests:
        app[METRICS].backpressure.labels("inflight").inc()
        raise error(web.HTTPServiceUnavailable, "too many rollout posts in flight; retry shortly", retry_after=1)
    if state.buffer_full():
        app[METRICS].backpressure.labels("buffer_full").inc()
        raise error(
            web.HTTPServiceUnavailable,
            f"the buffer holds {len(state.ready)} groups (limit {state.buffer_limit}) waiting for the trainer; retry later",
            retry_after=2,
        )
    inflight[0] += 1
    try:
        raw: list[Any] = []
        body = await parse_body(request, RolloutBatch, raw)
        first = body.rollouts[0]
        if any(r.worker_id != first.worker_id for r in body.rollouts):
            raise error(web.HTTPBadRequest, "all rollouts of one request must carry the same worker_id")
        if any(r.run_name != state.config.run_name for r in body.rollouts):
            raise error(
                web.HTTPConflict,
                f"this orchestrator serves run {state.config.run_name!r}; rollouts name run "
                f"{next(r.run_name for r in body.rollouts if r.run_name != state.config.run_name)!r}",
            )
        ready_before = len(state.ready)
        packed = packed_arrays(raw[0]) if raw else None
        result = state.ingest(body.rollouts, holder_of(request, first.worker_id), packed=packed)
        enforce_bans(app)
        await commit(request)
    finally:
        inflight[0] -= 1
    metrics, name = app[METRICS], request[IDENTITY].name
    if result.accepted:
        metrics.worker_rollouts.labels(name, "accepted").inc(result.accepted)
    if result.duplicates:
        metrics.worker_rollouts.labels(name, "duplicate").inc(result.duplicates)
    if result.rejected:
        metrics.worker_rollouts.labels(name, "rejected").inc(len(result.rejected))
    if len(state.ready) > ready_before:
        await notify_all(app[BATCH_READY])
    if result.rejected:  # a rejected sample may have dropped its group, freeing its place
        await notify_all(app[LEASES_FREED])
    return respond(request, result)


async def batch(request: web.Request) -> web.StreamResponse:
    trainer_version = query_int(request, "trainer_version")
    request_id = request.query.get("request_id")
    if request_id is not None and not REQUEST_ID.fullmatch(request_id):
        raise error(web.HTTPBadRequest, f"query parameter request_id must match {REQUEST_ID.pattern}")
    state = request.app[STATE]
    ready = request.app[BATCH_READY]
    loop = asyncio.get_running_loop()
    deadline = loop.time() + state.config.orchestrator.batch_wait_s
    async with ready:
        while (served := state.take_batch(trainer_version, request_id)) is None:
            remaining = deadline - loop.time()
            if remaining <= 0:
                return web.Response(status=204)
            with contextlib.suppress(asyncio.TimeoutError):  # not the builtin before Python 3.11
                await asyncio.wait_for(ready.wait(), timeout=min(remaining, 1.0))
    await commit(request)
    await notify_all(request.app[LEASES_FREED])  # the buffer has room again
    histogram = request.app[METRICS].staleness
    for lag, count in served.staleness_histogram.items():
        for _ in range(count):
            histogram.observe(int(lag))
    if wants_msgpack(request) and (body := state.batch_msgpack(served)) is not None:
        return web.Response(body=body, content_type=MEDIA_MSGPACK)
    return respond(request, served)


async def version(request: web.Request) -> web.Response:
    body = await parse_body(request, VersionAnnouncement)
    state = request.app[STATE]
    state.announce(body.version)
    await commit(request)
    await notify_all(request.app[LEASES_FREED])  # the staleness budget grows by a step's groups
    log.info("version %d published", body.version)
    return respond(request, run_status(request.app))


def run_status(app: web.Application) -> StatusResponse:
    found = app[STATE].status()
    if VERIFIER in app:
        found.verification = app[VERIFIER].summary()
    return found


async def status(request: web.Request) -> web.Response:
    return respond(request, run_status(request.app))


async def tokens_list(request: web.Request) -> web.Response:
    entries = [TokenEntry(name=n, role=r, source=s) for n, r, s in request.app[TOKENS].entries()]  # type: ignore[arg-type]
    return respond(request, TokenList(tokens=sorted(entries, key=lambda e: e.name)))


async def tokens_create(request: web.Request) -> web.Response:
    body = await parse_body(request, TokenCreate)
    try:
        token = request.app[TOKENS].create(body.name, body.role)
    except ValueError as exc:
        raise error(web.HTTPConflict, str(exc)) from None
    log.info("token %r (%s) created by %r", body.name, body.role, request[IDENTITY].name)
    return respond(request, TokenCreated(name=body.name, role=body.role, token=token), status=201)


async def tokens_revoke(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    if name == request[IDENTITY].name:
        raise error(web.HTTPConflict, "an admin token cannot revoke itself; use another admin token")
    registry = request.app[TOKENS]
    entry = next(((n, r, s) for n, r, s in registry.entries() if n == name), None)
    try:
        removed = registry.revoke(name)
    except PermissionError as exc:
        raise error(web.HTTPConflict, str(exc)) from None
    if not removed or entry is None:
        raise error(web.HTTPNotFound, f"no token named {name!r}")
    log.info("token %r revoked by %r", name, request[IDENTITY].name)
    return respond(request, TokenEntry(name=entry[0], role=entry[1], source=entry[2]))  # type: ignore[arg-type]


async def metrics(request: web.Request) -> web.Response:
    return web.Response(body=request.app[METRICS].render(), headers={"Content-Type": METRICS_CONTENT_TYPE})


async def openapi(request: web.Request) -> web.Response:
    return web.json_response(request.app[OPENAPI])


async def healthz(request: web.Request) -> web.Response:
    journal = request.app[STATE].journal
    ok = journal.failed is None
    return web.Response(
        text=Health(ok=ok, journal=journal.durable).model_dump_json(), status=200 if ok else 503,
        content_type=MEDIA_JSON,
    )


async def status_page(request: web.Request) -> web.Response:
    rows = "".join(
        f"<tr><th>{k}</th><td>{v}</td></tr>" for k, v in run_status(request.app).model_dump().items()
    )
    html = f"<html><head><title>decentrl</title><meta http-equiv='refresh' content='2'></head><body><h1>decentrl orchestrator</h1><table>{rows}</table></body></html>"
    return web.Response(text=html, content_type="text/html")


# -- the route table ----------------------------------------------------------------------

P = API_PREFIX
LEASE_ID = Param("lease_id", "path", {"type": "string", "maxLength": 128}, "A lease id from POST /v1/leases.")
WORKER_Q = Param("worker_id", "query", {"type": "string", "pattern": WORKER_ID}, "The worker id that leased it.")
ROUTES: list[tuple[RouteSpec, Callable[[web.Request], Awaitable[web.StreamResponse]]]] = [
    (RouteSpec("GET", f"{P}/info", "What a worker needs to join: run, store URL, newest version.", ANY,
               answers={200: RunInfo}, msgpack=True), info),
    (RouteSpec("GET", f"{P}/status", "Run counters for progress displays.", ANY,
               answers={200: StatusResponse}, msgpack=True), status),
    (RouteSpec("POST", f"{P}/leases", "Lease prompt groups; with none due, waits up to lease_wait_s for one (then empty).", ("worker",),
               body=LeaseRequest, answers={200: LeaseResponse}, msgpack=True, tag="worker"), leases),
    (RouteSpec("GET", f"{P}/leases/{{lease_id}}", "Where one of my leases stands.", ("worker",),
               params=(LEASE_ID, WORKER_Q), answers={200: LeaseState}, errors=(404,), msgpack=True, tag="worker"), lease_get),
    (RouteSpec("POST", f"{P}/leases/{{lease_id}}/renew", "Push my open lease's deadline lease_timeout_s from now.",
               ("worker",), params=(LEASE_ID, WORKER_Q), answers={200: Lease}, errors=(404, 409), msgpack=True,
               tag="worker"), lease_renew),
    (RouteSpec("DELETE", f"{P}/leases/{{lease_id}}", "Give my open lease back; its prompt is leased again first.",
               ("worker",), params=(LEASE_ID, WORKER_Q), answers={200: LeaseState}, errors=(404, 409), msgpack=True,
               tag="worker"), lease_release),
    (RouteSpec("POST", f"{P}/rollouts", "Post samples; each is accepted, a duplicate, or rejected with a reason.",
               ("worker",), body=RolloutBatch, answers={200: IngestResponse}, errors=(409,), msgpack=True,
               tag="worker"), rollouts),
    (RouteSpec("GET", f"{P}/batch", "Long-poll for the next batch of fresh groups (204 if none within batch_wait_s).",
               ("trainer",), params=(
                   Param("trainer_version", "query", {"type": "integer", "minimum": 0, "maximum": MAX_VERSION},
                         "The version the trainer holds (the step about to run starts from it)."),
                   Param("request_id", "query", {"type": "string", "pattern": REQUEST_ID.pattern},
                         "Idempotency key: asking again with it returns the same batch.", required=False),
               ), answers={200: TrainBatch, 204: None}, msgpack=True, tag="trainer"), batch),
    (RouteSpec("POST", f"{P}/version", "Announce a version complete in the store.", ("trainer",),
               body=VersionAnnouncement, answers={200: StatusResponse}, msgpack=True, tag="trainer"), version),
    (RouteSpec("GET", f"{P}/admin/tokens", "Token names, roles and sources (never the tokens).", ("admin",),
               answers={200: TokenList}, tag="admin"), tokens_list),
    (RouteSpec("POST", f"{P}/admin/tokens", "Create a token (written to the tokens file).", ("admin",),
               body=TokenCreate, answers={201: TokenCreated}, errors=(409,), tag="admin"), tokens_create),
    (RouteSpec("DELETE", f"{P}/admin/tokens/{{name}}", "Revoke a token; the next request with it gets 401.", ("admin",),
               params=(Param("name", "path", {"type": "string", "pattern": TOKEN_NAME}, "The token's name."),),
               answers={200: TokenEntry}, errors=(404, 409), tag="admin"), tokens_revoke),
    (RouteSpec("GET", "/metrics", "Prometheus metrics (text format 0.0.4).", ("trainer", "admin"),
               answers={200: METRICS_CONTENT_TYPE}, tag="ops"), metrics),
    (RouteSpec("GET", "/openapi.json", "This description.", None, answers={200: MEDIA_JSON}, tag="ops"), openapi),
    (RouteSpec("GET", "/healthz", "Liveness: 503 once the journal has failed.", None,
               answers={200: Health}, tag="ops"), healthz),
    (RouteSpec("GET", "/", "A small HTML status page.", None, answers={200: "text/html"}, tag="ops"), status_page),
]


def route_specs(*, metrics_public: bool = False) -> list[RouteSpec]:
    specs = [spec for spec, _ in ROUTES]
    if metrics_public:
        specs = [dataclasses.replace(s, roles=None) if s.path == "/metrics" else s for s in specs]
    return specs


def openapi_spec(*, metrics_public: bool = False) -> dict[str, Any]:
    """The OpenAPI document an app serves at /openapi.json."""
    return build_openapi(
        route_specs(metrics_public=metrics_public),
        title="decentrl orchestrator",
        version=decentrl.__version__,
        description="Leases prompts to inference workers, ingests and scores their rollouts, serves batches to "
        "the trainer. Bodies: JSON or msgpack (typed arrays for token ids and logprobs), optionally gzip. "
        "See docs/api.md.",
    )


async def _upkeep(app: web.Application) -> AsyncIterator[None]:
    """Start the journal's writer; every half second expire leases and forget old ones."""
    state = app[STATE]
    if state.journal is not None:
        state.journal.on_commit = app[METRICS].on_commit
        state.journal.start(asyncio.get_running_loop())

    async def loop() -> None:
        while True:
            await asyncio.sleep(0.5)
            try:
                state.expire_leases()
                state.forget_closed()
                if state.journal is not None:
                    await state.journal.commit()
            except JournalError as exc:
                log.critical("journal failed: %s", exc)
                _fatal(app, exc)
                return
            except Exception:  # a bug here must not stop lease expiry for good
                log.exception("lease upkeep failed; trying again")

    task = asyncio.create_task(loop())
    yield
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    if state.journal is not None:
        await state.journal.stop()


def enforce_bans(app: web.Application) -> None:
    """Revoke the tokens banned since the last call (orchestrator/integrity.py) and drop what
    they left waiting; their next request gets 401."""
    state = app[STATE]
    for name in state.integrity.newly_banned():
        dropped = state.drop_banned(name)
        try:
            app[TOKENS].revoke(name)
        except PermissionError as exc:  # an environment token: only its operator can remove it
            log.error("worker token %r is banned but cannot be revoked here (%s); its rollouts are refused", name, exc)
        log.warning("worker token %r banned after %d strikes; %d of its samples dropped", name,
                    state.integrity.workers[name].strikes, dropped)


def next_checks(state: RunState, limit: int) -> list[VerifyJob]:
    """The held-back groups to check together, taken off `state.verify_queue`: whole groups, oldest
    first, up to `limit` rollouts (at least one group). A token none of whose checks has passed yet
    (a new worker, or a cheater) gets one group in per batch: its first verdict bans a cheater
    before the rest of what it posted costs a forward (drop_banned then drops it unchecked)."""
    taken: list[VerifyJob] = []
    left: deque[VerifyJob] = deque()
    rollouts, unproven = 0, set()
    for job in state.verify_queue:
        token = token_of(job.holder)
        first = not state.integrity.has_passed_check(job.holder)
        if (taken and rollouts + len(job.rollouts) > limit) or (first and token in unproven):
            left.append(job)
            continue
        if first:
            unproven.add(token)
        taken.append(job)
        rollouts += len(job.rollouts)
    state.verify_queue = left
    return taken


def checks_due(state: RunState) -> bool:
    """Whether the trainer's next batch waits for a held-back group (RunState.held_back_ahead)
    and a batch's worth of groups is complete: then check at once. Until then a check may wait
    for others to share its forward at no cost to the trainer, which could not take a batch
    sooner anyway."""
    wanted = state.config.trainer.groups_per_step
    return len(state.ready) + len(state.pending) >= wanted and state.held_back_ahead(wanted)


async def _verification(app: web.Application) -> AsyncIterator[None]:
    """The logprob spot-checks: held-back groups are checked on one worker thread, off the event
    loop, many at a time (a group waits up to `check_wait_s` for others to share its forward);
    results go back to RunState, bans are enforced at once."""
    if VERIFIER not in app:
        yield
        return
    import concurrent.futures

    state, verifier = app[STATE], app[VERIFIER]
    options = state.config.orchestrator.verification
    executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="verifier")

    def warm_up() -> None:
        try:
            verifier.warm_up()
        except Exception:  # the first check then loads what it needs itself
            log.exception("verifier warm-up failed")

    executor.submit(warm_up)  # imports and model builds, before the first check needs them

    async def loop() -> None:
        running = asyncio.get_running_loop()
        waiting_since: float | None = None  # when the oldest job still queued was first seen
        while True:
            if not state.verify_queue:
                waiting_since = None
                await asyncio.sleep(0.05)
                continue
            now = running.time()
            waiting_since = now if waiting_since is None else waiting_since
            queued = sum(len(job.rollouts) for job in state.verify_queue)
            waited = now - waiting_since
            if not checks_due(state) and queued < options.check_batch_rollouts and waited < options.check_wait_s:
                await asyncio.sleep(0.05)
                continue
            jobs = next_checks(state, options.check_batch_rollouts)
            if not state.verify_queue:
                waiting_since = None  # else what is left waited as long: it goes next, at once
            jobs = [job for job in jobs if job.lease_id in state.pending]  # not dropped meanwhile (a ban)
            if not jobs:
                continue
            rollouts = [rollout for job in jobs for rollout in job.rollouts]
            try:
                failed = await running.run_in_executor(executor, verifier.check, rollouts)
            except Exception:  # a bug must not hold groups back for good: they are dropped, unjudged
                log.exception("verification failed; dropping %d groups unjudged", len(jobs))
                failed = {rollout.rollout_id: "unverifiable" for rollout in rollouts}
            for job in jobs:
                state.verification_done(
                    job.lease_id, {r.rollout_id: failed[r.rollout_id] for r in job.rollouts if r.rollout_id in failed}
                )
            enforce_bans(app)
            if state.journal is not None:
                await state.journal.commit()
            # A batch may form now: groups joined the buffer, or a held-back group it waited for
            # was dropped (which also frees its place for a new lease).
            await notify_all(app[BATCH_READY])
            await notify_all(app[LEASES_FREED])

    task = asyncio.create_task(loop())
    yield
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    executor.shutdown(wait=True)


def tune_gc() -> None:
    """Fewer cyclic garbage collections for a long-running service.

    The buffer holds many container objects (token lists) that are never part of a cycle, and
    every full collection walks all of them: freeze what startup built and collect less often
    (about a tenth less CPU per rollout under load). Called by `decentrl orchestrator`.
    """
    import gc

    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 50, 100)


def create_app(
    *,
    state: RunState,
    tokens: TokenRegistry,
    store_url: str,
    on_fatal: Callable[[BaseException], Any] | None = None,
    verifier: Verifier | None = None,
) -> web.Application:
    """The orchestrator's app. `on_fatal` is called (once per failure) when the journal fails.
    `verifier` runs the logprob spot-checks; required when orchestrator.verification.enabled."""
    options = state.config.orchestrator
    app = web.Application(
        middlewares=[errors_middleware, auth_middleware], client_max_size=options.max_request_bytes
    )
    app[STATE] = state
    app[TOKENS] = tokens
    app[STORE_URL] = store_url
    app[BATCH_READY] = asyncio.Condition()
    app[LEASES_FREED] = asyncio.Condition()
    app[METRICS] = Metrics(state)
    app[LIMITER] = RateLimiter(options.rate_limit_per_s, options.rate_limit_burst)
    app[INFLIGHT] = [0]
    app[ON_FATAL] = [on_fatal] if on_fatal is not None else []
    specs = route_specs(metrics_public=options.metrics_public)
    app[ROUTE_ROLES] = {(s.method, s.path): s.roles for s in specs}
    app[OPENAPI] = openapi_spec(metrics_public=options.metrics_public)
    if options.verification.enabled:
        if verifier is None:
            raise ValueError("orchestrator.verification.enabled needs a Verifier (orchestrator/verify.py)")
        app[VERIFIER] = verifier
    app.cleanup_ctx.append(_upkeep)
    app.cleanup_ctx.append(_verification)
    for spec, handler in ROUTES:
        app.router.add_route(spec.method, spec.path, handler)
    return app
