"""On-policy distillation in the orchestrator, over real HTTP on loopback: score items carry the
samples' token ids, a teacher's post must hold one log-prob per completion token (else 400
naming the counts, and nothing is taken), and the batch's per-token advantages are the teacher
minus the student's sampling log-prob (plus the weighted outcome advantage), in JSON and msgpack,
and again after a restart."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from decentrl.api.wire import ScorePost, ScoreResult
from orchestrator.auth import TokenRegistry
from tests.orchestrator.test_orchestrator_scoring import (  # noqa: F401 - make_state is a fixture
    SCORER,
    TOKENS,
    TRAINER,
    lease_items,
    make_state,
    post,
    run,
)

STUDENT = [[-0.5, -1.0, -0.25, -2.0, -0.1], [-0.3, -0.3, -0.3, -0.3, -0.3], [-1.5, -0.2, -0.7, -0.4, -0.05]]
TEACHER = [[-0.1, -3.0, -0.25, -0.5, -0.2], [-0.3, -0.1, -2.0, -0.6, -0.3], [-0.5, -0.5, -0.5, -0.5, -0.5]]


def distill_options(**distill: Any) -> dict[str, Any]:
    return {"trainer": {"groups_per_step": 1, "steps": 3}, "orchestrator": {
        "lease_wait_s": 0.0, "rewards": {"type": "sum", "model_weight": 0.0},
        "advantages": {"distill": distill}}}


def one_group(state: Any, make_rollout: Any, wrong: int = 1) -> Any:
    """One group of three 5-token completions ("1234" + eos), the first `wrong` of them "====" + eos."""
    (lease,) = state.grant_leases("alice/w0", 1)
    right = "".join(sorted(state.task.prompt(lease.prompt_id).text.rstrip("=")))
    rollouts = [make_rollout(lease, "====" if i < wrong else right, logprobs=STUDENT[i]) for i in range(3)]
    assert state.ingest(rollouts, "alice/w0").accepted == 3
    return lease


def expected_advantages(rewards: list[float], weight: float, outcome_weight: float) -> list[list[float]]:
    """The float64 reference: weight * (teacher - student) + outcome_weight * (r - mean(r))."""
    mean = sum(rewards) / len(rewards)
    return [[weight * (t - s) + outcome_weight * (r - mean) for t, s in zip(teacher, student, strict=True)]
            for teacher, student, r in zip(TEACHER, STUDENT, rewards, strict=True)]


def test_a_teacher_post_must_hold_one_log_prob_per_token_and_they_become_token_advantages(
    make_state: Any, make_rollout: Any, serve_orchestrator: Any  # noqa: F811 - the fixture imported above
) -> None:
    state = make_state(**distill_options(weight=2.0, outcome_weight=0.5))
    lease = one_group(state, make_rollout)

    async def scenario() -> None:
        async with serve_orchestrator(state, TokenRegistry(TOKENS)) as server:
            status, info, _ = await server.call("GET", "/v1/info", SCORER)
            assert status == 200 and info["vocab_size"] == 14 and len(info["vocab_digest"]) == 64
            got = await lease_items(server)
            items = got["items"]
            assert [len(item["completion_token_ids"]) for item in items] == [5, 5, 5]
            assert all(item["prompt_token_ids"] == lease.prompt_token_ids for item in items)
            body = {"lease_id": got["lease_id"], "scorer_id": "s0", "scores": [
                {"rollout_id": item["rollout_id"], "score": 0.5, "token_logprobs": TEACHER[i]} for i, item in enumerate(items)]}
            for change, reason in (
                ({"token_logprobs": TEACHER[0][:2]}, "2 token log-probs for 5 completion tokens (one per token)"),
                ({"token_logprobs": [*TEACHER[0], -1.0]}, "6 token log-probs for 5 completion tokens"),
                ({"token_logprobs": None}, "post the teacher's log-prob of each (token_logprobs)"),
                ({"token_logprobs": [-0.1, 0.5, -1.0, -1.0, -1.0]}, "token_logprobs must be finite and <= 0"),
            ):
                bad = {**body, "scores": [{**body["scores"][0], **change}, *body["scores"][1:]]}
                code, answer = await post(server, bad)
                assert code == 400 and reason in answer["error"], answer
            assert state.status().scoring["scores_posted"] == 0  # nothing of a refused post was taken
            assert (await post(server, body))[0] == 200
            expected = expected_advantages([0.0, 1.0, 1.0], 2.0, 0.5)
            for accept in ("application/json", "application/msgpack"):
                status, batch, _ = await server.call(
                    "GET", "/v1/batch?trainer_version=0&request_id=r0", TRAINER, headers={"Accept": accept})
                assert status == 200
                assert [s["reward"] for s in batch["samples"]] == [0.0, 1.0, 1.0]  # the task's reward, model_weight 0
                for sample, values in zip(batch["samples"], expected, strict=True):
                    assert list(sample["token_advantages"]) == pytest.approx(values, abs=1e-12)

    run(scenario())


def test_a_run_without_distillation_sends_no_token_ids_and_takes_no_log_probs(
    make_state: Any, make_rollout: Any, serve_orchestrator: Any  # noqa: F811 - the fixture imported above
) -> None:
    state = make_state(trainer={"groups_per_step": 1, "steps": 3})  # rewards type = model, no distill
    one_group(state, make_rollout)

    async def scenario() -> None:
        async with serve_orchestrator(state, TokenRegistry(TOKENS)) as server:
            status, info, _ = await server.call("GET", "/v1/info", SCORER)
            assert info["vocab_digest"] is None
            got = await lease_items(server)
            assert got["items"][0]["completion_token_ids"] is None
            body = {"lease_id": got["lease_id"], "scorer_id": "s0", "scores": [
                {"rollout_id": item["rollout_id"], "score": 0.5} for item in got["items"]]}
            body["scores"][0]["token_logprobs"] = TEACHER[0]
            code, answer = await post(server, body)
            assert code == 400 and "token_logprobs given, but the item has no token ids" in answer["error"]

    run(scenario())


def test_teacher_log_probs_survive_a_restart(
    make_state: Any, make_rollout: Any, tmp_path: Path  # noqa: F811 - the fixture imported above
) -> None:
    path = str(tmp_path / "journal.sqlite")
    options = distill_options(clip=1.0)
    state = make_state(path, **options)
    one_group(state, make_rollout)
    one_group(state, make_rollout, wrong=0)  # kept in line through the restart
    entry = state.lease_scores("judge/s0", 64)
    assert entry is not None and len(entry.rollout_ids) == 6
    state.post_scores("judge/s0", ScorePost(lease_id=entry.lease_id, scorer_id="s0", scores=[
        ScoreResult(rollout_id=rid, score=0.5, token_logprobs=TEACHER[i % 3]) for i, rid in enumerate(entry.rollout_ids)]))
    served = state.take_batch(0, "r1")
    assert served is not None
    clipped = [[max(min(t - s, 1.0), -1.0) for t, s in zip(teacher, student, strict=True)]
               for teacher, student in zip(TEACHER, STUDENT, strict=True)]
    assert [s.token_advantages for s in served.samples] == [pytest.approx(c, abs=1e-12) for c in clipped]
    state.journal.flush()
    state.journal.close()
    again = make_state(path, **options)
    assert again.served_batch("r1").samples == served.samples  # a re-ask after the restart: the same batch
    later = again.take_batch(1, "r2")
    assert later is not None and [s.token_advantages for s in later.samples] == [s.token_advantages for s in served.samples]
    again.journal.close()
