"""The scoring stage (orchestrator/score_queue.py) over real HTTP on loopback: scorers lease
samples of complete groups, post scores, and the groups join the line with combined rewards;
leases expire and are reassigned; bad posts are refused with a reason; tokens keep to their
role; a restart loses no score; groups keep their place and go stale while they wait."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from transformers import PreTrainedTokenizerBase

from decentrl.api.wire import Lease, Rollout
from decentrl.tasks import build_task
from orchestrator.auth import TokenRegistry
from orchestrator.journal import Journal
from orchestrator.metrics import Metrics
from orchestrator.state import RunState

SCORER, SCORER2, WORKER, TRAINER, ADMIN = "scorer-secret", "scorer2-secret", "worker-secret", "trainer-secret", "admin-secret"
TOKENS = [
    {"name": "judge", "role": "scorer", "token": SCORER},
    {"name": "judge2", "role": "scorer", "token": SCORER2},
    {"name": "alice", "role": "worker", "token": WORKER},
    {"name": "trainer", "role": "trainer", "token": TRAINER},
    {"name": "root", "role": "admin", "token": ADMIN},
]
MODEL = {"orchestrator": {"lease_wait_s": 0.0, "rewards": {"type": "model", "lease_timeout_s": 5.0}}}


def run(coro: Awaitable[None]) -> None:
    asyncio.run(asyncio.wait_for(coro, timeout=30))  # type: ignore[arg-type]


@pytest.fixture
def make_state(make_config: Any, tokenizer: PreTrainedTokenizerBase, clock: Any) -> Callable[..., RunState]:
    def make(journal: str | None = None, **overrides: Any) -> RunState:
        config = make_config(**{**MODEL, **overrides})
        state = RunState(
            config=config, task=build_task(config.task), tokenizer=tokenizer, clock=clock,
            journal=Journal(journal, run_name=config.run_name) if journal else None,
        )
        if state.published_version is None:
            state.announce(0)
        return state

    return make


@pytest.fixture
def complete_group(make_rollout: Any, sorted_answer: Callable[[str], str]) -> Callable[..., Lease]:
    """Lease one prompt and post its whole group (right answers but for the first `wrong`)."""

    def complete(state: RunState, *, wrong: int = 0, policy_version: int = 0) -> Lease:
        (lease,) = state.grant_leases("alice/w0", 1)
        right = sorted_answer(state.task.prompt(lease.prompt_id).text)
        rollouts: list[Rollout] = [
            make_rollout(lease, "====" if i < wrong else right, policy_version=policy_version,
                         **({"sample_index": i} if lease.index is not None else {}))  # deterministic runs
            for i in range(lease.group_size)
        ]
        assert state.ingest(rollouts, "alice/w0").accepted == lease.group_size
        return lease

    return complete


async def lease_items(server: Any, token: str = SCORER, scorer_id: str = "s0", max_items: int = 64) -> dict[str, Any]:
    status, body, _ = await server.call("POST", "/v1/score/leases", token, json={"scorer_id": scorer_id, "max_items": max_items})
    assert status == 200, body
    return body


async def post(server: Any, body: dict[str, Any], token: str = SCORER) -> tuple[int, Any]:
    status, answer, _ = await server.call("POST", "/v1/scores", token, json=body)
    return status, answer


def scores_for(lease: dict[str, Any], value: float = 0.5, **extra: Any) -> dict[str, Any]:
    return {
        "lease_id": lease["lease_id"], "scorer_id": "s0",
        "scores": [{"rollout_id": item["rollout_id"], "score": value, **extra} for item in lease["items"]],
    }


def test_a_group_waits_for_its_scores_then_trains_on_them(
    make_state: Any, complete_group: Any, serve_orchestrator: Any, tokenizer: Any
) -> None:
    state = make_state(trainer={"groups_per_step": 1, "steps": 3})
    lease = complete_group(state)
    assert state.take_batch(0) is None and state.status().groups_scoring == 1
    assert state.lease_capacity() < make_state(trainer={"groups_per_step": 1, "steps": 3}).lease_capacity()

    async def scenario() -> None:
        async with serve_orchestrator(state, TokenRegistry(TOKENS)) as server:
            got = await lease_items(server)
            assert len(got["items"]) == 3 and got["score_range"] == [0.0, 1.0]
            item = got["items"][0]
            assert item["prompt"] == state.task.prompt(lease.prompt_id).text and item["steps"] is None
            assert item["completion"] == tokenizer.decode(
                state.buffer.pending[lease.lease_id].samples[0][0].completion_token_ids, skip_special_tokens=True
            )
            body = scores_for(got)
            for i, score in enumerate(body["scores"]):
                score["score"] = [0.0, 0.25, 1.0][i]
            assert await post(server, body) == (200, {"accepted": 3, "duplicates": 0, "unscored": 0})
            assert await post(server, body) == (200, {"accepted": 0, "duplicates": 3, "unscored": 0})  # idempotent
            status, batch, _ = await server.call("GET", "/v1/batch?trainer_version=0", TRAINER)
            assert status == 200
            assert [s["reward"] for s in batch["samples"]] == [0.0, 0.25, 1.0]
            assert [s["advantage"] for s in batch["samples"]] == pytest.approx([-5 / 12, -2 / 12, 7 / 12])
            text = (await server.call("GET", "/metrics", TRAINER))[1]
            assert "decentrl_scores_posted_total 3.0" in text and "decentrl_scores_duplicate_total 3.0" in text
            assert "decentrl_scores_waiting 0.0" in text

    run(scenario())


def test_sum_weights_the_verifier_and_the_model(make_state: Any, complete_group: Any, serve_orchestrator: Any) -> None:
    state = make_state(orchestrator={"lease_wait_s": 0.0, "rewards": {
        "type": "sum", "verifier_weight": 2.0, "model_weight": 0.5, "score_range": [-1.0, 1.0]}})
    lease = complete_group(state, wrong=1)

    async def scenario() -> None:
        async with serve_orchestrator(state, TokenRegistry(TOKENS)) as server:
            got = await lease_items(server)
            assert (await post(server, scores_for(got, -1.0)))[0] == 200
    run(scenario())
    (group,) = state.ready
    assert group.lease_id == lease.lease_id
    assert [reward for _, reward in group.samples] == [2.0 * 0.0 - 0.5, 2.0 * 1.0 - 0.5, 2.0 * 1.0 - 0.5]


def test_an_expired_score_lease_is_reassigned_and_its_late_post_refused(
    make_state: Any, complete_group: Any, serve_orchestrator: Any, clock: Any
) -> None:
    state = make_state()
    complete_group(state)

    async def scenario() -> None:
        async with serve_orchestrator(state, TokenRegistry(TOKENS)) as server:
            first = await lease_items(server, max_items=2)
            assert len(first["items"]) == 2
            third = await lease_items(server, SCORER2, "s1")
            assert len(third["items"]) == 1
            assert (await lease_items(server, SCORER2, "s1"))["items"] == []
            status, renewed, _ = await server.call(
                "POST", f"/v1/score/leases/{first['lease_id']}/renew?scorer_id=s0", SCORER)
            assert status == 200 and renewed["unscored"] == 2
            clock.advance(6.0)  # past lease_timeout_s = 5
            again = await lease_items(server, SCORER2, "s1")  # both leases expired: all three again
            assert sorted(i["rollout_id"] for i in again["items"]) == sorted(
                i["rollout_id"] for i in first["items"] + third["items"])
            status, answer = await post(server, scores_for(first))
            assert status == 409 and "expired" in answer["error"]
            status, answer, _ = await server.call("POST", f"/v1/score/leases/{first['lease_id']}/renew?scorer_id=s0", SCORER)
            assert status == 409
            assert (await post(server, {**scores_for(again), "scorer_id": "s1"}, SCORER2))[0] == 200
            text = (await server.call("GET", "/metrics", TRAINER))[1]
            assert "decentrl_scores_reassigned_total 3.0" in text and "decentrl_score_leases_expired_total 2.0" in text

    run(scenario())
    assert len(state.ready) == 1


async def ask(server: Any, token: str, scorer_id: str, max_items: int = 64, ahead: bool = False) -> list[str]:
    body = {"scorer_id": scorer_id, "max_items": max_items, "ahead": ahead}
    status, answer, _ = await server.call("POST", "/v1/score/leases", token, json=body)
    assert status == 200, answer
    return [item["rollout_id"] for item in answer["items"]]


def test_a_lease_asked_ahead_yields_to_an_idle_scorer(
    make_state: Any, complete_group: Any, serve_orchestrator: Any
) -> None:
    state = make_state(orchestrator={"lease_wait_s": 1.5, "rewards": {"type": "model", "lease_timeout_s": 5.0}})

    async def both_waiting(server: Any, idle_items: int) -> tuple[list[str], list[str]]:
        """An idle scorer and one asking ahead both long-poll when a group completes."""
        ahead = asyncio.ensure_future(ask(server, SCORER, "s0", ahead=True))
        await asyncio.sleep(0.1)
        idle = asyncio.ensure_future(ask(server, SCORER2, "s1", idle_items))
        await asyncio.sleep(0.15)
        complete_group(state)  # no wake-up: each sees it on its next 0.5 s look, the one ahead first
        return await idle, await ahead

    async def scenario() -> None:
        async with serve_orchestrator(state, TokenRegistry(TOKENS)) as server:
            complete_group(state)
            assert len(await ask(server, SCORER, "s0", ahead=True)) == 3  # no idle scorer: it takes them
            idle, ahead = await both_waiting(server, idle_items=64)
            assert (len(idle), ahead) == (3, [])  # all went to the idle one; the other's poll ran out
            idle, ahead = await both_waiting(server, idle_items=2)
            assert (len(idle), len(ahead)) == (2, 1)  # what the idle one left went ahead
            assert state.score_queue.leased() == 9

    run(scenario())


def test_a_dead_scorers_leases_in_hand_all_expire_and_go_to_the_next(
    make_state: Any, complete_group: Any, serve_orchestrator: Any, clock: Any
) -> None:
    state = make_state()
    complete_group(state)
    complete_group(state)

    async def scenario() -> None:
        async with serve_orchestrator(state, TokenRegistry(TOKENS)) as server:
            scoring = await ask(server, SCORER, "s0", max_items=3)
            prefetched = await ask(server, SCORER, "s0", max_items=3, ahead=True)  # the next lease, in hand
            assert len(scoring) == len(prefetched) == 3 and len(state.score_queue.leases) == 2
            assert await ask(server, SCORER2, "s1") == []
            clock.advance(6.0)  # s0 died: neither lease is renewed past lease_timeout_s = 5
            assert sorted(await ask(server, SCORER2, "s1")) == sorted(scoring + prefetched)
            assert state.score_queue.counts["scores_reassigned"] == 6

    run(scenario())


@pytest.mark.parametrize(
    ("body", "field"),
    [({"max_items": 0}, "max_items"), ({"max_items": 1025}, "max_items"), ({"max_items": True}, "max_items"),
     ({"max_items": "4"}, "max_items"), ({"ahead": 1}, "ahead"), ({"ahead": "true"}, "ahead"),
     ({"ahead": None}, "ahead"), ({"scorer_id": "a b"}, "scorer_id"), ({"extra": 1}, "extra")],
)
def test_bad_score_lease_requests_are_refused_with_a_reason(
    make_state: Any, serve_orchestrator: Any, body: dict[str, Any], field: str
) -> None:
    async def scenario() -> None:
        async with serve_orchestrator(make_state(), TokenRegistry(TOKENS)) as server:
            request = {"scorer_id": "s0", "max_items": 4, **body}
            status, answer, _ = await server.call("POST", "/v1/score/leases", SCORER, json=request)
            assert status == 400 and field in answer["error"], answer

    run(scenario())


def bad_posts() -> list[tuple[str, Callable[[dict[str, Any]], Any], int, str]]:
    def one(lease: dict[str, Any], **fields: Any) -> dict[str, Any]:
        body = scores_for(lease)
        body["scores"] = [{**body["scores"][0], **fields}]
        return body

    return [
        ("nan", lambda l: json.dumps(one(l)).replace('"score": 0.5', '"score": NaN'), 400, "finite"),
        ("infinite", lambda l: json.dumps(one(l)).replace('"score": 0.5', '"score": Infinity'), 400, "finite"),
        ("above range", lambda l: one(l, score=1.5), 400, "outside score_range"),
        ("below range", lambda l: one(l, score=-0.01), 400, "outside score_range"),
        ("bool", lambda l: one(l, score=True), 400, "score"),
        ("string", lambda l: one(l, score="0.5"), 400, "score"),
        ("steps not asked", lambda l: one(l, step_scores=[0.5]), 400, "no steps"),
        ("not in lease", lambda l: {**one(l), "scores": [{"rollout_id": "someone-else", "score": 0.5}]}, 400, "not in score lease"),
        ("twice", lambda l: {**scores_for(l), "scores": scores_for(l)["scores"][:1] * 2}, 400, "twice"),
        ("score and failure", lambda l: one(l, failure="parse"), 400, "either"),
        ("neither", lambda l: one(l, score=None), 400, "either"),
        ("unknown failure", lambda l: one(l, score=None, failure="timeout"), 400, "failure"),
        ("no scores", lambda l: {**scores_for(l), "scores": []}, 400, "scores"),
        ("extra field", lambda l: {**scores_for(l), "weight": 1}, 400, "weight"),
        ("unknown lease", lambda l: {**scores_for(l), "lease_id": "f" * 32}, 404, "no score lease"),
        ("other scorer id", lambda l: {**scores_for(l), "scorer_id": "s9"}, 403, "another scorer"),
    ]


@pytest.mark.parametrize(("name", "make_body", "status", "reason"), bad_posts(), ids=[b[0] for b in bad_posts()])
def test_bad_score_posts_are_refused_with_a_reason_and_take_nothing(
    make_state: Any, complete_group: Any, serve_orchestrator: Any, name: str, make_body: Any, status: int, reason: str
) -> None:
    state = make_state()
    complete_group(state)

    async def scenario() -> None:
        async with serve_orchestrator(state, TokenRegistry(TOKENS)) as server:
            got = await lease_items(server)
            body = make_body(got)
            kwargs = {"data": body, "headers": {"Content-Type": "application/json"}} if isinstance(body, str) else {"json": body}
            code, answer, _ = await server.call("POST", "/v1/scores", SCORER, **kwargs)
            assert code == status and reason in answer["error"], answer
            assert state.score_queue.counts["scores_posted"] == 0 and state.score_queue.waiting() == 3

    run(scenario())


def test_a_post_is_all_or_nothing(make_state: Any, complete_group: Any, serve_orchestrator: Any) -> None:
    state = make_state()
    complete_group(state)

    async def scenario() -> None:
        async with serve_orchestrator(state, TokenRegistry(TOKENS)) as server:
            got = await lease_items(server)
            body = scores_for(got)
            body["scores"][2]["score"] = 7.0
            code, answer = await post(server, body)
            assert code == 400 and got["items"][2]["rollout_id"] in answer["error"]
            assert state.score_queue.waiting() == 3
            status, other = await post(server, scores_for(got), SCORER2)  # another token, same scorer id
            assert status == 403 and "another scorer" in other["error"]

    run(scenario())


def test_step_scores_must_match_the_steps_and_become_token_advantages(
    make_state: Any, make_rollout: Any, serve_orchestrator: Any
) -> None:
    state = make_state(trainer={"groups_per_step": 1, "steps": 3}, orchestrator={
        "lease_wait_s": 0.0, "rewards": {"type": "model", "step_scores": True},
        "advantages": {"steps": {"type": "delimiter", "delimiter": "3"}}})
    (lease,) = state.grant_leases("alice/w0", 1)
    state.ingest([make_rollout(lease, "1234") for _ in range(lease.group_size)], "alice/w0")

    async def scenario() -> None:
        async with serve_orchestrator(state, TokenRegistry(TOKENS)) as server:
            got = await lease_items(server)
            assert got["items"][0]["steps"] == ["12", "4"]
            for step_scores, reason in ([[0.5]], "1 step scores for 2 steps"), ([[0.5, 2.0]], "step score 2.0"), (None, "one step score"):
                body = scores_for(got)
                body["scores"][0]["step_scores"] = step_scores[0] if step_scores else None
                code, answer = await post(server, body)
                assert code == 400 and reason in answer["error"], answer
            body = scores_for(got)
            for score, steps in zip(body["scores"], ([0.25, 0.75], [0.75, 0.25], [0.5, 0.5]), strict=True):
                score["step_scores"] = steps
            assert (await post(server, body))[0] == 200
            # Step scores normalized over the group's six: [-0.25, 0.25], [0.25, -0.25], [0, 0]; returns
            # per step [0, 0.25], [0, -0.25], [0, 0]; step 0 ends at the "3" (token 2), step 1 at the eos.
            expected = [[0.0, 0.0, 0.0, 0.25, 0.25], [0.0, 0.0, 0.0, -0.25, -0.25], [0.0] * 5]
            for accept in ("application/json", "application/msgpack"):
                status, batch, _ = await server.call(
                    "GET", "/v1/batch?trainer_version=0&request_id=r0", TRAINER, headers={"Accept": accept})
                assert status == 200
                assert [list(s["token_advantages"]) for s in batch["samples"]] == [pytest.approx(e) for e in expected]

    run(scenario())


def test_a_sample_without_step_scores_trains_on_its_outcome(make_state: Any, make_rollout: Any) -> None:
    from decentrl.api.wire import ScorePost, ScoreResult

    state = make_state(trainer={"groups_per_step": 1, "steps": 3}, orchestrator={
        "lease_wait_s": 0.0, "rewards": {"type": "model", "step_scores": True, "on_parse_failure": "default"},
        "advantages": {"steps": {"type": "delimiter", "delimiter": "3"}, "outcome_weight": 1.0}})
    (lease,) = state.grant_leases("alice/w0", 1)
    state.ingest([make_rollout(lease, "1234") for _ in range(lease.group_size)], "alice/w0")
    entry = state.lease_scores("judge/s0", 8)
    assert entry is not None
    results = [ScoreResult(rollout_id=entry.rollout_ids[0], score=None, failure="parse")] + [
        ScoreResult(rollout_id=rid, score=1.0, step_scores=steps)
        for rid, steps in zip(entry.rollout_ids[1:], ([0.0, 1.0], [1.0, 1.0]), strict=True)
    ]
    state.post_scores("judge/s0", ScorePost(lease_id=entry.lease_id, scorer_id="s0", scores=results))
    batch = state.take_batch(0)
    assert batch is not None
    first, second, third = batch.samples
    assert first.token_advantages is None and first.advantage == pytest.approx(-2 / 3)  # default 0 vs two 1s
    # The two scored: steps [0, 1] and [1, 1], mean 0.75: s = [-0.75, 0.25], [0.25, 0.25]; returns
    # [-0.5, 0.25] and [0.5, 0.25], plus their outcome advantage 1/3.
    assert second.token_advantages == pytest.approx([-0.5 + 1 / 3] * 3 + [0.25 + 1 / 3] * 2)
    assert third.token_advantages == pytest.approx([0.5 + 1 / 3] * 3 + [0.25 + 1 / 3] * 2)


@pytest.mark.parametrize(
    ("token", "method", "path"),
    [(SCORER, "POST", "/v1/leases"), (SCORER, "POST", "/v1/rollouts"), (SCORER, "GET", "/v1/batch?trainer_version=0"),
     (SCORER, "POST", "/v1/version"), (SCORER, "GET", "/v1/admin/tokens"), (SCORER, "GET", "/metrics"),
     (WORKER, "POST", "/v1/score/leases"), (WORKER, "POST", "/v1/scores"), (TRAINER, "POST", "/v1/scores"),
     (TRAINER, "POST", "/v1/score/leases/abc/renew?scorer_id=s0"), (ADMIN, "POST", "/v1/score/leases")],
)
def test_scorer_tokens_do_only_scorer_things(
    make_state: Any, serve_orchestrator: Any, token: str, method: str, path: str
) -> None:
    async def scenario() -> None:
        async with serve_orchestrator(make_state(), TokenRegistry(TOKENS)) as server:
            status, answer, _ = await server.call(method, path, token, json={})
            assert status == 403, answer
            assert (await server.call("GET", "/v1/info", SCORER))[0] == 200

    run(scenario())


@pytest.mark.parametrize("policy", ["default", "drop"])
def test_an_unparsed_judge_reply_is_scored_as_configured_and_counted(
    make_state: Any, complete_group: Any, serve_orchestrator: Any, policy: str
) -> None:
    state = make_state(orchestrator={"lease_wait_s": 0.0, "rewards": {
        "type": "model", "on_parse_failure": policy, "default_score": 0.125}})
    complete_group(state)

    async def scenario() -> None:
        async with serve_orchestrator(state, TokenRegistry(TOKENS)) as server:
            got = await lease_items(server)
            body = {**scores_for(got), "parse_retries": 4}
            body["scores"][1] = {"rollout_id": got["items"][1]["rollout_id"], "score": None, "failure": "parse"}
            assert (await post(server, body))[0] == 200
            text = (await server.call("GET", "/metrics", TRAINER))[1]
            assert "decentrl_judge_parse_failures_total 1.0" in text and "decentrl_judge_parse_retries_total 4.0" in text

    run(scenario())
    if policy == "default":
        assert [reward for _, reward in state.ready[0].samples] == [0.5, 0.125, 0.5]
    else:
        assert not state.ready and not state.pending and state.dropped["judge_parse_failure"] == 3


def test_a_group_that_goes_stale_waiting_is_dropped_and_counted(
    make_state: Any, complete_group: Any, serve_orchestrator: Any
) -> None:
    state = make_state(max_staleness=0, trainer={"groups_per_step": 1, "steps": 3})
    lease = complete_group(state)
    state.announce(1)  # the trainer moved on: version 0's group can no longer train
    assert lease.lease_id not in state.pending and state.dropped["stale_waiting_scores"] == 3
    assert state.stale_dropped == 3

    async def scenario() -> None:
        async with serve_orchestrator(state, TokenRegistry(TOKENS)) as server:
            assert (await lease_items(server))["items"] == []  # nothing to score for a dropped group
            text = (await server.call("GET", "/metrics", TRAINER))[1]
            assert 'decentrl_samples_dropped_total{reason="stale_waiting_scores"} 3.0' in text

    run(scenario())


def test_a_waiting_group_keeps_its_place(make_state: Any, complete_group: Any, serve_orchestrator: Any) -> None:
    state = make_state(trainer={"groups_per_step": 1, "steps": 3})
    first, second = complete_group(state), complete_group(state)

    async def scenario() -> None:
        async with serve_orchestrator(state, TokenRegistry(TOKENS)) as server:
            early, late = await lease_items(server, max_items=3), await lease_items(server, max_items=3)
            ids = [rollout.rollout_id for rollout, _ in state.pending[first.lease_id].samples]
            assert [i["rollout_id"] for i in early["items"]] == ids  # oldest first
            assert (await post(server, scores_for(late)))[0] == 200
            assert state.take_batch(0) is None  # the second group is ready, the first still waits ahead of it
            assert (await post(server, scores_for(early)))[0] == 200

    run(scenario())
    assert [group.lease_id for group in state.ready] == [first.lease_id, second.lease_id]


def test_a_restart_loses_no_score_and_no_waiting_sample(
    make_state: Any, complete_group: Any, serve_orchestrator: Any, tmp_path: Path
) -> None:
    path = str(tmp_path / "journal.sqlite")
    state = make_state(path)
    lease = complete_group(state)

    async def post_two() -> None:
        async with serve_orchestrator(state, TokenRegistry(TOKENS)) as server:
            got = await lease_items(server)
            body = scores_for(got, 0.75)
            body["scores"] = body["scores"][:2]
            assert (await post(server, body))[1]["unscored"] == 1

    run(post_two())
    state.journal.close()
    again = make_state(path)
    assert again.status().groups_scoring == 1 and again.score_queue.waiting() == 1

    async def post_last() -> None:
        async with serve_orchestrator(again, TokenRegistry(TOKENS)) as server:
            got = await lease_items(server)
            assert len(got["items"]) == 1
            assert (await post(server, scores_for(got, 0.25)))[0] == 200

    run(post_last())
    (group,) = again.ready
    assert group.lease_id == lease.lease_id and sorted(r for _, r in group.samples) == [0.25, 0.75, 0.75]
    again.journal.close()
    third = make_state(path)
    assert third.ready[0].held is None  # without step scores or teacher log-probs no sample is read at recovery
    assert sorted(r for _, r in third.ready[0].samples) == [0.25, 0.75, 0.75]
    third.journal.close()


def test_scoring_metrics_and_status_appear_only_for_model_rewards(make_state: Any, make_config: Any, tokenizer: Any) -> None:
    text = Metrics(make_state()).render().decode()
    assert "decentrl_scores_waiting 0.0" in text and "decentrl_scores_leased 0.0" in text
    config = make_config()
    plain = RunState(config=config, task=build_task(config.task), tokenizer=tokenizer)
    assert "decentrl_scores_waiting" not in Metrics(plain).render().decode()
    assert plain.status().scoring is None and make_state().status().scoring is not None


@pytest.mark.parametrize("check_first", [True, False])
def test_a_group_waits_for_both_its_check_and_its_scores(make_state: Any, complete_group: Any, check_first: bool) -> None:
    from decentrl.api.wire import ScorePost, ScoreResult

    state = make_state(orchestrator={"lease_wait_s": 0.0, "rewards": {"type": "model"},
                                     "verification": {"enabled": True, "new_worker_checks": 64}})
    lease = complete_group(state)
    assert state.pending[lease.lease_id].awaiting == {"check", "scores"} and len(state.verify_queue) == 1
    assert state.status().groups_verifying == 1 and state.status().groups_scoring == 1

    def score() -> None:
        entry = state.lease_scores("judge/s0", 8)
        assert entry is not None
        results = [ScoreResult(rollout_id=rid, score=0.5) for rid in entry.rollout_ids]
        state.post_scores("judge/s0", ScorePost(lease_id=entry.lease_id, scorer_id="s0", scores=results))

    first, second = (lambda: state.verification_done({lease.lease_id: {}}), score)
    if not check_first:
        first, second = second, first
    first()
    assert lease.lease_id in state.pending and not state.ready
    second()
    assert [group.lease_id for group in state.ready] == [lease.lease_id] and not state.pending


def test_a_group_failing_its_check_while_scored_is_dropped_and_its_items_go(make_state: Any, complete_group: Any) -> None:
    state = make_state(orchestrator={"lease_wait_s": 0.0, "rewards": {"type": "model"},
                                     "verification": {"enabled": True, "new_worker_checks": 64}})
    lease = complete_group(state)
    rollout_id = state.pending[lease.lease_id].samples[0][0].rollout_id
    state.verification_done({lease.lease_id: {rollout_id: "logprob_mismatch"}})
    assert not state.pending and state.dropped["failed_verification"] == 2
    assert state.lease_scores("judge/s0", 8) is None and state.score_queue.waiting() == 0


def test_a_deterministic_run_serves_waiting_groups_in_their_places(make_state: Any, complete_group: Any) -> None:
    from decentrl.api.wire import ScorePost, ScoreResult

    state = make_state(deterministic=True, trainer={"groups_per_step": 1, "steps": 3})
    first, second = complete_group(state), complete_group(state)
    assert (first.index, second.index) == (0, 1)

    def score(lease: Lease, value: float) -> None:
        ids = [rollout.rollout_id for rollout, _ in state.pending[lease.lease_id].samples]
        entry = state.lease_scores("judge/s0", 64)
        assert entry is not None
        state.post_scores("judge/s0", ScorePost(lease_id=entry.lease_id, scorer_id="s0", scores=[
            ScoreResult(rollout_id=rid, score=value) for rid in entry.rollout_ids if rid in ids]))

    score(second, 0.5)  # place 1 is scored first (its items are leased with place 0's, which stay unscored)
    assert [g.lease_id for g in state.ready] == [second.lease_id] and state.take_batch(0) is None
    state.clock.advance(6.0)  # the lease holding place 0's items expires; they are leased again
    score(first, 0.25)
    batch = state.take_batch(0)
    assert batch is not None and {s.group_id for s in batch.samples} == {first.lease_id}


def test_process_rewards_survive_a_restart(make_state: Any, make_rollout: Any, tmp_path: Path) -> None:
    from decentrl.api.wire import ScorePost, ScoreResult

    path = str(tmp_path / "journal.sqlite")
    options = {"trainer": {"groups_per_step": 1, "steps": 3}, "orchestrator": {
        "lease_wait_s": 0.0, "rewards": {"type": "model", "step_scores": True},
        "advantages": {"steps": {"type": "delimiter", "delimiter": "3"}}}}
    state = make_state(path, **options)
    for _ in range(2):  # one group to serve before the restart, one to keep in line
        (lease,) = state.grant_leases("alice/w0", 1)
        state.ingest([make_rollout(lease, "1234") for _ in range(lease.group_size)], "alice/w0")
    entry = state.lease_scores("judge/s0", 64)
    assert entry is not None and len(entry.rollout_ids) == 6
    steps = [[0.25, 0.75], [0.75, 0.25], [0.5, 0.5]] * 2
    state.post_scores("judge/s0", ScorePost(lease_id=entry.lease_id, scorer_id="s0", scores=[
        ScoreResult(rollout_id=rid, score=0.5, step_scores=s) for rid, s in zip(entry.rollout_ids, steps, strict=True)]))
    served = state.take_batch(0, "r1")
    assert served is not None and served.samples[0].token_advantages is not None
    state.journal.flush()
    state.journal.close()
    again = make_state(path, **options)
    assert again.served_batch("r1").samples == served.samples  # the same per-token advantages
    later = again.take_batch(1, "r2")
    assert later is not None and [s.token_advantages for s in later.samples] == [s.token_advantages for s in served.samples]
    again.journal.close()
