"""The orchestrator's aiohttp app on real loopback HTTP: auth, validation, limits, a full cycle.

Each test starts the app with the shared `serve_orchestrator` fixture (tests/conftest.py) inside
`asyncio.run`; raw requests go through its aiohttp.ClientSession, and the real (synchronous,
urllib) OrchestratorClient runs in a thread with `asyncio.to_thread` so the server's loop keeps
serving.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import pytest

from decentrl.api.client import OrchestratorError
from decentrl.api.wire import LeaseRequest, Rollout, RolloutBatch, SamplingParams
from tests.orchestrator.conftest import ADMIN, STORE_URL, TRAINER, WORKER, ServeFn

if TYPE_CHECKING:
    from tests.conftest import LiveOrchestrator as Server


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def run(coro: Awaitable[None]) -> None:
    asyncio.run(asyncio.wait_for(coro, timeout=30))  # type: ignore[arg-type]


def rollouts_for(
    server: Server, leases: list[Any], completion_ids: Callable[[str], list[int]], sorted_answer: Callable[[str], str],
    *, worker_id: str = "w0",
) -> RolloutBatch:
    """Right answers for every sample of every lease, as a worker would post them."""
    sampling = server.state.sampling
    rollouts = []
    for lease in leases:
        ids = completion_ids(sorted_answer(server.state.task.prompt(lease.prompt_id).text))
        for i in range(lease.group_size):
            rollouts.append(
                Rollout(
                    rollout_id=f"{lease.lease_id}-{i}",
                    run_name=server.state.config.run_name,
                    lease_id=lease.lease_id,
                    prompt_id=lease.prompt_id,
                    worker_id=worker_id,
                    policy_version=0,
                    prompt_token_ids=lease.prompt_token_ids,
                    completion_token_ids=ids,
                    logprobs=[-0.5] * len(ids),
                    finish_reason="stop",
                    sampling=SamplingParams(temperature=sampling.temperature, max_tokens=sampling.max_tokens),
                )
            )
    return RolloutBatch(rollouts=rollouts)


# -- auth ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "path"),
    [("GET", "/v1/info"), ("GET", "/v1/status"), ("POST", "/v1/leases"), ("POST", "/v1/rollouts"),
     ("GET", "/v1/batch?trainer_version=0"), ("POST", "/v1/version")],
)
def test_protected_routes_need_a_token(serve: ServeFn, method: str, path: str) -> None:
    async def scenario() -> None:
        async with serve() as server:
            async with server.http.request(method, server.url + path, json={}) as response:
                assert response.status == 401
                assert "bearer token" in (await response.json())["error"]

    run(scenario())


@pytest.mark.parametrize("header", [f"Bearer not-{WORKER}", f"Basic {WORKER}", WORKER, "Bearer "])
def test_unknown_or_malformed_token_is_401(serve: ServeFn, header: str) -> None:
    async def scenario() -> None:
        async with serve() as server:
            async with server.http.get(server.url + "/v1/info", headers={"Authorization": header}) as response:
                assert response.status == 401

    run(scenario())


@pytest.mark.parametrize(
    ("token", "method", "path", "body"),
    [
        (WORKER, "GET", "/v1/batch?trainer_version=0", None),
        (WORKER, "POST", "/v1/version", {"version": 0}),
        (TRAINER, "POST", "/v1/leases", {"worker_id": "w0", "max_groups": 1}),
        (ADMIN, "POST", "/v1/rollouts", {"rollouts": []}),
    ],
)
def test_wrong_role_is_403(serve: ServeFn, token: str, method: str, path: str, body: Any) -> None:
    async def scenario() -> None:
        async with serve() as server:
            server.state.announce(0)
            async with server.http.request(method, server.url + path, json=body, headers=bearer(token)) as response:
                assert response.status == 403
                assert "may not call" in (await response.json())["error"]
            assert server.state.published_version == 0  # the forbidden call changed nothing
            assert server.state.leases == {}

    run(scenario())


def test_any_role_may_read_info(serve: ServeFn) -> None:
    async def scenario() -> None:
        async with serve() as server:
            for token in (WORKER, TRAINER, ADMIN):
                async with server.http.get(server.url + "/v1/info", headers=bearer(token)) as response:
                    assert response.status == 200
                    info = await response.json()
                    assert info["store_url"] == STORE_URL and info["group_size"] == 3

    run(scenario())


def test_dashboard_page_needs_no_token(serve: ServeFn) -> None:
    async def scenario() -> None:
        async with serve() as server:
            async with server.http.get(server.url + "/") as response:
                assert response.status == 200
                assert response.content_type == "text/html"
                text = await response.text()
                assert "decentrl" in text and "/v1/dashboard" in text  # the dashboard page, which polls

    run(scenario())


# -- validation and limits ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ('{"worker_id": "w0", "max_groups": 0}', "max_groups"),
        ('{"worker_id": "w0"}', "max_groups"),
        ('{"worker_id": "", "max_groups": 1}', "worker_id"),
        ('{"worker_id": "w0", "max_groups": 1, "maxgroups": 2}', "maxgroups"),
        ('{"worker_id": "w0", "max_groups": ', "body"),  # not JSON at all
    ],
)
def test_malformed_lease_request_is_400_naming_the_field(serve: ServeFn, body: str, field: str) -> None:
    async def scenario() -> None:
        async with serve() as server:
            async with server.http.post(server.url + "/v1/leases", data=body, headers=bearer(WORKER)) as response:
                assert response.status == 400
                message = (await response.json())["error"]
                assert message.startswith("invalid LeaseRequest")
                assert field in message

    run(scenario())


def test_oversized_body_is_413(serve: ServeFn) -> None:
    async def scenario() -> None:
        async with serve(orchestrator={"max_request_bytes": 1024}) as server:
            small = json.dumps({"worker_id": "w0", "max_groups": 1})
            async with server.http.post(server.url + "/v1/leases", data=small, headers=bearer(WORKER)) as response:
                assert response.status == 200
            big = json.dumps({"worker_id": "w" * 4000, "max_groups": 1})
            async with server.http.post(server.url + "/v1/leases", data=big, headers=bearer(WORKER)) as response:
                assert response.status == 413

    run(scenario())


def test_rollouts_of_one_request_must_share_a_worker_id(
    serve: ServeFn, completion_ids: Any, sorted_answer: Any
) -> None:
    async def scenario() -> None:
        async with serve() as server:
            server.state.announce(0)
            (lease,) = server.state.grant_leases("alice/w0", 1)
            batch = rollouts_for(server, [lease], completion_ids, sorted_answer)
            batch.rollouts[1] = batch.rollouts[1].model_copy(update={"worker_id": "w1"})
            async with server.http.post(
                server.url + "/v1/rollouts", data=batch.model_dump_json(), headers=bearer(WORKER)
            ) as response:
                assert response.status == 400
                assert "worker_id" in (await response.json())["error"]
            assert server.state.rollouts_accepted == 0

    run(scenario())


@pytest.mark.parametrize("query", ["", "?trainer_version=x"])
def test_batch_needs_an_integer_trainer_version(serve: ServeFn, query: str) -> None:
    async def scenario() -> None:
        async with serve() as server:
            async with server.http.get(server.url + "/v1/batch" + query, headers=bearer(TRAINER)) as response:
                assert response.status == 400
                assert "trainer_version" in (await response.json())["error"]

    run(scenario())


# -- the protocol through the real client -------------------------------------------------


def test_version_announcement(serve: ServeFn) -> None:
    async def scenario() -> None:
        async with serve(orchestrator={"lease_wait_s": 0.0}) as server:
            worker, trainer = server.client(WORKER), server.client(TRAINER)
            assert (await asyncio.to_thread(worker.info)).policy_version is None
            empty = await asyncio.to_thread(worker.lease, LeaseRequest(worker_id="w0", max_groups=4))
            assert empty.leases == [] and empty.policy_version is None and empty.retry_after_s > 0

            status = await asyncio.to_thread(trainer.announce, 0)
            assert status.policy_version == 0 and status.trainer_version == 0
            assert (await asyncio.to_thread(worker.info)).policy_version == 0
            granted = await asyncio.to_thread(worker.lease, LeaseRequest(worker_id="w0", max_groups=4))
            assert granted.policy_version == 0 and len(granted.leases) == 4
            assert granted.sampling == server.state.sampling

    run(scenario())


def test_lease_rollouts_batch_cycle(serve: ServeFn, completion_ids: Any, sorted_answer: Any) -> None:
    async def scenario() -> None:
        async with serve() as server:
            worker, trainer = server.client(WORKER), server.client(TRAINER)
            await asyncio.to_thread(trainer.announce, 0)
            response = await asyncio.to_thread(worker.lease, LeaseRequest(worker_id="w0", max_groups=2))
            assert len(response.leases) == 2
            posted = rollouts_for(server, response.leases, completion_ids, sorted_answer)
            # One sample of the first group answers wrong while claiming full marks.
            wrong = posted.rollouts[0].model_copy(
                update={"completion_token_ids": completion_ids("===="), "logprobs": [-0.5] * 5, "claimed_reward": 1.0}
            )
            posted.rollouts[0] = wrong

            ingest = await asyncio.to_thread(worker.post_rollouts, posted)
            assert (ingest.accepted, ingest.duplicates, ingest.rejected) == (6, 0, [])
            again = await asyncio.to_thread(worker.post_rollouts, posted)  # a resend is idempotent
            assert (again.accepted, again.duplicates) == (0, 6)

            batch = await asyncio.to_thread(trainer.batch, 0)
            assert batch is not None
            assert batch.trainer_version == 0 and len(batch.samples) == 6
            assert batch.rollouts_accepted == 6
            assert batch.staleness_histogram == {"0": 6}
            rewards = sorted(s.reward for s in batch.samples)
            assert rewards == [0.0, 1.0, 1.0, 1.0, 1.0, 1.0]
            wrong_sample = next(s for s in batch.samples if s.reward == 0.0)
            assert wrong_sample.advantage == pytest.approx(-2 / 3)  # 0 - mean(0, 1, 1)
            assert sum(s.advantage for s in batch.samples) == pytest.approx(0.0, abs=1e-9)

            status = await asyncio.to_thread(worker.status)
            assert status.groups_served == 2 and status.rollouts_accepted == 6

    run(scenario())


def test_rejections_come_back_per_rollout(serve: ServeFn, completion_ids: Any, sorted_answer: Any) -> None:
    async def scenario() -> None:
        async with serve() as server:
            worker = server.client(WORKER)
            server.state.announce(0)
            response = await asyncio.to_thread(worker.lease, LeaseRequest(worker_id="w0", max_groups=1))
            posted = rollouts_for(server, response.leases, completion_ids, sorted_answer, worker_id="w9")
            # Same token, another worker id: not the holder of the lease.
            result = await asyncio.to_thread(worker.post_rollouts, posted)
            assert result.accepted == 0
            assert {r.reason for r in result.rejected} == {"not_lease_holder"}

    run(scenario())


def test_client_raises_orchestrator_error_with_the_server_message(serve: ServeFn) -> None:
    async def scenario() -> None:
        async with serve() as server:
            with pytest.raises(OrchestratorError) as info:
                await asyncio.to_thread(server.client(WORKER).batch, 0)
            assert info.value.status == 403
            assert "may not call /v1/batch" in str(info.value)

    run(scenario())


def test_batch_is_204_when_none_arrives_in_time(serve: ServeFn) -> None:
    async def scenario() -> None:
        async with serve(orchestrator={"batch_wait_s": 0.3}) as server:
            server.state.announce(0)
            started = time.monotonic()
            batch = await asyncio.to_thread(server.client(TRAINER).batch, 0)
            elapsed = time.monotonic() - started
            assert batch is None
            assert 0.3 <= elapsed < 5.0

    run(scenario())


def test_batch_long_poll_wakes_when_rollouts_complete_it(
    serve: ServeFn, completion_ids: Any, sorted_answer: Any
) -> None:
    async def scenario() -> None:
        async with serve(orchestrator={"batch_wait_s": 20.0}) as server:
            worker, trainer = server.client(WORKER), server.client(TRAINER)
            await asyncio.to_thread(trainer.announce, 0)
            response = await asyncio.to_thread(worker.lease, LeaseRequest(worker_id="w0", max_groups=2))
            posted = rollouts_for(server, response.leases, completion_ids, sorted_answer)
            waiting = asyncio.create_task(asyncio.to_thread(trainer.batch, 0))
            await asyncio.sleep(0.2)
            assert not waiting.done()
            await asyncio.to_thread(worker.post_rollouts, posted)
            posted_at = time.monotonic()
            batch = await waiting
            assert batch is not None and len(batch.samples) == 6
            # Woken by the notification, not by the handler's once-a-second re-check (which
            # would come about 0.8 s after posting) nor by the 20 s deadline.
            assert time.monotonic() - posted_at < 0.5

    run(scenario())


def test_lease_long_poll_wakes_when_a_version_frees_the_budget(serve: ServeFn) -> None:
    async def scenario() -> None:
        # max_staleness 1, 2 groups a step: version 0 allows 4 groups in all.
        async with serve(orchestrator={"lease_wait_s": 20.0}) as server:
            worker, trainer = server.client(WORKER), server.client(TRAINER)
            await asyncio.to_thread(trainer.announce, 0)
            first = await asyncio.to_thread(worker.lease, LeaseRequest(worker_id="w0", max_groups=8))
            assert len(first.leases) == 4
            waiting = asyncio.create_task(asyncio.to_thread(worker.lease, LeaseRequest(worker_id="w1", max_groups=8)))
            await asyncio.sleep(0.3)
            assert not waiting.done()  # held, not answered empty
            await asyncio.to_thread(trainer.announce, 1)
            announced_at = time.monotonic()
            second = await waiting
            assert second.policy_version == 1 and len(second.leases) == 2 and second.retry_after_s == 0.0
            # Woken by the announcement, not by the twice-a-second re-check nor the 20 s deadline.
            assert time.monotonic() - announced_at < 0.4

    run(scenario())


def test_lease_long_poll_answers_empty_at_its_deadline_and_sees_expiries(serve: ServeFn) -> None:
    async def scenario() -> None:
        async with serve(orchestrator={"lease_wait_s": 0.4}) as server:
            worker, trainer = server.client(WORKER), server.client(TRAINER)
            await asyncio.to_thread(trainer.announce, 0)
            assert len((await asyncio.to_thread(worker.lease, LeaseRequest(worker_id="w0", max_groups=8))).leases) == 4
            started = time.monotonic()
            empty = await asyncio.to_thread(worker.lease, LeaseRequest(worker_id="w1", max_groups=8))
            assert empty.leases == [] and empty.retry_after_s == 0.0  # the server already waited
            assert 0.4 <= time.monotonic() - started < 3.0
        async with serve(orchestrator={"lease_wait_s": 10.0, "lease_timeout_s": 1.0}) as server:
            worker, trainer = server.client(WORKER), server.client(TRAINER)
            await asyncio.to_thread(trainer.announce, 0)
            expiring = await asyncio.to_thread(worker.lease, LeaseRequest(worker_id="w0", max_groups=8))
            started = time.monotonic()
            # Nothing announces an expiry: the waiting request's own re-check finds it.
            again = await asyncio.to_thread(worker.lease, LeaseRequest(worker_id="w1", max_groups=8))
            assert 0.9 <= time.monotonic() - started < 3.0
            assert sorted(lease.prompt_id for lease in again.leases) == sorted(lease.prompt_id for lease in expiring.leases)

    run(scenario())


def test_non_finite_logprobs_cannot_break_the_trainers_batch(
    serve: ServeFn, completion_ids: Any, sorted_answer: Any
) -> None:
    async def scenario() -> None:
        async with serve(orchestrator={"batch_wait_s": 0.3}) as server:
            worker, trainer = server.client(WORKER), server.client(TRAINER)
            await asyncio.to_thread(trainer.announce, 0)
            response = await asyncio.to_thread(worker.lease, LeaseRequest(worker_id="w0", max_groups=2))
            body = json.loads(rollouts_for(server, response.leases, completion_ids, sorted_answer).model_dump_json())
            body["rollouts"][0]["logprobs"][0] = float("nan")
            async with server.http.post(
                server.url + "/v1/rollouts", data=json.dumps(body), headers=bearer(WORKER)
            ) as posted:
                assert posted.status in (200, 400)
            # Whatever the orchestrator made of it, the trainer must get a batch it can read (or none).
            await asyncio.to_thread(trainer.batch, 0)

    run(scenario())


# -- what a worker computes on ---------------------------------------------------------------

MACHINE = {"backend": "hf", "device": "cpu", "isa": "avx2", "threads": 1, "compute_dtype": "float32"}


def test_status_shows_what_each_workers_machine_computes_in(serve: ServeFn) -> None:
    async def scenario() -> None:
        async with serve(orchestrator={"lease_wait_s": 0.0}) as server:
            worker = server.client(WORKER)
            before = await asyncio.to_thread(worker.status)
            assert "alice" not in before.workers
            request = LeaseRequest.model_validate({"worker_id": "w0", "max_groups": 1, "machine": MACHINE})
            await asyncio.to_thread(worker.lease, request)
            status = await asyncio.to_thread(worker.status)
            assert status.workers["alice"]["machine"] == MACHINE
            await asyncio.to_thread(worker.lease, LeaseRequest(worker_id="w0", max_groups=1))  # says nothing: kept
            assert (await asyncio.to_thread(worker.status)).workers["alice"]["machine"] == MACHINE

    run(scenario())


@pytest.mark.parametrize(
    ("machine", "field"),
    [
        ({**MACHINE, "threads": "1"}, "machine.threads"),  # strict: no strings for numbers
        ({**MACHINE, "threads": 0}, "machine.threads"),
        ({**MACHINE, "threads": 10**9}, "machine.threads"),
        ({**MACHINE, "isa": "avx2<script>"}, "machine.isa"),
        ({**MACHINE, "isa": "a" * 17}, "machine.isa"),
        ({**MACHINE, "device": "x" * 65}, "machine.device"),
        ({**MACHINE, "device": "cpu\n[fake] log line"}, "machine.device"),
        ({**MACHINE, "compute_dtype": "float8"}, "machine.compute_dtype"),
        ({**MACHINE, "backend": "llama.cpp"}, "machine.backend"),
        ({**MACHINE, "flops": 1e18}, "machine.flops"),
        ("cpu", "machine"),
    ],
)
def test_a_malformed_machine_is_400_naming_the_field(serve: ServeFn, machine: object, field: str) -> None:
    async def scenario() -> None:
        async with serve() as server:
            body = json.dumps({"worker_id": "w0", "max_groups": 1, "machine": machine})
            async with server.http.post(server.url + "/v1/leases", data=body, headers=bearer(WORKER)) as response:
                assert response.status == 400
                assert field in (await response.json())["error"]
            status = await asyncio.to_thread(server.client(WORKER).status)
            assert "alice" not in status.workers  # nothing of a refused request is kept

    run(scenario())
