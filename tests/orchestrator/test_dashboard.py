"""The dashboard's routes (orchestrator/dashboard.py) on a real app on loopback: the page, the
JSON it polls (with a run's curves, workers, samples and the trainer's step metrics), its auth,
and its bad input; the bounded history (orchestrator/history.py)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from decentrl.api.wire import LeaseRequest, Rollout, RolloutBatch, TrainerStep
from decentrl.tasks import build_task
from orchestrator.appstate import HISTORY
from orchestrator.history import POINTS_KEPT, SAMPLES_KEPT, History
from orchestrator.state import RunState
from tests.orchestrator.conftest import ADMIN, TRAINER, WORKER


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def run(coro: Awaitable[None]) -> None:
    asyncio.run(asyncio.wait_for(coro, timeout=30))  # type: ignore[arg-type]


def test_page_is_static_and_its_data_needs_a_token(serve: Any) -> None:
    async def scenario() -> None:
        async with serve() as server:
            status, page, _ = await server.call("GET", "/")
            assert status == 200 and "<canvas" in page and "unit" not in page  # no run data in the page
            assert "http://" not in page and "https://" not in page  # no CDN: works offline
            status, body, _ = await server.call("GET", "/v1/dashboard")
            assert status == 401 and "bearer token" in body["error"]
            for token in (WORKER, TRAINER, ADMIN):
                status, body, _ = await server.call("GET", "/v1/dashboard", token)
                assert status == 200 and body["status"]["run_name"] == "unit"

    run(scenario())


def test_metrics_public_opens_the_dashboard_data(serve: Any) -> None:
    async def scenario() -> None:
        async with serve(orchestrator={"metrics_public": True}) as server:
            status, body, _ = await server.call("GET", "/v1/dashboard")
            assert status == 200 and body["status"]["run_name"] == "unit"
            status, _, _ = await server.call("GET", "/v1/status")  # the rest still needs one
            assert status == 401

    run(scenario())


def test_dashboard_shows_a_run_and_never_a_token(
    serve: Any, completion_ids: Callable[[str], list[int]], sorted_answer: Callable[[str], str]
) -> None:
    async def scenario() -> None:
        async with serve() as server:
            worker, trainer = server.client(WORKER), server.client(TRAINER)
            await asyncio.to_thread(trainer.announce, 0)
            granted = await asyncio.to_thread(worker.lease, LeaseRequest(worker_id="w0", max_groups=2))
            rollouts = []
            for lease in granted.leases:
                answer = sorted_answer(server.state.task.prompt(lease.prompt_id).text)
                for i in range(lease.group_size):
                    ids = completion_ids(answer if i else answer[::-1])  # rewards differ in a group
                    rollouts.append(Rollout(
                        rollout_id=f"{lease.lease_id}-{i}", run_name="unit", lease_id=lease.lease_id,
                        prompt_id=lease.prompt_id, worker_id="w0", policy_version=0,
                        prompt_token_ids=lease.prompt_token_ids, completion_token_ids=ids, logprobs=[-0.5] * len(ids),
                        finish_reason="stop", sampling=server.state.sampling,
                    ))
            ingested = await asyncio.to_thread(worker.post_rollouts, RolloutBatch(rollouts=rollouts))
            assert ingested.accepted == len(rollouts)
            batch = await asyncio.to_thread(trainer.batch, 0)
            assert batch is not None
            await asyncio.to_thread(trainer.report_step, {
                "step": 1, "loss": 0.25, "grad_norm": 1.5, "entropy": 2.0, "reward_mean": 0.5,
                "staleness_histogram": {"0": 3}, "replayed": False, "kl": float("nan"),
            })
            await asyncio.to_thread(trainer.announce, 1)
            await asyncio.sleep(1.2)  # the sampler's next point
            status, text, _ = await server.call("GET", "/v1/dashboard?since=0", ADMIN)
            assert status == 200
            for secret in (WORKER, TRAINER, ADMIN):
                assert secret not in json.dumps(text)
            data = text
            assert len(data["points"]) >= 2 and data["points"][-1]["rollouts_accepted"] == len(rollouts)
            assert data["steps"] == [{"step": 1, "t": data["steps"][0]["t"], "entropy": 2.0, "grad_norm": 1.5,
                                      "loss": 0.25, "reward_mean": 0.5}]  # finite numbers only
            assert [v["version"] for v in data["versions"]] == [0, 1]
            assert data["versions"][0]["first_rollout"] is not None  # rollouts of v0 came back
            assert data["staleness"] == {"0": len(batch.samples)}
            (row,) = data["workers"]
            assert row["worker"] == "alice" and row["accepted"] == len(rollouts) and row["version"] == 0
            assert row["last_seen_s"] >= 0 and row["tokens_per_s"] is not None
            assert 1 <= len(data["samples"]) <= 4 and all(s["completion"] for s in data["samples"])
            assert {s["reward"] for s in data["samples"]} <= {sample.reward for sample in batch.samples}
            # The next poll answers only what is new.
            status, again, _ = await server.call("GET", f"/v1/dashboard?since={data['now']}", ADMIN)
            assert status == 200 and again["steps"] == [] and again["samples"] == [] and len(again["points"]) <= 1

    run(scenario())


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"step": 1, "metrics": {"loss": "NaN"}}, "metrics.loss"),
        ({"step": 1, "metrics": {"loss": 1e400}}, "metrics.loss"),
        ({"step": 0, "metrics": {}}, "step"),
        ({"step": 1, "metrics": {"Bad Name": 1.0}}, "metrics"),
        ({"step": 1, "metrics": {f"m{i}": 1.0 for i in range(65)}}, "metrics"),
        ({"step": 1, "metrics": {"loss": [1.0]}}, "metrics.loss"),
        ({"step": 1, "metrics": {}, "extra": 1}, "extra"),
    ],
)
def test_bad_step_metrics_are_400_naming_the_field(serve: Any, body: dict[str, Any], field: str) -> None:
    async def scenario() -> None:
        async with serve() as server:
            status, answer, _ = await server.call("POST", "/v1/trainer/steps", TRAINER, data=json.dumps(body).replace("Infinity", "1e400"),
                                                  headers={"Content-Type": "application/json"})
            assert status == 400 and answer["error"].startswith("invalid TrainerStep") and field in answer["error"]
            assert not server.app[HISTORY].steps

    run(scenario())


def test_only_the_trainer_posts_steps_and_since_is_checked(serve: Any) -> None:
    async def scenario() -> None:
        async with serve() as server:
            body = TrainerStep(step=1, metrics={"loss": 1.0}).model_dump_json()
            status, _, _ = await server.call("POST", "/v1/trainer/steps", WORKER, data=body,
                                             headers={"Content-Type": "application/json"})
            assert status == 403
            for since in ("abc", "-1", "1e13", "nan"):
                status, answer, _ = await server.call("GET", f"/v1/dashboard?since={since}", ADMIN)
                assert status == 400 and "since" in answer["error"], since

    run(scenario())


def test_history_is_bounded_and_a_resumed_trainer_replaces_its_steps(make_config: Any, tokenizer: Any) -> None:
    config = make_config()
    state = RunState(config=config, task=build_task(config.task), tokenizer=tokenizer)
    clock = iter(range(10**6))
    history = History(clock=lambda: float(next(clock)))
    for _ in range(POINTS_KEPT + 10):
        history.sample(state.status(), inflight=0)
    assert len(history.points) == POINTS_KEPT
    for step in (1, 2, 3, 2, 3):  # resumed after step 1's checkpoint
        history.trainer_step(step, {"loss": float(step)})
    assert [s["step"] for s in history.steps] == [1, 2, 3]
    history.announced(3)
    history.announced(3)  # a restarted trainer announces its newest version again
    assert [v.version for v in history.versions] == [3]
    assert history.samples.maxlen == SAMPLES_KEPT
