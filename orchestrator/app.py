"""The orchestrator service: its route table, its aiohttp app, and the process that serves it.

`decentrl orchestrator` runs `serve`; tests and benchmarks serve `create_app` with
OrchestratorRunner. ROUTES is the one list of routes, who may call each, its body and answers: it
registers the handlers, gives the auth middleware each route's roles and generates /openapi.json,
so the three cannot drift apart. A full journal disk is answered 503 while it lasts; any other
journal failure stops the process, and a restart recovers.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import logging
import os
import signal
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

from aiohttp import web

import decentrl
from decentrl.api import wire
from decentrl.api.encoding import MEDIA_JSON
from decentrl.api.wire import API_PREFIX, MAX_VERSION, MAX_VERSION_WAIT_S, TOKEN_NAME, WORKER_ID
from decentrl.config import RunConfig
from decentrl.model.build import build_model, load_text_tokenizer, publish_dtype_name
from decentrl.store.checkpoints import CheckpointStore
from decentrl.tasks import build_task
from orchestrator import dashboard, handlers, score_handlers
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
    VERDICTS,
    VERIFIER,
    VERSION_PUBLISHED,
    IdleScorers,
    JournalFailed,
    commit,
    stop_waiting,
)
from orchestrator.auth import ENV_VAR, TokenRegistry
from orchestrator.body import OPTIONS
from orchestrator.checks import run_keeps_routing
from orchestrator.history import History
from orchestrator.journal import Journal, JournalError, JournalFull, JournalMismatch
from orchestrator.limits import InFlight, RateLimiter
from orchestrator.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from orchestrator.metrics import METRICS, Metrics
from orchestrator.middlewares import Handler, auth_middleware, errors_middleware
from orchestrator.openapi import Endpoint, Param, build_openapi
from orchestrator.protocol import OrchestratorRunner
from orchestrator.state import RunState
from orchestrator.verification import verification
from orchestrator.verify import Verifier

log = logging.getLogger("decentrl.orchestrator")

# -- the route table ----------------------------------------------------------------------


ANY = ("worker", "trainer", "scorer", "admin")
P = API_PREFIX
LEASE_ID = Param("lease_id", "path", {"type": "string", "maxLength": 128}, "A lease id from POST /v1/leases.")
WORKER_Q = Param("worker_id", "query", {"type": "string", "pattern": WORKER_ID}, "The worker id that leased it.")
SCORE_LEASE_ID = Param("lease_id", "path", {"type": "string", "maxLength": 128}, "A lease id from POST /v1/score/leases.")
SCORER_Q = Param("scorer_id", "query", {"type": "string", "pattern": WORKER_ID}, "The scorer id that leased it.")
ROUTES: list[tuple[Endpoint, Handler]] = [
    (Endpoint("GET", f"{P}/info", "What a worker needs to join: run, store URL, newest version.", ANY,
              answers={200: wire.RunInfo}, msgpack=True), handlers.info),
    (Endpoint("GET", f"{P}/status", "Run counters for progress displays.", ANY, answers={200: wire.StatusResponse}, msgpack=True),
     handlers.status),
    (Endpoint("POST", f"{P}/leases", "Lease prompt groups; with none due, waits up to lease_wait_s for one (then empty).", ("worker",),
              body=wire.LeaseRequest, answers={200: wire.LeaseResponse}, msgpack=True, tag="worker"), handlers.leases),
    (Endpoint("GET", f"{P}/leases/{{lease_id}}", "Where one of my leases stands.", ("worker",), params=(LEASE_ID, WORKER_Q),
              answers={200: wire.LeaseState}, errors=(404,), msgpack=True, tag="worker"), handlers.lease_get),
    (Endpoint("POST", f"{P}/leases/{{lease_id}}/renew", "Push my open lease's deadline lease_timeout_s from now.", ("worker",),
              params=(LEASE_ID, WORKER_Q), answers={200: wire.Lease}, errors=(404, 409), msgpack=True, tag="worker"),
     handlers.lease_renew),
    (Endpoint("DELETE", f"{P}/leases/{{lease_id}}", "Give my open lease back; its prompt is leased again first.", ("worker",),
              params=(LEASE_ID, WORKER_Q), answers={200: wire.LeaseState}, errors=(404, 409), msgpack=True, tag="worker"),
     handlers.lease_release),
    (Endpoint("POST", f"{P}/rollouts", "Post samples; each is accepted, a duplicate, or rejected with a reason.", ("worker",),
              body=wire.RolloutBatch, answers={200: wire.IngestResponse}, errors=(409,), msgpack=True, tag="worker"), handlers.rollouts),
    (Endpoint("POST", f"{P}/steps", "Post finished steps of samples of my tree lease still being generated, for scoring now.",
              ("worker",), body=wire.StepPost, answers={200: wire.StepAck}, errors=(403, 404, 409), msgpack=True, tag="worker"),
     handlers.steps),
    (Endpoint("GET", f"{P}/verdicts", "Long-poll for verdicts on my posted steps numbered after `after`.", ("worker",),
              params=(
                  WORKER_Q,
                  Param("after", "query", {"type": "integer", "minimum": 0, "maximum": 2**62},
                        "The newest verdict seq the caller has read (default 0).", required=False),
                  Param("wait_s", "query", {"type": "number", "minimum": 0, "maximum": MAX_VERSION_WAIT_S},
                        "Seconds to wait for one (default 0: answer at once).", required=False),
              ), answers={200: wire.VerdictList}, msgpack=True, tag="worker"), handlers.verdicts),
    (Endpoint("POST", f"{P}/score/leases", "Lease samples to score; with none waiting, waits up to lease_wait_s for some (then empty).",
              ("scorer",), body=wire.ScoreLeaseRequest, answers={200: wire.ScoreLease}, msgpack=True, tag="scorer"),
     score_handlers.score_leases),
    (Endpoint("POST", f"{P}/score/leases/{{lease_id}}/renew", "Push my score lease's deadline rewards.lease_timeout_s from now.",
              ("scorer",), params=(SCORE_LEASE_ID, SCORER_Q), answers={200: wire.ScoreRenewal}, errors=(403, 404, 409), msgpack=True,
              tag="scorer"), score_handlers.score_renew),
    (Endpoint("POST", f"{P}/scores",
              "Post scores for items of my score lease: all taken (a resend counted as duplicate), or none with a reason.", ("scorer",),
              body=wire.ScorePost, answers={200: wire.ScoreAck}, errors=(403, 404, 409), msgpack=True, tag="scorer"),
     score_handlers.scores),
    (Endpoint("GET", f"{P}/batch", "Long-poll for the next batch of fresh groups (204 if none within batch_wait_s).", ("trainer",),
              params=(
                  Param("trainer_version", "query", {"type": "integer", "minimum": 0, "maximum": MAX_VERSION},
                        "The version the trainer holds (the step about to run starts from it); at most trainer.steps."),
                  Param("request_id", "query", {"type": "string", "pattern": handlers.REQUEST_ID.pattern},
                        "Idempotency key: asking again with it returns the same batch.", required=False),
              ), answers={200: wire.TrainBatch, 204: None}, msgpack=True, tag="trainer"), handlers.batch),
    (Endpoint("POST", f"{P}/version", "Announce a version complete in the store.", ("trainer",), body=wire.VersionAnnouncement,
              answers={200: wire.StatusResponse}, errors=(409,), msgpack=True, tag="trainer"), handlers.version),
    (Endpoint("GET", f"{P}/version", "Long-poll for a version newer than `after`: at once if there is one, else when it is "
              "announced, else the newest (not newer) after wait_s.", ANY,
              params=(
                  Param("after", "query", {"type": "integer", "minimum": 0, "maximum": MAX_VERSION},
                        "The newest version the caller knows; without it, any published version will do.", required=False),
                  Param("wait_s", "query", {"type": "number", "minimum": 0, "maximum": MAX_VERSION_WAIT_S},
                        "Seconds to wait for a newer one (default 0: answer at once).", required=False),
              ), answers={200: wire.PublishedVersion}, msgpack=True), handlers.version_news),
    (Endpoint("GET", f"{P}/admin/tokens", "Token names, roles and sources (never the tokens).", ("admin",),
              answers={200: wire.TokenList}, tag="admin"), handlers.tokens_list),
    (Endpoint("POST", f"{P}/admin/tokens", "Create a token (written to the tokens file).", ("admin",), body=wire.TokenCreate,
              answers={201: wire.TokenCreated}, errors=(409,), tag="admin"), handlers.tokens_create),
    (Endpoint("DELETE", f"{P}/admin/tokens/{{name}}", "Revoke a token; the next request with it gets 401.", ("admin",),
              params=(Param("name", "path", {"type": "string", "pattern": TOKEN_NAME}, "The token's name."),),
              answers={200: wire.TokenEntry}, errors=(404, 409), tag="admin"), handlers.tokens_revoke),
    (Endpoint("GET", "/metrics", "Prometheus metrics (text format 0.0.4).", ("trainer", "admin"),
              answers={200: METRICS_CONTENT_TYPE}, tag="ops"), handlers.metrics),
    (Endpoint("GET", "/openapi.json", "This description.", None, answers={200: MEDIA_JSON}, tag="ops"), handlers.openapi),
    (Endpoint("GET", "/healthz", "Liveness: 503 once the journal has failed.", None, answers={200: wire.Health}, tag="ops"),
     handlers.healthz),
    (Endpoint("POST", f"{P}/trainer/steps", "One optimizer step's metrics, for the dashboard.", ("trainer",), body=wire.TrainerStep,
              answers={200: MEDIA_JSON}, msgpack=True, tag="trainer"), dashboard.trainer_steps),
    (Endpoint("GET", f"{P}/dashboard", "The run's curves, workers and recent samples since `since` (the page's poll).", ANY,
              params=(Param("since", "query", {"type": "number", "minimum": 0, "maximum": dashboard.MAX_SINCE},
                            "Time stamp of the last poll: only newer points come back.", required=False),),
              answers={200: MEDIA_JSON}, tag="ops"), dashboard.dashboard),
    (Endpoint("GET", "/", "The live dashboard page (its script polls /v1/dashboard).", None, answers={200: "text/html"}, tag="ops"),
     dashboard.page),
]


# Read-only views of the run that `orchestrator.metrics_public` opens to callers without a token.
PUBLIC_WITH_METRICS = ("/metrics", f"{P}/dashboard")


def route_specs(*, metrics_public: bool = False) -> list[Endpoint]:
    """The routes as served: with `metrics_public`, /metrics and /v1/dashboard need no token."""
    return [dataclasses.replace(s, roles=None) if metrics_public and s.path in PUBLIC_WITH_METRICS else s for s, _ in ROUTES]


def openapi_spec(*, metrics_public: bool = False) -> dict[str, Any]:
    return build_openapi(
        route_specs(metrics_public=metrics_public),
        title="decentrl orchestrator",
        version=decentrl.__version__,
        description="Leases prompts to inference workers, ingests and scores their rollouts, serves batches to "
        "the trainer. Bodies: JSON or msgpack (typed arrays for token ids and logprobs), optionally gzip. "
        "See docs/api.md.",
    )


# -- background upkeep, cleanup_ctx entries of the app ------------------------------------


UPKEEP_INTERVAL_S = 0.5  # at most this late does an overdue lease expire


async def journal_writer(app: web.Application) -> AsyncIterator[None]:
    journal = app[STATE].journal
    journal.on_commit = app[METRICS].on_commit
    journal.start(asyncio.get_running_loop())
    yield
    await journal.stop()


def in_background(run: Callable[[web.Application], Coroutine[Any, Any, None]]) -> Callable[[web.Application], AsyncIterator[None]]:
    async def entry(app: web.Application) -> AsyncIterator[None]:
        task = asyncio.create_task(run(app))
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    return entry


async def lease_upkeep(app: web.Application) -> None:
    """Every UPKEEP_INTERVAL_S, expire overdue leases, forget old closed ones, and commit."""
    state = app[STATE]
    while True:
        await asyncio.sleep(UPKEEP_INTERVAL_S)
        try:
            state.expire_leases()
            state.forget_closed()
            await commit(app)
        except JournalFull:  # logged by the journal; this loop's next commit writes it once space returns
            pass
        except JournalError as exc:
            log.critical("journal failed: %s", exc)
            app[JOURNAL_FAILED](exc)
            return
        except Exception:  # a bug here must not stop lease expiry for good
            log.exception("lease upkeep failed; trying again")


# -- the app ------------------------------------------------------------------------------


def create_app(*, state: RunState, tokens: TokenRegistry, store_url: str, on_fatal: Callable[[BaseException], Any] | None = None,
               verifier: Verifier | None = None, store: CheckpointStore | None = None) -> web.Application:
    """The orchestrator's app over `state`. `on_fatal` is called once when the journal fails;
    `verifier` is required with verification enabled; every announced version must exist in
    `store` (without one, as in unit tests, an announcement is taken on the trainer's word)."""
    options = state.config.orchestrator
    run_keeps_routing(state.config.model)  # a keep_routing the model cannot honour fails here, at start-up
    app = web.Application(
        middlewares=[errors_middleware, auth_middleware], client_max_size=options.max_request_bytes,
        # Bodies are decompressed by orchestrator/body.py (bounded, and a bad one is a 400). What
        # is left of a body refused unread (413, 401, 503) is discarded for at most 1 s, then the
        # connection closes: aiohttp's 10 s held a refused client's connection that long.
        handler_args={"auto_decompress": False, "lingering_time": 1.0},
    )
    app[STATE] = state
    app[OPTIONS] = options
    app[TOKENS] = tokens
    app[STORE_URL] = store_url
    app[METRICS] = metrics = Metrics(state)
    app[LIMITER] = RateLimiter(options.rate_limit_per_s, options.rate_limit_burst)
    app[INFLIGHT] = InFlight(options.max_inflight_requests, options.max_inflight_per_token)
    app[STORE] = store
    app[JOURNAL_FAILED] = JournalFailed(lambda: metrics.journal_failed.set(1), on_fatal)
    app[ROUTE_ROLES] = {(s.method, s.path): s.roles for s in route_specs(metrics_public=options.metrics_public)}
    app[OPENAPI] = openapi_spec(metrics_public=options.metrics_public)
    app[BATCH_READY] = asyncio.Condition()
    app[LEASES_FREED] = asyncio.Condition()
    app[VERSION_PUBLISHED] = asyncio.Condition()
    app[SCORES_WAITING] = asyncio.Condition()
    app[VERDICTS] = asyncio.Condition()
    app[IDLE_SCORERS] = IdleScorers()
    app[CHECKS_WANTED] = asyncio.Event()
    app[HISTORY] = History(clock=state.clock)
    app[STOPPING] = asyncio.Event()
    if options.verification.enabled:
        if verifier is None:
            raise ValueError("orchestrator.verification.enabled needs a Verifier (orchestrator/verify.py)")
        app[VERIFIER] = verifier
    # Set up in this order, torn down in reverse: the upkeep stops before the journal's writer.
    app.cleanup_ctx.append(journal_writer)
    app.cleanup_ctx.append(in_background(lease_upkeep))
    app.cleanup_ctx.append(verification)
    app.cleanup_ctx.append(in_background(dashboard.sample))
    app.on_shutdown.append(stop_waiting)  # long-polls answer at once: SIGTERM stops in well under 2 s
    for spec, handler in ROUTES:
        app.router.add_route(spec.method, spec.path, handler)
    return app


# -- the process: `decentrl orchestrator` -------------------------------------------------


STOP_S = 1.0  # the most a request may hold up a stop (SIGTERM ends the process within 2 s)


class StartupError(Exception):
    """The run directory or config cannot be served; the message says what to fix."""


def tune_gc() -> None:
    """Fewer cyclic garbage collections for a long-running service: freeze what startup built and
    collect less often (the buffer's many token lists are never part of a cycle)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 50, 100)


def open_tokens(run_dir: str, tokens_file: str | None) -> TokenRegistry:
    try:
        return TokenRegistry.from_file(tokens_file or os.path.join(run_dir, "tokens.json"), env=os.environ.get(ENV_VAR))
    except (FileNotFoundError, ValueError, KeyError) as exc:
        raise StartupError(str(exc)) from None


def open_state(config: RunConfig, run_dir: str) -> RunState:
    try:
        journal = None
        if config.orchestrator.journal:
            os.makedirs(run_dir, exist_ok=True)
            journal = Journal(
                os.path.join(run_dir, "journal.sqlite"), run_name=config.run_name, sync=config.orchestrator.journal_sync
            )
        return RunState(config=config, task=build_task(config.task), tokenizer=load_text_tokenizer(config.model),
                        journal=journal)
    except (JournalMismatch, JournalError, ValueError) as exc:
        raise StartupError(str(exc)) from None


def build_verifier(config: RunConfig, run_dir: str) -> Verifier | None:
    if not config.orchestrator.verification.enabled:
        return None
    if config.deterministic and (dtype := publish_dtype_name(config.store, config.model)) != "float32":
        raise StartupError(
            f"deterministic = true with orchestrator.verification re-draws every sampled token from its seed, which "
            f"{dtype} versions do not reproduce (13 of 32 honest completions of a real model were struck, "
            'docs/store.md): set store.publish_dtype = "fp32", or turn verification off'
        )
    return Verifier(
        config.orchestrator.verification, store=CheckpointStore.from_config(config.store, run_name=config.run_name),
        cache_dir=os.path.join(run_dir, "verifier-cache"), build=lambda: build_model(config.model),
        run_seed=config.seed if config.deterministic else None,
    )


async def _run(app: web.Application, host: str, port: int) -> None:
    """Serve `app` until SIGINT or SIGTERM, then stop within STOP_S: the long-polls answer at once
    (`stop_waiting`) and any other request still running is cancelled."""
    runner = OrchestratorRunner(app, access_log=None, shutdown_timeout=STOP_S)
    await runner.setup()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    try:
        await web.TCPSite(runner, host, port).start()
        log.info("serving on http://%s:%d", host, runner.addresses[0][1])
        await stop.wait()
        log.info("stopping")
    finally:
        await runner.cleanup()


def serve(config: RunConfig, *, run_dir: str, host: str | None = None, port: int | None = None,
          tokens_file: str | None = None) -> bool:
    """Serve the run until SIGINT or SIGTERM. Returns False when it stopped because the journal
    failed; raises StartupError when it cannot start. `config.store.url` must be resolved."""
    verifier = build_verifier(config, run_dir)  # first: it refuses a setting before anything opens
    tokens = open_tokens(run_dir, tokens_file)
    state = open_state(config, run_dir)
    failed: list[BaseException] = []

    def on_fatal(exc: BaseException) -> None:
        log.critical("journal failed (%s): shutting down so that a restart recovers from the journal", exc)
        failed.append(exc)
        os.kill(os.getpid(), signal.SIGTERM)

    tune_gc()
    app = create_app(
        state=state, tokens=tokens, store_url=config.store.url, on_fatal=on_fatal,
        verifier=verifier, store=CheckpointStore.from_config(config.store),
    )
    where = (host or config.orchestrator.host, config.orchestrator.port if port is None else port)
    import uvloop  # a dependency wherever this runs: not on Windows, where auth.py's fcntl is missing too

    loop = uvloop.new_event_loop()
    try:
        loop.run_until_complete(_run(app, *where))
    finally:
        loop.close()
    state.journal.close()
    return not failed
