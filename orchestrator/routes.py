"""The orchestrator's route table: every route, who may call it, its body and answers.

One table (ROUTES) registers the handlers (`add_routes`, called by create_app), tells the auth
middleware each route's roles (`route_roles`), and generates /openapi.json (`openapi_spec`, with
orchestrator/openapi.py), so the three cannot drift apart. docs/api.md is the reference for
clients. In short:

  GET    /v1/info                    any token  what a worker needs to join
  GET    /v1/status                  any token  counters, for progress displays
  POST   /v1/leases                  worker     lease prompt groups, learn the newest version
  GET    /v1/leases/{lease_id}       worker     where one of my leases stands
  POST   /v1/leases/{lease_id}/renew worker     push my lease's deadline out (slow generation)
  DELETE /v1/leases/{lease_id}       worker     give my lease back (its prompt goes out again)
  POST   /v1/rollouts                worker     post samples; per-rollout accept/reject
  POST   /v1/score/leases            scorer     lease samples to score (model rewards, docs/rewards.md)
  POST   /v1/score/leases/{lease_id}/renew  scorer  push my score lease's deadline out
  POST   /v1/scores                  scorer     post scores; all taken, or none with a reason
  GET    /v1/batch                   trainer    long-poll for the next fresh batch (204 if none in time)
  POST   /v1/version                 trainer    announce a version complete in the store
  POST   /v1/trainer/steps           trainer    one step's metrics, for the dashboard
  GET    /v1/dashboard               any token (or none: metrics_public)  curves, workers, samples
  GET    /v1/admin/tokens            admin      token names and roles
  POST   /v1/admin/tokens            admin      create a token
  DELETE /v1/admin/tokens/{name}     admin      revoke a token, at once
  GET    /metrics                    trainer, admin (or none: metrics_public)  Prometheus text
  GET    /openapi.json, /healthz, /  none       (/ is the dashboard page, which holds no data)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

import decentrl
from decentrl.api.encoding import MEDIA_JSON
from decentrl.api.wire import (
    API_PREFIX,
    MAX_VERSION,
    TOKEN_NAME,
    WORKER_ID,
    Health,
    IngestResponse,
    Lease,
    LeaseRequest,
    LeaseResponse,
    LeaseState,
    RolloutBatch,
    RunInfo,
    ScoreAck,
    ScoreLease,
    ScoreLeaseRequest,
    ScorePost,
    ScoreRenewal,
    StatusResponse,
    TokenCreate,
    TokenCreated,
    TokenEntry,
    TokenList,
    TrainBatch,
    TrainerStep,
    VersionAnnouncement,
)
from orchestrator import dashboard, handlers, score_handlers
from orchestrator.appstate import RouteRoles
from orchestrator.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from orchestrator.openapi import Endpoint, Param, build_openapi

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

ANY = ("worker", "trainer", "scorer", "admin")
P = API_PREFIX
LEASE_ID = Param("lease_id", "path", {"type": "string", "maxLength": 128}, "A lease id from POST /v1/leases.")
WORKER_Q = Param("worker_id", "query", {"type": "string", "pattern": WORKER_ID}, "The worker id that leased it.")
ROUTES: list[tuple[Endpoint, Handler]] = [
    (Endpoint("GET", f"{P}/info", "What a worker needs to join: run, store URL, newest version.", ANY,
               answers={200: RunInfo}, msgpack=True), handlers.info),
    (Endpoint("GET", f"{P}/status", "Run counters for progress displays.", ANY,
               answers={200: StatusResponse}, msgpack=True), handlers.status),
    (Endpoint("POST", f"{P}/leases", "Lease prompt groups; with none due, waits up to lease_wait_s for one (then empty).", ("worker",),
               body=LeaseRequest, answers={200: LeaseResponse}, msgpack=True, tag="worker"), handlers.leases),
    (Endpoint("GET", f"{P}/leases/{{lease_id}}", "Where one of my leases stands.", ("worker",),
               params=(LEASE_ID, WORKER_Q), answers={200: LeaseState}, errors=(404,), msgpack=True, tag="worker"),
     handlers.lease_get),
    (Endpoint("POST", f"{P}/leases/{{lease_id}}/renew", "Push my open lease's deadline lease_timeout_s from now.",
               ("worker",), params=(LEASE_ID, WORKER_Q), answers={200: Lease}, errors=(404, 409), msgpack=True,
               tag="worker"), handlers.lease_renew),
    (Endpoint("DELETE", f"{P}/leases/{{lease_id}}", "Give my open lease back; its prompt is leased again first.",
               ("worker",), params=(LEASE_ID, WORKER_Q), answers={200: LeaseState}, errors=(404, 409), msgpack=True,
               tag="worker"), handlers.lease_release),
    (Endpoint("POST", f"{P}/rollouts", "Post samples; each is accepted, a duplicate, or rejected with a reason.",
               ("worker",), body=RolloutBatch, answers={200: IngestResponse}, errors=(409,), msgpack=True,
               tag="worker"), handlers.rollouts),
    (Endpoint("POST", f"{P}/score/leases",
               "Lease samples to score; with none waiting, waits up to lease_wait_s for some (then empty).",
               ("scorer",), body=ScoreLeaseRequest, answers={200: ScoreLease}, msgpack=True, tag="scorer"),
     score_handlers.score_leases),
    (Endpoint("POST", f"{P}/score/leases/{{lease_id}}/renew", "Push my score lease's deadline rewards.lease_timeout_s from now.",
               ("scorer",), params=(
                   Param("lease_id", "path", {"type": "string", "maxLength": 128}, "A lease id from POST /v1/score/leases."),
                   Param("scorer_id", "query", {"type": "string", "pattern": WORKER_ID}, "The scorer id that leased it."),
               ), answers={200: ScoreRenewal}, errors=(403, 404, 409), msgpack=True, tag="scorer"),
     score_handlers.score_renew),
    (Endpoint("POST", f"{P}/scores",
               "Post scores for items of my score lease: all taken (a resend counted as duplicate), or none with a reason.",
               ("scorer",), body=ScorePost, answers={200: ScoreAck}, errors=(403, 404, 409), msgpack=True, tag="scorer"),
     score_handlers.scores),
    (Endpoint("GET", f"{P}/batch", "Long-poll for the next batch of fresh groups (204 if none within batch_wait_s).",
               ("trainer",), params=(
                   Param("trainer_version", "query", {"type": "integer", "minimum": 0, "maximum": MAX_VERSION},
                         "The version the trainer holds (the step about to run starts from it); at most trainer.steps."),
                   Param("request_id", "query", {"type": "string", "pattern": handlers.REQUEST_ID.pattern},
                         "Idempotency key: asking again with it returns the same batch.", required=False),
               ), answers={200: TrainBatch, 204: None}, msgpack=True, tag="trainer"), handlers.batch),
    (Endpoint("POST", f"{P}/version", "Announce a version complete in the store.", ("trainer",),
               body=VersionAnnouncement, answers={200: StatusResponse}, errors=(409,), msgpack=True, tag="trainer"),
     handlers.version),
    (Endpoint("GET", f"{P}/admin/tokens", "Token names, roles and sources (never the tokens).", ("admin",),
               answers={200: TokenList}, tag="admin"), handlers.tokens_list),
    (Endpoint("POST", f"{P}/admin/tokens", "Create a token (written to the tokens file).", ("admin",),
               body=TokenCreate, answers={201: TokenCreated}, errors=(409,), tag="admin"), handlers.tokens_create),
    (Endpoint("DELETE", f"{P}/admin/tokens/{{name}}", "Revoke a token; the next request with it gets 401.", ("admin",),
               params=(Param("name", "path", {"type": "string", "pattern": TOKEN_NAME}, "The token's name."),),
               answers={200: TokenEntry}, errors=(404, 409), tag="admin"), handlers.tokens_revoke),
    (Endpoint("GET", "/metrics", "Prometheus metrics (text format 0.0.4).", ("trainer", "admin"),
               answers={200: METRICS_CONTENT_TYPE}, tag="ops"), handlers.metrics),
    (Endpoint("GET", "/openapi.json", "This description.", None, answers={200: MEDIA_JSON}, tag="ops"), handlers.openapi),
    (Endpoint("GET", "/healthz", "Liveness: 503 once the journal has failed.", None,
               answers={200: Health}, tag="ops"), handlers.healthz),
    (Endpoint("POST", f"{P}/trainer/steps", "One optimizer step's metrics, for the dashboard.", ("trainer",),
               body=TrainerStep, answers={200: MEDIA_JSON}, msgpack=True, tag="trainer"), dashboard.trainer_steps),
    (Endpoint("GET", f"{P}/dashboard", "The run's curves, workers and recent samples since `since` (the page's poll).",
               ANY, params=(Param("since", "query", {"type": "number", "minimum": 0, "maximum": dashboard.MAX_SINCE},
                                  "Time stamp of the last poll: only newer points come back.", required=False),),
               answers={200: MEDIA_JSON}, tag="ops"), dashboard.dashboard),
    (Endpoint("GET", "/", "The live dashboard page (its script polls /v1/dashboard).", None,
               answers={200: "text/html"}, tag="ops"), dashboard.page),
]


# Read-only views of the run that `orchestrator.metrics_public` opens to callers without a token.
PUBLIC_WITH_METRICS = ("/metrics", f"{P}/dashboard")


def route_specs(*, metrics_public: bool = False) -> list[Endpoint]:
    """The routes as served: with `metrics_public`, /metrics and /v1/dashboard need no token."""
    specs = [spec for spec, _ in ROUTES]
    if metrics_public:
        specs = [dataclasses.replace(s, roles=None) if s.path in PUBLIC_WITH_METRICS else s for s in specs]
    return specs


def route_roles(*, metrics_public: bool = False) -> RouteRoles:
    """(method, route template) -> the roles that may call it (None: no token), for the auth middleware."""
    return {(s.method, s.path): s.roles for s in route_specs(metrics_public=metrics_public)}


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


def add_routes(app: web.Application) -> None:
    for spec, handler in ROUTES:
        app.router.add_route(spec.method, spec.path, handler)
