"""The orchestrator's request handlers: thin, each validates, calls RunState, commits, answers.

Registered by the route table (orchestrator/app.py), which also says who may call each one;
the middlewares (orchestrator/middlewares.py) have authenticated the caller before a handler
runs. A handler that changes the run awaits the journal's commit before it answers
(orchestrator/journal.py), so an acknowledged rollout, lease or batch survives a crash, and then
wakes whoever may now proceed (orchestrator/appstate.py, "Wake-ups").
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Callable

from aiohttp import web
from pydantic import BaseModel

from decentrl.api.encoding import MEDIA_MSGPACK
from decentrl.api.wire import (
    MASK_IDS,
    MAX_VERSION,
    MAX_VERSION_WAIT_S,
    Health,
    LeaseRequest,
    LeaseResponse,
    PublishedVersion,
    RolloutBatch,
    RunInfo,
    SamplingParams,
    StepPost,
    TokenCreate,
    TokenCreated,
    TokenEntry,
    TokenList,
    VersionAnnouncement,
)
from decentrl.model.tokenizer import vocab_digest
from decentrl.store.checkpoints import StoreError, StoreUnreachable, policy_url
from decentrl.tasks.episodes import EpisodeTask
from orchestrator.appstate import (
    BATCH_READY,
    HISTORY,
    INFLIGHT,
    LEASES_FREED,
    OPENAPI,
    SCORES_WAITING,
    STATE,
    STORE,
    STORE_URL,
    TOKENS,
    VERDICTS,
    VERSION_PUBLISHED,
    commit,
    notify_all,
    run_status,
    wait_awhile,
    wake_checks,
)
from orchestrator.auth import IDENTITY
from orchestrator.body import (
    error,
    holder_of,
    only_query,
    parse_body,
    query_id,
    query_int,
    query_int_or_none,
    query_seconds,
    query_text,
    respond,
    wants_msgpack,
)
from orchestrator.checks import run_keeps_routing
from orchestrator.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from orchestrator.metrics import METRICS
from orchestrator.state import RunState

log = logging.getLogger("decentrl.orchestrator")

REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


def run_policy(state: RunState, policy: str | None, *, required: bool = True) -> str | None:
    """`policy` if it names one of a run of two policies (`required`: it must), None in a run of one; else a 400."""
    names = state.config.policies
    if policy is None and names and required:
        raise error(web.HTTPBadRequest, f"this run has two policies {list(names)}: name yours (policy; a worker's "
                                        "worker.policy, a trainer's trainer.policy)")
    if policy is not None and policy not in names:
        raise error(web.HTTPBadRequest, f"policy {policy[:40]!r} is not one of this run's: "
                                        + (f"name one of {list(names)}" if names else "it has one, shared: name none"))
    return policy


# -- workers ------------------------------------------------------------------------------


async def info(request: web.Request) -> web.Response:
    only_query(request, "policy")
    state = request.app[STATE]
    policy = run_policy(state, query_text(request, "policy"), required=False)
    return respond(
        request,
        RunInfo(
            run_name=state.config.run_name,
            store_url=policy_url(request.app[STORE_URL], policy),
            policy_version=state.stream(policy).published,
            policies=list(state.config.policies) or None,
            max_staleness=state.config.max_staleness,
            group_size=state.config.group_size,
            lease_timeout_s=state.config.orchestrator.lease_timeout_s,
            keep_routing=run_keeps_routing(state.config.model),
            episode_task=state.config.task.model_dump() if isinstance(state.task, EpisodeTask) else None,
            deterministic=state.config.deterministic,
            seed=state.config.seed,
            vocab_size=state.vocab_size,
            vocab_digest=vocab_digest(state.tokenizer) if state.config.orchestrator.advantages.distill is not None else None,
        ),
    )


async def version_news(request: web.Request) -> web.Response:
    """GET /v1/version: the newest version once it is newer than `after` (any version without it),
    or whatever it is when `wait_s` runs out or the orchestrator stops. A worker keeps one of these
    outstanding and so learns of a version as its announcement is committed, not a poll period later."""
    only_query(request, "after", "wait_s", "policy")
    after = query_int_or_none(request, "after", high=MAX_VERSION)
    wait_s = query_seconds(request, "wait_s", high=MAX_VERSION_WAIT_S, default=0.0)
    state, published = request.app[STATE], request.app[VERSION_PUBLISHED]
    stream = state.stream(run_policy(state, query_text(request, "policy"), required=False))
    deadline = asyncio.get_running_loop().time() + wait_s
    async with published:
        while (version := stream.published) is None or (after is not None and version <= after):
            if not await wait_awhile(request.app, published, deadline, wait_s):
                break
    return respond(request, PublishedVersion(policy_version=stream.published))


LEASE_RECHECK_S = 0.5  # a waiting lease request looks again at least this often (expiries wake no one)


async def leases(request: web.Request) -> web.Response:
    body = await parse_body(request, LeaseRequest)
    state = request.app[STATE]
    if state.integrity.is_banned(request[IDENTITY].name):  # a token from DECENTRL_TOKENS outlives its ban
        raise error(web.HTTPForbidden, f"token {request[IDENTITY].name!r} is banned (docs/security.md)")
    request.app[HISTORY].asked(request[IDENTITY].name, body.machine)
    holder, wait_s = holder_of(request, body.worker_id), state.config.orchestrator.lease_wait_s
    policy = run_policy(state, body.policy)
    # Long-poll: with nothing to grant, wait for a version, a served batch or a release to free
    # groups, so a worker's slots start the moment the staleness budget allows and do not poll;
    # in a hedged deterministic run, at most until a lagging place falls due for a copy, or
    # until one of the worker's copies loses (told at once, so that it stops generating it).
    freed, lease_policy = request.app[LEASES_FREED], state.lease_policy
    deadline = asyncio.get_running_loop().time() + wait_s
    async with freed:
        while not (granted := state.grant_leases(holder, body.max_groups, policy)) and holder not in lease_policy.untold:
            hedge = state.hedge_due_in(holder)
            most_s = LEASE_RECHECK_S if hedge is None else min(LEASE_RECHECK_S, hedge + 0.001)
            if not await wait_awhile(request.app, freed, deadline, most_s):
                break
    await commit(request.app)
    return respond(
        request,
        LeaseResponse(
            policy_version=state.stream(policy).published,
            sampling=state.sampling,
            leases=granted,
            retry_after_s=0.0 if granted or wait_s > 0 else 0.2,
            superseded=state.tell(holder),
        ),
    )


async def _on_lease(request: web.Request, operation: Callable[[RunState, str, str], BaseModel]) -> web.Response:
    """`operation(state, lease_id, holder)` on the route's lease; what it changed is committed
    before the answer (a read commits nothing, and answers with only committed state)."""
    answer = operation(request.app[STATE], request.match_info["lease_id"], query_id(request, "worker_id"))
    await commit(request.app)
    return respond(request, answer)


async def lease_get(request: web.Request) -> web.Response:
    return await _on_lease(request, RunState.lease_state)


async def lease_renew(request: web.Request) -> web.Response:
    return await _on_lease(request, RunState.renew_lease)


async def lease_release(request: web.Request) -> web.Response:
    answer = await _on_lease(request, RunState.release_lease)
    await notify_all(request.app[LEASES_FREED])
    return answer


async def steps(request: web.Request) -> web.Response:
    """POST /v1/steps: a tree lease's finished steps, journaled and queued for scorers at once."""
    body = await parse_body(request, StepPost)
    ack = request.app[STATE].post_steps(holder_of(request, body.worker_id), body)
    await commit(request.app)
    await notify_all(request.app[SCORES_WAITING])
    return respond(request, ack)


async def verdicts(request: web.Request) -> web.Response:
    """GET /v1/verdicts: the verdicts on the caller's posted steps after `after`, as soon as one is
    taken. A worker keeps one outstanding while it generates; it never waits on it to go on."""
    only_query(request, "worker_id", "after", "wait_s")
    holder = query_id(request, "worker_id")  # token name / worker id
    after = query_int_or_none(request, "after", high=2**62) or 0
    wait_s = query_seconds(request, "wait_s", high=MAX_VERSION_WAIT_S, default=0.0)
    state, taken = request.app[STATE], request.app[VERDICTS]
    deadline = asyncio.get_running_loop().time() + wait_s
    async with taken:
        while not (answer := state.verdicts_for(holder, after)).verdicts:
            if not await wait_awhile(request.app, taken, deadline, wait_s):
                break
    return respond(request, answer)


def mask_bound(sampling: SamplingParams, vocab_size: int) -> tuple[int, str]:
    """The ids one sampling-mask entry of this run may keep, and why: the run's own bound on a
    posted rollout, checked as the body is validated (a 400 for the whole post, nothing of it kept).
    The wire models hold the bounds that hold whatever the config (decentrl/api/wire.py); a
    completion longer than sampling.max_tokens or ids outside the vocabulary are per-rollout
    rejections (orchestrator/checks.py)."""
    per_token = min(sampling.top_k, vocab_size) if sampling.top_k > 0 else vocab_size
    return per_token, f"sampling.top_k={sampling.top_k}, vocabulary {vocab_size}"


async def rollouts(request: web.Request) -> web.Response:
    app = request.app
    state = app[STATE]
    inflight, name = app[INFLIGHT], request[IDENTITY].name
    # The body is read before a place in flight is taken: a slow upload (1 byte a second) holds
    # no place for the fast ones, only the bytes it sent, until body_timeout_s cuts it off (408).
    # A crowded orchestrator refuses once it has the body, right before it would take the place
    # (nginx in front, configs/deploy/, reads the whole body before passing it on anyway).
    bound = mask_bound(state.sampling, state.vocab_size)
    body = await parse_body(request, RolloutBatch, context={MASK_IDS: bound})
    if (crowded := inflight.full(name)) is not None:
        app[METRICS].backpressure.labels("inflight" if crowded == "all" else "inflight_token").inc()
        whose = "" if crowded == "all" else f" for token {name!r} (orchestrator.max_inflight_per_token)"
        raise error(web.HTTPServiceUnavailable, f"too many rollout posts in flight{whose}; retry shortly", retry_after=1)
    if state.buffer_full():
        app[METRICS].backpressure.labels("buffer_full").inc()
        raise error(
            web.HTTPServiceUnavailable,
            f"the buffer holds {len(state.ready)} groups (limit {state.buffer_limit}) waiting for the trainer; retry later",
            retry_after=2,
        )
    with inflight.held(name):
        first = body.rollouts[0]
        if any(r.worker_id != first.worker_id for r in body.rollouts):
            raise error(web.HTTPBadRequest, "all rollouts of one request must carry the same worker_id")
        if (other := next((r.run_name for r in body.rollouts if r.run_name != state.config.run_name), None)) is not None:
            raise error(web.HTTPConflict, f"this orchestrator serves run {state.config.run_name!r}; rollouts name run {other!r}")
        ready_before, leases_before = len(state.ready), state.leases_changed
        result = state.ingest(body.rollouts, holder_of(request, first.worker_id))
        await commit(app)
    for outcome, count in (("accepted", result.accepted), ("duplicate", result.duplicates), ("rejected", len(result.rejected))):
        if count:
            app[METRICS].worker_rollouts.labels(name, outcome).inc(count)
    app[HISTORY].posted(name, body, result)
    wake_checks(app)  # a completed group may be pending for its check
    if len(state.ready) > ready_before:
        await notify_all(app[BATCH_READY])
    if state.leases_changed > leases_before:  # a place or prompt freed, a losing copy to tell, a copy due
        await notify_all(app[LEASES_FREED])
    if state.score_queue.queue:  # a completed group's samples wait for scorers
        await notify_all(app[SCORES_WAITING])
    return respond(request, result)


# -- trainer ------------------------------------------------------------------------------


async def batch(request: web.Request) -> web.StreamResponse:
    # The trainer holds at most the version its last step publishes: a larger one would make
    # every rollout stale at once.
    trainer_version = query_int(request, "trainer_version", high=request.app[STATE].config.trainer.steps)
    policy = run_policy(request.app[STATE], query_text(request, "policy"))
    request_id = request.query.get("request_id")
    if request_id is not None and not REQUEST_ID.fullmatch(request_id):
        raise error(web.HTTPBadRequest, f"query parameter request_id must match {REQUEST_ID.pattern}")
    state = request.app[STATE]
    ready = request.app[BATCH_READY]
    deadline = asyncio.get_running_loop().time() + state.config.orchestrator.batch_wait_s
    async with ready:
        while (served := state.take_batch(trainer_version, request_id, policy)) is None:
            # The trainer waits: if for a pending group (take_batch may also have evicted stale
            # groups ahead of one), its check is due now.
            wake_checks(request.app)
            if not await wait_awhile(request.app, ready, deadline, 1.0):
                return web.Response(status=204)
    await commit(request.app)
    await notify_all(request.app[LEASES_FREED])  # the buffer has room again
    wake_checks(request.app)  # a pending group may now be in the next batch's way
    histogram = request.app[METRICS].staleness
    for lag, count in served.staleness_histogram.items():
        for _ in range(count):
            histogram.observe(int(lag))
    request.app[HISTORY].served(served)
    if wants_msgpack(request) and (body := state.batch_msgpack(served)) is not None:
        return web.Response(body=body, content_type=MEDIA_MSGPACK)
    return respond(request, served)


async def version(request: web.Request) -> web.Response:
    body = await parse_body(request, VersionAnnouncement)
    policy = run_policy(request.app[STATE], body.policy)
    await check_in_store(request.app, body.version, policy)
    request.app[STATE].announce(body.version, policy)
    await commit(request.app)
    request.app[HISTORY].announced(body.version)
    await notify_all(request.app[VERSION_PUBLISHED])  # workers waiting on GET /v1/version learn of it now
    await notify_all(request.app[LEASES_FREED])  # the staleness budget grows by a step's groups
    wake_checks(request.app)  # stale groups left the ready queue ahead of a pending one
    log.info("version %d published", body.version)
    return respond(request, run_status(request.app))


async def check_in_store(app: web.Application, version: int, policy: str | None = None) -> None:
    """409 unless `version` is complete in the run's store (its manifest is there and checks,
    signature included when the store has a public key): workers could not pull it, and a version
    announced past the real one would make every rollout stale. 503 (retried by the trainer's
    client) while the orchestrator cannot read the store: an outage is not a missing version."""
    store, published = app[STORE], app[STATE].stream(policy).published
    if store is None or (published is not None and version <= published):  # an older one changes nothing
        return
    if policy is not None:  # a run of two policies: its stream of versions
        store = store.of_policy(policy)
    try:
        await asyncio.to_thread(store.manifest, version)
    except StoreUnreachable as exc:
        raise error(
            web.HTTPServiceUnavailable, f"the orchestrator cannot read the store to check version {version} ({exc}); "
            "announce it again shortly", retry_after=5,
        ) from None
    except StoreError as exc:
        raise error(
            web.HTTPConflict, f"version {version} is not complete in the store: {exc}; publish it, then announce it"
        ) from None


# -- anyone with a token ------------------------------------------------------------------


async def status(request: web.Request) -> web.Response:
    return respond(request, run_status(request.app))


# -- admin --------------------------------------------------------------------------------


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
    entry = next((TokenEntry(name=n, role=r, source=s) for n, r, s in registry.entries() if n == name), None)  # type: ignore[arg-type]
    try:
        removed = entry is not None and registry.revoke(name)
    except PermissionError as exc:
        raise error(web.HTTPConflict, str(exc)) from None
    if not removed:
        raise error(web.HTTPNotFound, f"no token named {name!r}")
    log.info("token %r revoked by %r", name, request[IDENTITY].name)
    return respond(request, entry)


# -- operations ---------------------------------------------------------------------------


async def metrics(request: web.Request) -> web.Response:
    return web.Response(body=request.app[METRICS].render(), headers={"Content-Type": METRICS_CONTENT_TYPE})


async def openapi(request: web.Request) -> web.Response:
    return web.json_response(request.app[OPENAPI])


async def healthz(request: web.Request) -> web.Response:
    journal = request.app[STATE].journal
    ok = journal.failed is None
    return web.json_response(Health(ok=ok, journal=journal.durable).model_dump(), status=200 if ok else 503)
