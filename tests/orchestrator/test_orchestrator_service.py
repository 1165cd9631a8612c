"""The orchestrator as a service on real loopback HTTP: tokens and revocation, rate limits,
backpressure, encodings, lease routes, metrics, journal failure, and malformed input.

Started with the shared `serve_orchestrator` fixture (tests/conftest.py) inside asyncio.run, the
synchronous OrchestratorClient in a thread; here with a journal in a temp dir and a tokens file
on disk.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import logging
import random
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgpack
import pytest
from aiohttp import web
from transformers import PreTrainedTokenizerBase

from decentrl.api.client import OrchestratorClient, OrchestratorError, Stopped
from decentrl.api.encoding import MEDIA_MSGPACK, encode_model, pack_msgpack, unpack_msgpack
from decentrl.api.wire import LeaseRequest, Rollout, RolloutBatch, SamplingParams, TrainBatch
from decentrl.tasks import build_task
from orchestrator.appstate import INFLIGHT
from orchestrator.auth import TokenRegistry, add_token, revoke_token
from orchestrator.journal import Journal
from orchestrator.state import RunState
from tests.orchestrator.conftest import ADMIN, TOKENS, TRAINER, WORKER

if TYPE_CHECKING:
    from tests.conftest import LiveOrchestrator as Server

OTHER = "worker-secret-2"
ENV_TOKENS = [*TOKENS, {"name": "bob", "role": "worker", "token": OTHER}]


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@pytest.fixture
def serve(
    make_config: Any, tokenizer: PreTrainedTokenizerBase, tmp_path: Path, clock: Any, serve_orchestrator: Any
) -> Callable[..., Any]:
    """`async with serve(journal=True, fake_clock=False, on_fatal=None, **config) as server:`;
    the tokens file is `server.tokens.path` (tmp_path/tokens.json)."""

    @asynccontextmanager
    async def running(
        *, journal: bool = True, fake_clock: bool = False, on_fatal: Any = None, **overrides: Any
    ) -> AsyncIterator[Server]:
        config = make_config(**overrides)
        j = Journal(str(tmp_path / "journal.sqlite"), run_name=config.run_name) if journal else None
        state = RunState(
            config=config, task=build_task(config.task), tokenizer=tokenizer, journal=j,
            **({"clock": clock} if fake_clock else {}),
        )
        tokens_file = tmp_path / "tokens.json"
        if not tokens_file.exists():
            tokens_file.write_text('{"tokens": []}')
        registry = TokenRegistry(path=str(tokens_file), env_entries=ENV_TOKENS)
        try:
            async with serve_orchestrator(state, registry, store_url="memory://svc", on_fatal=on_fatal) as server:
                yield server
        finally:
            if j is not None:
                j.close()

    return running


def run(coro: Awaitable[None]) -> None:
    asyncio.run(asyncio.wait_for(coro, timeout=60))  # type: ignore[arg-type]


def answers(server: Server, leases: list[Any], sorted_answer: Callable[[str], str], completion_ids: Any,
            *, worker_id: str = "w0", per_lease: int | None = None) -> RolloutBatch:
    rollouts = []
    for lease in leases:
        ids = completion_ids(sorted_answer(server.state.task.prompt(lease.prompt_id).text))
        for i in range(per_lease or lease.group_size):
            rollouts.append(Rollout(
                rollout_id=f"{lease.lease_id}-{i}", run_name=server.state.config.run_name, lease_id=lease.lease_id,
                prompt_id=lease.prompt_id, worker_id=worker_id, policy_version=0,
                prompt_token_ids=lease.prompt_token_ids, completion_token_ids=ids, logprobs=[-0.5] * len(ids),
                finish_reason="stop", sampling=SamplingParams(**server.state.sampling.model_dump()),
            ))
    return RolloutBatch(rollouts=rollouts)


# -- tokens -------------------------------------------------------------------------------


def test_admin_creates_and_revokes_tokens_and_revocation_is_immediate(serve: Any) -> None:
    async def scenario() -> None:
        async with serve() as server:
            status, created, _ = await server.call("POST", "/v1/admin/tokens", ADMIN, json={"name": "carol", "role": "worker"})
            assert status == 201 and created["name"] == "carol" and len(created["token"]) >= 32
            assert "carol" in server.tokens.path.read_text()  # persisted in the tokens file
            assert (await server.call("GET", "/v1/info", created["token"]))[0] == 200
            status, listed, _ = await server.call("GET", "/v1/admin/tokens", ADMIN)
            assert {"name": "carol", "role": "worker", "source": "file"} in listed["tokens"]
            assert created["token"] not in json.dumps(listed)  # names and roles, never tokens

            assert (await server.call("DELETE", "/v1/admin/tokens/carol", ADMIN))[0] == 200
            status, body, _ = await server.call("GET", "/v1/info", created["token"])
            assert status == 401 and "bearer token" in body["error"]

            assert (await server.call("DELETE", "/v1/admin/tokens/carol", ADMIN))[0] == 404
            assert (await server.call("POST", "/v1/admin/tokens", ADMIN, json={"name": "alice"}))[0] == 409
            status, body, _ = await server.call("DELETE", "/v1/admin/tokens/root", ADMIN)
            assert status == 409 and "cannot revoke itself" in body["error"]
            status, body, _ = await server.call("DELETE", "/v1/admin/tokens/alice", ADMIN)
            assert status == 409 and "DECENTRL_TOKENS" in body["error"]  # environment tokens stay
            assert (await server.call("POST", "/v1/admin/tokens", WORKER, json={"name": "x"}))[0] == 403

    run(scenario())


def test_tokens_file_edits_apply_to_the_next_request(serve: Any) -> None:
    async def scenario() -> None:
        async with serve() as server:
            token = add_token(str(server.tokens.path), name="dave", role="trainer")  # `decentrl token create`
            assert (await server.call("GET", "/v1/status", token))[0] == 200
            assert revoke_token(str(server.tokens.path), name="dave")  # `decentrl token revoke`
            assert (await server.call("GET", "/v1/status", token))[0] == 401

    run(scenario())


def test_tokens_are_never_logged(serve: Any, caplog: pytest.LogCaptureFixture) -> None:
    async def scenario() -> None:
        async with serve() as server:
            await server.call("GET", "/v1/info", "wrong-token-value")
            await server.call("POST", "/v1/leases", WORKER, data="{")
            await server.call("POST", "/v1/admin/tokens", ADMIN, json={"name": "erin"})
            await server.call("DELETE", "/v1/admin/tokens/erin", ADMIN)

    with caplog.at_level(logging.DEBUG):
        run(scenario())
    for secret in ("wrong-token-value", WORKER, ADMIN):
        assert secret not in caplog.text
    assert "erin" in caplog.text  # names are logged


# -- limits and backpressure --------------------------------------------------------------


def test_a_token_over_its_rate_gets_429_with_retry_after(serve: Any) -> None:
    async def scenario() -> None:
        async with serve(orchestrator={"rate_limit_per_s": 1.0, "rate_limit_burst": 3}) as server:
            statuses = [(await server.call("GET", "/v1/info", WORKER))[0] for _ in range(4)]
            assert statuses == [200, 200, 200, 429]
            status, body, headers = await server.call("GET", "/v1/info", WORKER)
            assert status == 429 and "'alice' is over its rate limit" in body["error"]
            assert int(headers["Retry-After"]) >= 1
            assert (await server.call("GET", "/v1/info", OTHER))[0] == 200  # per token
            # The client waits as told and gets through.
            started = time.monotonic()
            info = await asyncio.to_thread(server.client(WORKER, max_wait_s=10).info)
            assert info.run_name == "unit" and time.monotonic() - started >= 0.5

    run(scenario())


def test_a_full_buffer_answers_503_until_the_trainer_takes_a_batch(
    serve: Any, sorted_answer: Any, completion_ids: Any
) -> None:
    async def scenario() -> None:
        async with serve(orchestrator={"max_buffer_groups": 2}) as server:
            server.state.announce(0)
            leases = server.state.grant_leases("alice/w0", 5)
            assert len(leases) == 2  # the depth bound caps leases too
            body = answers(server, leases, sorted_answer, completion_ids).model_dump_json()
            assert (await server.call("POST", "/v1/rollouts", WORKER, data=body))[0] == 200
            status, error, headers = await server.call("POST", "/v1/rollouts", WORKER, data=body)
            assert status == 503 and "limit 2" in error["error"] and int(headers["Retry-After"]) >= 1
            assert server.state.lease_capacity() == 0
            assert (await server.call("GET", "/v1/batch?trainer_version=0", TRAINER))[0] == 200
            status, result, _ = await server.call("POST", "/v1/rollouts", WORKER, data=body)
            assert status == 200 and result["duplicates"] == 6

    run(scenario())


def test_a_rollout_post_waits_out_a_full_buffer_for_as_long_as_the_trainer_takes(
    serve: Any, sorted_answer: Any, completion_ids: Any
) -> None:
    """The worker's post to a full buffer is retried for as long as the orchestrator answers 503,
    past the client's max_wait_s: a trainer's stall may last longer (until 2026-11-29 the post gave up after
    120 s and the worker stopped: a frozen proposer's run of two models lost its workers so). `stop()`
    still ends the wait at once."""

    async def scenario() -> None:
        async with serve(orchestrator={"max_buffer_groups": 2}) as server:
            server.state.announce(0)
            body = answers(server, server.state.grant_leases("alice/w0", 2), sorted_answer, completion_ids)
            patient, stopping = server.client(WORKER, max_wait_s=0.5), server.client(WORKER, max_wait_s=0.5)
            assert (await asyncio.to_thread(patient.post_rollouts, body)).accepted == 6  # the buffer is full
            posting = asyncio.ensure_future(asyncio.to_thread(patient.post_rollouts, body))
            stopped = asyncio.ensure_future(asyncio.to_thread(stopping.post_rollouts, body))
            await asyncio.sleep(2.0)  # 4 x max_wait_s
            assert not posting.done() and not stopped.done()
            stopping.stop()
            asked = time.monotonic()
            with pytest.raises(Stopped):
                await stopped
            assert time.monotonic() - asked < 1.0
            assert (await server.call("GET", "/v1/batch?trainer_version=0", TRAINER))[0] == 200
            result = await asyncio.wait_for(posting, timeout=10)
            assert result.duplicates == 6 and not result.rejected

    run(scenario())


def test_too_many_posts_in_flight_get_503(serve: Any, sorted_answer: Any, completion_ids: Any) -> None:
    """Posts being processed (ingested and committed) are bounded; a body still arriving holds no
    place; a post is validated before it is refused as crowded."""

    async def scenario() -> None:
        async with serve(orchestrator={"max_inflight_requests": 1}) as server:
            server.state.announce(0)
            batch = answers(server, server.state.grant_leases("alice/w0", 1), sorted_answer, completion_ids)
            release = asyncio.Event()

            async def slow_body() -> AsyncIterator[bytes]:
                yield b'{"rollouts": '
                await release.wait()
                yield b"[]}"

            first = asyncio.create_task(server.call("POST", "/v1/rollouts", WORKER, data=slow_body()))
            await asyncio.sleep(0.3)  # the first post is being read: it holds no place
            status, body, _ = await server.call("POST", "/v1/rollouts", WORKER, json={"rollouts": []})
            assert status == 400, body
            with server.app[INFLIGHT].held("bob"):  # a post being ingested and committed
                status, body, headers = await server.call("POST", "/v1/rollouts", WORKER, data=batch.model_dump_json(),
                                                          headers={"Content-Type": "application/json"})
                assert status == 503 and "in flight" in body["error"] and headers["Retry-After"] == "1"
                assert (await server.call("POST", "/v1/rollouts", WORKER, json={"rollouts": []}))[0] == 400
                release.set()
                assert (await first)[0] == 400  # validated as soon as its body is in (an empty list is invalid)
            status, body, _ = await server.call("POST", "/v1/rollouts", WORKER, data=batch.model_dump_json(),
                                                headers={"Content-Type": "application/json"})
            assert status == 200 and body["accepted"] == 3, body


# -- encodings ----------------------------------------------------------------------------


def test_msgpack_and_gzip_bodies_and_msgpack_answers(serve: Any, sorted_answer: Any, completion_ids: Any) -> None:
    async def scenario() -> None:
        async with serve(max_staleness=2, trainer={"groups_per_step": 1}) as server:
            server.state.announce(0)
            leases = server.state.grant_leases("alice/w0", 3)
            batches = [answers(server, [lease], sorted_answer, completion_ids) for lease in leases]
            packed = encode_model(batches[0], MEDIA_MSGPACK)
            assert len(packed) < len(batches[0].model_dump_json())
            status, result, headers = await server.call(
                "POST", "/v1/rollouts", WORKER, data=packed,
                headers={"Content-Type": MEDIA_MSGPACK, "Accept": MEDIA_MSGPACK},
            )
            assert status == 200 and headers["Content-Type"].startswith(MEDIA_MSGPACK) and result["accepted"] == 3
            zipped = gzip.compress(encode_model(batches[1], MEDIA_MSGPACK))
            status, result, _ = await server.call(
                "POST", "/v1/rollouts", WORKER, data=zipped,
                headers={"Content-Type": MEDIA_MSGPACK, "Content-Encoding": "gzip"},
            )
            assert status == 200 and result["accepted"] == 3
            status, result, _ = await server.call(
                "POST", "/v1/rollouts", WORKER, data=gzip.compress(batches[2].model_dump_json().encode()),
                headers={"Content-Type": "application/json", "Content-Encoding": "gzip"},
            )
            assert status == 200 and result["accepted"] == 3
            # The trainer's batch as msgpack equals the JSON one.
            status, as_msgpack, _ = await server.call(
                "GET", "/v1/batch?trainer_version=0&request_id=r1", TRAINER, headers={"Accept": MEDIA_MSGPACK}
            )
            status, as_json, _ = await server.call("GET", "/v1/batch?trainer_version=0&request_id=r1", TRAINER)
            assert TrainBatch.model_validate(as_msgpack) == TrainBatch.model_validate(as_json)

    run(scenario())


@pytest.mark.parametrize(
    ("content_type", "body", "status", "words"),
    [
        ("application/xml", b"<rollouts/>", 415, "not supported"),
        ("multipart/form-data", b"x", 415, "application/msgpack"),
        (MEDIA_MSGPACK, b"\xc1\xc1\xc1", 400, "not valid msgpack"),
        (MEDIA_MSGPACK, msgpack.packb({"rollouts": msgpack.ExtType(1, b"abc")}), 400, "whole number"),
        (MEDIA_MSGPACK, msgpack.packb({"rollouts": msgpack.ExtType(99, b"")}), 400, "unknown msgpack ext"),
        (MEDIA_MSGPACK, msgpack.packb([1, 2, 3]), 400, "invalid RolloutBatch"),
    ],
)
def test_bad_encodings(serve: Any, content_type: str, body: bytes, status: int, words: str) -> None:
    async def scenario() -> None:
        async with serve() as server:
            got, error, _ = await server.call("POST", "/v1/rollouts", WORKER, data=body, headers={"Content-Type": content_type})
            assert got == status and words in error["error"]

    run(scenario())


def test_a_gzip_bomb_is_413(serve: Any) -> None:
    async def scenario() -> None:
        async with serve(orchestrator={"max_request_bytes": 64 * 1024}) as server:
            bomb = gzip.compress(b'{"rollouts": [' + b" " * (10 * 1024 * 1024) + b"]}")
            assert len(bomb) < 64 * 1024
            status, error, _ = await server.call(
                "POST", "/v1/rollouts", WORKER, data=bomb, headers={"Content-Encoding": "gzip", "Content-Type": "application/json"}
            )
            assert status == 413 and "max_request_bytes" in error["error"]

    run(scenario())


def test_client_speaks_msgpack_by_default_and_falls_back_to_json_on_415(serve: Any) -> None:
    seen: list[str] = []

    async def old_server(request: web.Request) -> web.Response:
        seen.append(request.content_type)
        if request.content_type == MEDIA_MSGPACK:
            return web.json_response({"error": "unsupported"}, status=415)
        body = json.loads(await request.read())
        return web.json_response({"accepted": len(body["rollouts"]), "duplicates": 0, "rejected": []})

    async def scenario() -> None:
        app = web.Application()
        app.router.add_post("/v1/rollouts", old_server)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        try:
            client = OrchestratorClient(url, "t")
            rollout = Rollout(
                rollout_id="r", run_name="x", lease_id="l", prompt_id=0, worker_id="w", policy_version=0,
                prompt_token_ids=[1], completion_token_ids=[4], logprobs=[-1.0], finish_reason="stop",
                sampling=SamplingParams(temperature=1.0, max_tokens=4),
            )
            for _ in range(2):
                result = await asyncio.to_thread(client.post_rollouts, RolloutBatch(rollouts=[rollout]))
                assert result.accepted == 1
            assert client.encoding == "json"
        finally:
            await runner.cleanup()

    run(scenario())
    assert seen == [MEDIA_MSGPACK, "application/json", "application/json"]


# -- runs and leases ----------------------------------------------------------------------


def test_rollouts_of_another_run_are_409(serve: Any, sorted_answer: Any, completion_ids: Any) -> None:
    async def scenario() -> None:
        async with serve() as server:
            server.state.announce(0)
            batch = answers(server, server.state.grant_leases("alice/w0", 1), sorted_answer, completion_ids)
            batch.rollouts[0] = batch.rollouts[0].model_copy(update={"run_name": "last-week"})
            status, error, _ = await server.call("POST", "/v1/rollouts", WORKER, data=batch.model_dump_json())
            assert status == 409 and "'unit'" in error["error"] and "'last-week'" in error["error"]
            assert server.state.rollouts_accepted == 0

    run(scenario())


def test_lease_routes(serve: Any, clock: Any, sorted_answer: Any, completion_ids: Any) -> None:
    async def scenario() -> None:
        async with serve(fake_clock=True, trainer={"groups_per_step": 1}) as server:
            worker, other = server.client(WORKER), server.client(OTHER)
            server.state.announce(0)
            first, second = (await asyncio.to_thread(worker.lease, LeaseRequest(worker_id="w0", max_groups=2))).leases
            with pytest.raises(OrchestratorError) as unknown:
                await asyncio.to_thread(worker.lease_state, "no-such-lease", "w0")
            assert unknown.value.status == 404
            with pytest.raises(OrchestratorError) as foreign:
                await asyncio.to_thread(other.renew_lease, first.lease_id, "w0")
            assert foreign.value.status == 403
            with pytest.raises(OrchestratorError) as other_id:
                await asyncio.to_thread(worker.lease_state, first.lease_id, "w1")  # same token, another worker
            assert other_id.value.status == 403

            released = await asyncio.to_thread(worker.release_lease, second.lease_id, "w0")
            assert released.state == "released"
            again = await asyncio.to_thread(worker.lease, LeaseRequest(worker_id="w0", max_groups=1))
            assert again.leases[0].prompt_id == second.prompt_id  # a released prompt goes out first
            late = answers(server, [second], sorted_answer, completion_ids, per_lease=1)
            result = await asyncio.to_thread(worker.post_rollouts, late)
            assert [r.reason for r in result.rejected] == ["lease_released"]

            clock.advance(8.0)  # lease_timeout_s is 10: renewing gives 10 more from now
            renewed = await asyncio.to_thread(worker.renew_lease, first.lease_id, "w0")
            assert renewed.deadline == clock() + 10.0
            clock.advance(5.0)  # past the first deadline, not the renewed one
            server.state.expire_leases()
            state = await asyncio.to_thread(worker.lease_state, first.lease_id, "w0")
            assert state.state == "open" and state.samples == 0 and state.deadline == renewed.deadline

            posted = answers(server, [first], sorted_answer, completion_ids)
            assert (await asyncio.to_thread(worker.post_rollouts, posted)).accepted == 3
            with pytest.raises(OrchestratorError) as closed:
                await asyncio.to_thread(worker.renew_lease, first.lease_id, "w0")
            assert closed.value.status == 409 and "complete" in str(closed.value)
            assert (await asyncio.to_thread(worker.lease_state, first.lease_id, "w0")).state == "complete"

    run(scenario())


def test_late_result_of_an_expired_lease_over_http(serve: Any, clock: Any, sorted_answer: Any, completion_ids: Any) -> None:
    async def scenario() -> None:
        async with serve(fake_clock=True) as server:
            worker = server.client(WORKER)
            server.state.announce(0)
            (lease,) = (await asyncio.to_thread(worker.lease, LeaseRequest(worker_id="w0", max_groups=1))).leases
            clock.advance(11.0)
            (again,) = (await asyncio.to_thread(server.client(OTHER).lease, LeaseRequest(worker_id="b0", max_groups=1))).leases
            assert again.prompt_id == lease.prompt_id  # the prompt went to another worker
            result = await asyncio.to_thread(worker.post_rollouts, answers(server, [lease], sorted_answer, completion_ids))
            assert result.accepted == 0 and {r.reason for r in result.rejected} == {"lease_expired"}
            status = await asyncio.to_thread(worker.status)
            assert status.leases_expired == 1 and status.rollouts_rejected == {"lease_expired": 3}

    run(scenario())


def test_a_resent_batch_request_gets_the_same_batch(serve: Any, sorted_answer: Any, completion_ids: Any) -> None:
    async def scenario() -> None:
        async with serve(trainer={"groups_per_step": 1}, orchestrator={"batches_kept": 2}) as server:
            worker, trainer = server.client(WORKER), server.client(TRAINER)
            await asyncio.to_thread(trainer.announce, 0)
            leases = (await asyncio.to_thread(worker.lease, LeaseRequest(worker_id="w0", max_groups=2))).leases
            await asyncio.to_thread(worker.post_rollouts, answers(server, leases, sorted_answer, completion_ids))
            first = await asyncio.to_thread(trainer.batch, 0, "lost-answer")
            again = await asyncio.to_thread(trainer.batch, 0, "lost-answer")
            assert first is not None and again == first
            other = await asyncio.to_thread(trainer.batch, 0)
            assert other is not None and other.batch_id != first.batch_id
            assert {s.group_id for s in first.samples}.isdisjoint(s.group_id for s in other.samples)
            assert server.state.groups_served == 2

    run(scenario())


def test_version_bounds_and_query_validation(serve: Any) -> None:
    async def scenario() -> None:
        async with serve() as server:
            status, error, _ = await server.call("POST", "/v1/version", TRAINER, json={"version": 2**40})
            assert status == 400 and "version" in error["error"]
            status, error, _ = await server.call("GET", "/v1/batch?trainer_version=99999999999", TRAINER)
            assert status == 400 and "trainer_version" in error["error"]
            status, error, _ = await server.call("GET", "/v1/batch?trainer_version=0&request_id=a/b", TRAINER)
            assert status == 400 and "request_id" in error["error"]
            status, error, _ = await server.call("GET", "/v1/leases/x", WORKER)
            assert status == 400 and "worker_id" in error["error"]

    run(scenario())


# -- metrics, health, journal failure -----------------------------------------------------


def test_metrics(serve: Any, sorted_answer: Any, completion_ids: Any, clock: Any) -> None:
    async def scenario() -> None:
        async with serve(fake_clock=True) as server:
            worker, trainer = server.client(WORKER), server.client(TRAINER)
            await asyncio.to_thread(trainer.announce, 0)
            leases = (await asyncio.to_thread(worker.lease, LeaseRequest(worker_id="w0", max_groups=3))).leases
            posted = answers(server, leases[:2], sorted_answer, completion_ids)
            await asyncio.to_thread(worker.post_rollouts, posted)
            await asyncio.to_thread(worker.post_rollouts, posted)  # duplicates
            bad = answers(server, leases[2:], sorted_answer, completion_ids, worker_id="w9")
            await asyncio.to_thread(worker.post_rollouts, bad)  # not the lease holder
            await asyncio.to_thread(trainer.batch, 0)
            clock.advance(11.0)
            server.state.expire_leases()

            status, text, headers = await server.call("GET", "/metrics", TRAINER)
            assert status == 200 and headers["Content-Type"].startswith("text/plain; version=0.0.4")
            for line in (
                "decentrl_rollouts_accepted_total 6.0",
                "decentrl_rollouts_duplicate_total 6.0",
                'decentrl_rollouts_rejected_total{reason="not_lease_holder"} 3.0',
                "decentrl_lease_expirations_total 1.0",
                "decentrl_buffer_groups 0.0",
                "decentrl_groups_served_total 2.0",
                "decentrl_policy_version 0.0",
                'decentrl_worker_rollouts_total{outcome="accepted",token="alice"} 6.0',
                'decentrl_worker_rollouts_total{outcome="duplicate",token="alice"} 6.0',
                'decentrl_served_staleness_versions_bucket{le="0.0"} 6.0',
                "decentrl_ingest_tokens_total",
                "decentrl_journal_commit_seconds_count",
                'decentrl_http_requests_total{method="POST",route="/v1/rollouts",status="200"} 3.0',
            ):
                assert line in text, line
            commits = float(re.search(r"decentrl_journal_commit_seconds_count (\S+)", text).group(1))  # type: ignore[union-attr]
            assert commits >= 1
            assert (await server.call("GET", "/metrics", WORKER))[0] == 403  # per-worker names are not for workers
            assert (await server.call("GET", "/metrics"))[0] == 401
        async with serve(journal=False, orchestrator={"metrics_public": True}) as server:
            assert (await server.call("GET", "/metrics"))[0] == 200

    run(scenario())


def test_a_failed_journal_answers_503_and_stops_the_service(serve: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    fatal: list[BaseException] = []

    async def scenario() -> None:
        async with serve(on_fatal=fatal.append) as server:
            assert server.state.journal is not None

            def broken(ops: Any) -> None:
                raise OSError("No space left on device")

            monkeypatch.setattr(server.state.journal, "_execute", broken)
            status, error, headers = await server.call("POST", "/v1/version", TRAINER, json={"version": 0})
            assert status == 503 and "No space left" in error["error"] and "restart" in error["error"]
            assert "Retry-After" in headers
            assert (await server.call("POST", "/v1/leases", WORKER, json={"worker_id": "w0", "max_groups": 1}))[0] == 503
            status, health, _ = await server.call("GET", "/healthz")
            assert status == 503 and health == {"ok": False, "journal": True}

    run(scenario())
    assert len(fatal) == 1  # called once, however many requests failed


def test_garbage_in_never_gets_a_server_error(serve: Any, sorted_answer: Any, completion_ids: Any) -> None:
    """Valid rollouts with one field broken at random, as JSON and as msgpack: 200 or 4xx, never 5xx."""
    rng = random.Random(0)
    breakers: list[Callable[[dict[str, Any]], None]] = [
        lambda r: r.update(completion_token_ids=[2**70]),
        lambda r: r.update(completion_token_ids=[-(2**63) - 5]),
        lambda r: r.update(logprobs=[1e308] * len(r["logprobs"])),
        lambda r: r.update(logprobs=[-1e308] * len(r["logprobs"])),
        lambda r: r.update(logprobs="nope"),
        lambda r: r.update(token_versions=[2**40] * len(r["completion_token_ids"])),
        lambda r: r.update(token_versions=[-1] * len(r["completion_token_ids"])),
        lambda r: r.update(sampling_mask=[[2**62]] * len(r["completion_token_ids"])),
        lambda r: r.update(expert_routing=[[2**62, -(2**62)]]),
        lambda r: r.update(expert_routing={"layers": 1, "top_k": 2, "experts": [2**62, -(2**62)]}),
        lambda r: r.update(expert_routing={"layers": 0, "top_k": 2**40, "experts": "x"}),
        lambda r: r.update(prompt_id=2**63),
        lambda r: r.update(policy_version=-1),
        lambda r: r.update(rollout_id="x" * 200),
        lambda r: r.update(lease_id=None),
        lambda r: r.update(sampling={"temperature": float("inf"), "max_tokens": 6}),
        lambda r: r.update(claimed_reward=float("nan")),
        lambda r: r.pop("finish_reason"),
        lambda r: r.update(extra="field"),
    ]

    async def scenario() -> None:
        async with serve() as server:
            server.state.announce(0)
            leases = server.state.grant_leases("alice/w0", 4)
            for index in range(60):
                batch = json.loads(answers(server, leases, sorted_answer, completion_ids).model_dump_json())
                for rollout in batch["rollouts"]:
                    rollout["rollout_id"] = f"{index}-{rollout['rollout_id']}"
                    if rng.random() < 0.3:
                        rng.choice(breakers)(rollout)
                data, kind = json.dumps(batch).encode(), "application/json"
                if index % 2:
                    try:
                        data, kind = pack_msgpack(batch), MEDIA_MSGPACK
                    except OverflowError:
                        pass  # msgpack cannot even carry ints past 64 bits: JSON it is
                status, body, _ = await server.call("POST", "/v1/rollouts", WORKER, data=data, headers={"Content-Type": kind})
                assert status in (200, 400), (status, body)
            assert server.state.rollouts_accepted <= 4 * 3

    run(scenario())


def test_token_cli_through_a_running_orchestrator(serve: Any) -> None:
    from typer.testing import CliRunner

    from decentrl.cli.main import app as cli

    async def scenario() -> None:
        async with serve() as server:
            runner = CliRunner()
            admin = ["--orchestrator", server.url, "--token", ADMIN]
            created = await asyncio.to_thread(runner.invoke, cli, ["token", "create", "--name", "fred", "--role", "trainer", *admin])
            assert created.exit_code == 0, created.output
            token = created.output.strip()
            assert (await server.call("GET", "/v1/status", token))[0] == 200
            listed = await asyncio.to_thread(runner.invoke, cli, ["token", "list", *admin])
            assert "fred\ttrainer" in listed.output and token not in listed.output
            revoked = await asyncio.to_thread(runner.invoke, cli, ["token", "revoke", "--name", "fred", *admin])
            assert revoked.exit_code == 0, revoked.output
            assert (await server.call("GET", "/v1/status", token))[0] == 401
            refused = await asyncio.to_thread(
                runner.invoke, cli, ["token", "create", "--name", "x", "--orchestrator", server.url, "--token", WORKER]
            )
            assert refused.exit_code == 2 and "403" in refused.output

    run(scenario())


def test_msgpack_posts_are_journaled_as_received_and_recover_equal(
    serve: Any, sorted_answer: Any, completion_ids: Any, make_config: Any, tokenizer: PreTrainedTokenizerBase,
    tmp_path: Path,
) -> None:
    posted: list[Rollout] = []

    async def scenario() -> None:
        async with serve(trainer={"groups_per_step": 1}) as server:
            worker = server.client(WORKER)  # msgpack by default
            server.state.announce(0)
            leases = (await asyncio.to_thread(worker.lease, LeaseRequest(worker_id="w0", max_groups=2))).leases
            batch = answers(server, leases, sorted_answer, completion_ids)
            for i, rollout in enumerate(batch.rollouts):  # logprobs exact in float32 or not
                batch.rollouts[i] = rollout.model_copy(update={"logprobs": [-(i + 1) / 3] * len(rollout.logprobs)})
            posted.extend(batch.rollouts)
            assert (await asyncio.to_thread(worker.post_rollouts, batch)).accepted == 6

    run(scenario())
    config = make_config(trainer={"groups_per_step": 1})
    journal = Journal(str(tmp_path / "journal.sqlite"), run_name=config.run_name)
    state = RunState(config=config, task=build_task(config.task), tokenizer=tokenizer, journal=journal)
    recovered = [rollout for group in state.ready for rollout, _ in group.samples]
    assert sorted(recovered, key=lambda r: r.rollout_id) == sorted(posted, key=lambda r: r.rollout_id)
    served = state.take_batch(0)
    assert served is not None
    assert TrainBatch.model_validate(unpack_msgpack(state.batch_msgpack(served) or b"")) == served
    journal.close()


def test_the_orchestrator_command_refuses_a_run_dir_it_cannot_serve(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`decentrl orchestrator` (orchestrator/app.py `serve`) exits 2 with the fix in the message,
    before it listens: no tokens file, then a journal of another run."""
    from typer.testing import CliRunner

    from decentrl.cli.main import app as cli

    monkeypatch.delenv("DECENTRL_TOKENS", raising=False)
    config = str(Path(__file__).parents[2] / "configs" / "local.toml")
    runner = CliRunner()
    command = ["orchestrator", config, "--run-dir", str(tmp_path), "--port", "0"]
    missing = runner.invoke(cli, command)
    assert missing.exit_code == 2 and "no tokens file" in missing.output and "decentrl token create" in missing.output
    add_token(str(tmp_path / "tokens.json"), name="w", role="worker")
    Journal(str(tmp_path / "journal.sqlite"), run_name="another-run").close()
    other = runner.invoke(cli, command)
    assert other.exit_code == 2 and "another-run" in other.output and "another --run-dir" in other.output
