"""Partial steps (issue 47): a tree lease's finished steps posted while the sample is generated
(POST /v1/steps), leased to scorers before whole samples, judged, journaled, and told to the
worker on its verdict long-poll (GET /v1/verdicts); bad input on every new field and route; the
chained-sums task's exact step checker as a scorer function.

BASE_CONFIG (conftest) with the chain task (4 digits; the tiny tokenizer's digits and '=') and a
tree of 1 pivot of 2 branches.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError
from transformers import PreTrainedTokenizerBase

from decentrl.api.wire import Lease, PartialStep, ScoreItem, ScorePost, ScoreResult, StepPost, problems
from decentrl.config import ChainTaskConfig
from decentrl.tasks.base import Prompt
from decentrl.tasks.chain import ChainTask, check_last_step, check_step, running_sums
from orchestrator.auth import TokenRegistry
from orchestrator.lease_table import LeaseError
from orchestrator.score_queue import StepError
from orchestrator.state import RunState
from workers.scorers.chain import judge

HOLDER = "alice/w0"
TREE = {"task": {"type": "chain", "num_digits": 4, "num_prompts": 16, "seed": 0}, "sampling": {"temperature": 1.0, "max_tokens": 16},
        "orchestrator": {"tree": {"k": 2, "pivots": 1, "marker": "=", "stop_below": 0.5}, "lease_wait_s": 0.0},
        "trainer": {"groups_per_step": 1}}
WORKER, SCORER = "worker-secret", "scorer-secret"
TOKENS = [{"name": "alice", "role": "worker", "token": WORKER}, {"name": "judge", "role": "scorer", "token": SCORER}]


def run(coro: Awaitable[None]) -> None:
    asyncio.run(asyncio.wait_for(coro, timeout=30))  # type: ignore[arg-type]


@pytest.fixture
def tree(run_state: Callable[..., RunState]) -> Callable[..., RunState]:
    return functools.partial(run_state, **TREE)  # a section given at the call replaces TREE's


@pytest.fixture
def ids(tokenizer: PreTrainedTokenizerBase) -> Callable[[str], list[int]]:
    return lambda text: tokenizer(text, add_special_tokens=False).input_ids


def _step(lease: Lease, rid: str, n: int, tokens: list[int], prompt: list[int] | None = None) -> dict[str, Any]:
    first = {"prompt_token_ids": prompt if prompt is not None else list(lease.prompt_token_ids)} if n == 0 else {}
    return {"rollout_id": rid, "step": n, "token_ids": tokens, "logprobs": [-0.5] * len(tokens), **first}


def _post(lease: Lease, *steps: dict[str, Any]) -> StepPost:
    return StepPost.model_validate({"lease_id": lease.lease_id, "worker_id": "w0", "steps": list(steps)})


def _right(state: RunState, lease: Lease) -> list[str]:
    """The lease's right steps, each with its marker."""
    return [f"{total}=" for total in running_sums(state.task.prompt(lease.prompt_id).text)]


# -- the wire -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("step", "says"),
    [
        ({"step": -1}, "greater than or equal to 0"),
        ({"step": True}, "valid integer"),
        ({"token_ids": []}, "at least 1"),
        ({"logprobs": [-0.5]}, "logprobs has 1 entries"),
        ({"logprobs": [0.5, -0.1]}, "finite and <= 0"),
        ({"logprobs": [float("nan"), -0.1]}, "finite and <= 0"),
        ({"prompt_token_ids": None}, "step 0 carries"),
        ({"step": 1, "prompt_token_ids": [1]}, "no later step"),
        ({"rollout_id": ""}, "at least 1"),
        ({"rollout_id": "r" * 129}, "at most 128"),
        ({"extra": 1}, "Extra inputs"),
    ],
)
def test_a_bad_partial_step_is_refused_saying_what_to_fix(step: dict[str, Any], says: str) -> None:
    body = {"rollout_id": "r", "step": 0, "token_ids": [3, 4], "logprobs": [-0.5, -0.5], "prompt_token_ids": [1], **step}
    with pytest.raises(ValidationError) as caught:
        PartialStep.model_validate(body)
    assert says in problems(caught.value)


@pytest.mark.parametrize(
    ("post", "says"),
    [
        ({"steps": []}, "at least 1"),
        ({"worker_id": "a/b"}, "worker_id"),
        ({"lease_id": ""}, "at least 1"),
        ({"steps": [{"rollout_id": "r", "step": 1, "token_ids": [3], "logprobs": [-1.0]}] * 257}, "at most 256"),
    ],
)
def test_a_bad_step_post_is_refused(post: dict[str, Any], says: str) -> None:
    body = {"lease_id": "l", "worker_id": "w0", "steps": [{"rollout_id": "r", "step": 1, "token_ids": [3], "logprobs": [-1.0]}], **post}
    with pytest.raises(ValidationError) as caught:
        StepPost.model_validate(body)
    assert says in problems(caught.value)


def test_a_step_result_is_an_integer_step() -> None:
    with pytest.raises(ValidationError, match="valid integer"):
        ScoreResult.model_validate({"rollout_id": "r", "score": 1.0, "step": True})
    with pytest.raises(ValidationError, match="greater than or equal to 0"):
        ScoreItem.model_validate({"rollout_id": "r", "prompt_id": 0, "prompt": "p", "completion": "c", "step": -1})


# -- the chained-sums task and its step checker ---------------------------------------------


def test_the_chain_task_and_its_exact_step_checker() -> None:
    task = ChainTask(ChainTaskConfig(num_digits=4, num_prompts=8, seed=1))
    prompt = Prompt(0, "7324=")
    assert running_sums(prompt.text) == [7, 10, 12, 16]
    assert task.reward(prompt, "7=10=12=16=") == 1.0
    assert task.reward(prompt, "7=10=12=16") == 1.0  # the last marker may be the end itself
    assert task.reward(prompt, "7=10=12=17=") == 0.0 and task.reward(prompt, "7=10=12=") == 0.0
    assert task.reward(prompt, "7=10=12=16=20=") == 0.0
    assert check_step(prompt.text, "7=1") is True  # the last finished step is "7"
    assert check_step(prompt.text, "7=11=") is False and check_step(prompt.text, "7=10=") is True
    assert check_step(prompt.text, "7") is None  # no step finished
    assert check_step(prompt.text, "7=10=12=16=3=") is False  # past the last digit
    assert all(len(task.prompt(i).text) == 5 for i in range(8))


def test_the_chain_scorer_judges_steps_and_samples() -> None:
    step = ScoreItem(rollout_id="r", prompt_id=0, prompt="7324=", completion="7=10=13=", steps=["7=", "10=", "13="], step=2)
    whole = ScoreItem(rollout_id="r", prompt_id=0, prompt="7324=", completion="7=10=13=16=", steps=["7=", "10=", "13=", "16="])
    right, wrong_whole = judge([step.model_copy(update={"completion": "7=10=12="}), whole])
    assert right.score == 1.0 and right.step_scores is None
    assert wrong_whole.score == 0.0 and wrong_whole.step_scores == [1.0, 1.0, 0.0, 1.0]  # each against the true sums
    assert judge([step])[0].score == 0.0


def test_a_chains_last_step_without_its_marker_is_judged_itself() -> None:
    """A chain that ends at end-of-sequence (or the token limit) without the marker: its last step
    is that unmarked text (or nothing), judged as the chain's end, not as the step before it."""
    assert check_last_step("7324=", "7=10=12=16") is True
    assert check_last_step("7324=", "7=10=12=99") is False  # check_step would judge "12", right
    assert check_last_step("7324=", "7=10=1") is False  # cut mid-chain at the token limit
    assert check_last_step("7324=", "7=10=12=16=") is True  # the end-of-sequence alone, after every sum
    assert check_last_step("7324=", "7=10=") is False  # ... too early
    assert check_last_step("7324=", "7=10=12=16=20") is False  # past the last digit

    def step(completion: str, steps: list[str]) -> ScoreItem:
        return ScoreItem(rollout_id="r", prompt_id=0, prompt="7324=", completion=completion, steps=steps, step=len(steps) - 1)

    verdicts = judge([step("7=10=12=99", ["7=", "10=", "12=", "99"]), step("7=10=12=16", ["7=", "10=", "12=", "16"]),
                      step("7=10=", ["7=", "10=", ""]), step("7=10=12=", ["7=", "10=", "12="])])
    assert [v.score for v in verdicts] == [0.0, 1.0, 0.0, 1.0]
    whole = ScoreItem(rollout_id="r", prompt_id=0, prompt="7324=", completion="7=10=12=99", steps=["7=", "10=", "12=", "99"])
    assert judge([whole])[0].step_scores == [1.0, 1.0, 1.0, 0.0]


# -- the orchestrator ---------------------------------------------------------------------


def test_steps_are_taken_once_in_order_and_leased_before_whole_samples(
    tree: Callable[..., RunState], ids: Callable[[str], list[int]]
) -> None:
    state = tree()
    lease, other = state.grant_leases(HOLDER, 2)
    right = _right(state, lease)
    first = _post(lease, _step(lease, "r0", 0, ids(right[0])), _step(lease, "r0", 1, ids(right[1])))
    assert state.post_steps(HOLDER, first).model_dump() == {"accepted": 2, "duplicates": 0}
    assert state.post_steps(HOLDER, first).model_dump() == {"accepted": 0, "duplicates": 2}  # a resend
    entry = state.lease_scores("judge/s0", 8)
    assert entry is not None
    items = state.score_queue.items(entry)
    assert [(item.rollout_id, item.step, item.completion) for item in items] == [
        ("r0", 0, right[0]), ("r0", 1, right[0] + right[1])
    ]
    assert items[1].prompt == state.task.prompt(lease.prompt_id).text and items[1].steps == right[:2]
    # The scorer's verdicts reach the worker, numbered; a resent post is a duplicate, told once.
    post = ScorePost(lease_id=entry.lease_id, scorer_id="s0", scores=[
        ScoreResult(rollout_id="r0", score=1.0, step=0), ScoreResult(rollout_id="r0", score=0.0, step=1)])
    assert state.post_scores("judge/s0", post).accepted == 2
    assert state.post_scores("judge/s0", post).duplicates == 2
    told = state.verdicts_for(HOLDER, 0)
    assert [(v.rollout_id, v.step, v.score, v.seq) for v in told.verdicts] == [("r0", 0, 1.0, 1), ("r0", 1, 0.0, 2)]
    assert told.last == 2 and state.verdicts_for(HOLDER, 2).verdicts == [] and state.verdicts_for(HOLDER, 2).last == 2
    assert state.verdicts_for("bob/w1", 0).verdicts == []  # only the holder's own
    assert state.score_queue.counts["steps_scored"] == 2
    # A lease that closes takes its steps with it, at once: chain, queued step and verdicts.
    state.post_steps(HOLDER, _post(other, _step(other, "q0", 0, ids("1="))))
    assert state.score_queue.steps_waiting() == 1
    state.release_lease(other.lease_id, HOLDER)
    assert "q0" not in state.steps.chains and "r0" in state.steps.chains
    assert state.score_queue.steps_waiting() == 0 and state.lease_scores("judge/s0", 8) is None


@pytest.mark.parametrize(
    ("steps", "says", "status"),
    [
        (lambda lease, ids: [_step(lease, "r0", 1, ids("1="))], "comes before step 0", 400),
        (lambda lease, ids: [_step(lease, "r0", 0, ids("1="), prompt=[1, 2])], "start with the lease's prompt", 400),
        (lambda lease, ids: [_step(lease, "r0", 0, [99])], "outside the vocabulary", 400),
        (lambda lease, ids: [_step(lease, "r0", 0, ids("1111111111111111="))], "at most sampling.max_tokens", 400),
        (lambda lease, ids: [_step(lease, f"r{i}", 0, ids("1=")) for i in range(5)], "its unit holds 5", 400),
    ],
)
def test_bad_steps_are_refused_whole(
    tree: Callable[..., RunState], ids: Callable[[str], list[int]], steps: Any, says: str, status: int
) -> None:
    state = tree()
    (lease,) = state.grant_leases(HOLDER, 1)
    good = _step(lease, "ok", 0, ids("1="))
    with pytest.raises(StepError, match=says) as caught:
        state.post_steps(HOLDER, _post(lease, good, *steps(lease, ids)))
    assert caught.value.status == status
    assert state.steps.chains == {} and state.score_queue.step_queue == type(state.score_queue.step_queue)()  # none of it


def test_a_changed_step_a_stranger_and_a_plain_group_are_refused(
    tree: Callable[..., RunState], run_state: Callable[..., RunState], ids: Callable[[str], list[int]]
) -> None:
    state = tree()
    (lease,) = state.grant_leases(HOLDER, 1)
    state.post_steps(HOLDER, _post(lease, _step(lease, "r0", 0, ids("1="))))
    with pytest.raises(StepError, match="taken before with other tokens") as caught:
        state.post_steps(HOLDER, _post(lease, _step(lease, "r0", 0, ids("2="))))
    assert caught.value.status == 409
    with pytest.raises(LeaseError, match="held by another"):
        state.post_steps("bob/w1", _post(lease, _step(lease, "r1", 0, ids("1="))))
    plain = run_state()
    (group,) = plain.grant_leases(HOLDER, 1)
    with pytest.raises(StepError, match="not a tree unit"):
        plain.post_steps(HOLDER, _post(group, _step(group, "r0", 0, ids("1="))))


def test_an_expired_step_lease_goes_to_the_next_scorer(tree: Callable[..., RunState], ids: Any, clock: Any) -> None:
    state = tree(orchestrator={**TREE["orchestrator"], "rewards": {"lease_timeout_s": 5.0}})
    (lease,) = state.grant_leases(HOLDER, 1)
    state.post_steps(HOLDER, _post(lease, _step(lease, "r0", 0, ids("1="))))
    first = state.lease_scores("judge/s0", 8)
    assert first is not None and state.lease_scores("judge/s1", 8) is None
    clock.advance(6.0)
    state.renew_lease(lease.lease_id, HOLDER)
    second = state.lease_scores("judge/s1", 8)
    assert second is not None and second.rollout_ids == [("r0", 0)]
    assert state.score_queue.counts["scores_reassigned"] == 1


def test_steps_and_verdicts_survive_a_restart(tree: Callable[..., RunState], ids: Any, tmp_path: Path) -> None:
    journal = str(tmp_path / "journal.sqlite")
    state = tree(journal)
    (lease,) = state.grant_leases(HOLDER, 1)
    state.post_steps(HOLDER, _post(lease, _step(lease, "r0", 0, ids("1=")), _step(lease, "r0", 1, ids("2="))))
    entry = state.lease_scores("judge/s0", 1)
    assert entry is not None
    state.post_scores("judge/s0", ScorePost(lease_id=entry.lease_id, scorer_id="s0", scores=[
        ScoreResult(rollout_id="r0", score=0.0, step=0)]))
    state.journal.flush()
    state.journal.close()
    again = tree(journal)
    assert [(v.step, v.score, v.seq) for v in again.verdicts_for(HOLDER, 0).verdicts] == [(0, 0.0, 1)]
    assert again.post_steps(HOLDER, _post(lease, _step(lease, "r0", 1, ids("2=")))).duplicates == 1
    left = again.lease_scores("judge/s0", 8)  # the unjudged step is queued again, the judged one not
    assert left is not None and left.rollout_ids == [("r0", 1)]
    again.post_scores("judge/s0", ScorePost(lease_id=left.lease_id, scorer_id="s0", scores=[
        ScoreResult(rollout_id="r0", score=1.0, step=1)]))
    assert [v.seq for v in again.verdicts_for(HOLDER, 1).verdicts] == [2]  # numbering goes on


def test_the_routes_over_http(tree: Callable[..., RunState], ids: Any, serve_orchestrator: Any) -> None:
    state = tree()
    (lease,) = state.grant_leases(HOLDER, 1)
    right = _right(state, lease)

    async def real() -> None:
        async with serve_orchestrator(state, TokenRegistry(TOKENS)) as server:
            for rid in ("r0", "r1"):
                body = _post(lease, _step(lease, rid, 0, ids(right[0]))).model_dump()
                status, answer, _ = await server.call("POST", "/v1/steps", WORKER, json=body)
                assert (status, answer) == (200, {"accepted": 1, "duplicates": 0})
            gap = _post(lease, _step(lease, "r1", 2, ids("9="))).model_dump()
            status, answer, _ = await server.call("POST", "/v1/steps", WORKER, json=gap)
            assert status == 400 and "post each step after the one before it" in answer["error"]
            status, answer, _ = await server.call("POST", "/v1/steps", WORKER, json={**body, "steps": [{"step": 0}]})
            assert status == 400 and "rollout_id" in answer["error"]
            status, answer, _ = await server.call("POST", "/v1/steps", SCORER, json=body)
            assert status == 403
            for query, says in (("worker_id=w0&after=-1", "after"), ("worker_id=w0&wait_s=61", "wait_s"),
                                ("worker_id=w0&bogus=1", "bogus"), ("after=0", "worker_id"), ("worker_id=a/b", "worker_id")):
                status, answer, _ = await server.call("GET", f"/v1/verdicts?{query}", WORKER)
                assert status == 400 and says in answer["error"], (query, answer)
            # The long-poll answers as soon as a scorer's verdict is taken.
            poll = asyncio.create_task(server.call("GET", "/v1/verdicts?worker_id=w0&after=0&wait_s=10", WORKER))
            await asyncio.sleep(0.2)
            assert not poll.done()
            status, leased, _ = await server.call("POST", "/v1/score/leases", SCORER, json={"scorer_id": "s0", "max_items": 8})
            assert status == 200 and [(i["rollout_id"], i["step"]) for i in leased["items"]] == [("r0", 0), ("r1", 0)]
            scores = [{"rollout_id": i["rollout_id"], "score": 1.0, "step": 0} for i in leased["items"]]
            answered = {"lease_id": leased["lease_id"], "scorer_id": "s0", "scores": scores}
            status, _, _ = await server.call("POST", "/v1/scores", SCORER, json=answered)
            assert status == 200
            status, answer, _ = await poll
            assert status == 200 and [(v["rollout_id"], v["seq"]) for v in answer["verdicts"]] == [("r0", 1), ("r1", 2)]
            assert answer["last"] == 2
            bad = {"lease_id": leased["lease_id"], "scorer_id": "s0", "scores": [{"rollout_id": "r0", "score": 1.0, "step": 0,
                                                                                "step_scores": [1.0]}]}
            status, answer, _ = await server.call("POST", "/v1/scores", SCORER, json=bad)
            assert status == 400 and "a step's verdict is its score alone" in answer["error"]

    run(real())


# -- a chain stopped early is held to its verdict; verdicts become process rewards -------------


def _sample(state: RunState, lease: Lease, make_rollout: Any, rid: str, steps: list[list[int]], **fields: Any) -> Any:
    ends = [sum(len(step) for step in steps[: n + 1]) for n in range(len(steps))]
    return make_rollout(lease, [t for step in steps for t in step], rollout_id=rid, step_ends=ends,
                        sampling=state.sampling, **fields)


def _judge(state: RunState, verdicts: dict[tuple[str, int], float]) -> None:
    """A scorer leases every waiting step and posts the verdicts given (the others stay unjudged)."""
    entry = state.lease_scores("judge/s0", 64)
    assert entry is not None and set(verdicts) <= set(entry.rollout_ids)
    scores = [ScoreResult(rollout_id=rid, score=score, step=step) for (rid, step), score in verdicts.items()]
    assert state.post_scores("judge/s0", ScorePost(lease_id=entry.lease_id, scorer_id="s0", scores=scores)).accepted == len(scores)


def test_a_wrong_step_finish_is_held_to_its_journaled_verdict(
    tree: Callable[..., RunState], ids: Callable[[str], list[int]], make_rollout: Any
) -> None:
    state = tree()
    (lease,) = state.grant_leases(HOLDER, 1)
    first, wrong = ids(_right(state, lease)[0]), ids("99=")
    for rid in ("stopped", "right", "unjudged", "other"):
        state.post_steps(HOLDER, _post(lease, _step(lease, rid, 0, first), _step(lease, rid, 1, wrong)))
    _judge(state, {("stopped", 0): 1.0, ("stopped", 1): 0.0, ("right", 1): 0.5, ("other", 1): 0.0})

    def reasons(rid: str, steps: list[list[int]]) -> list[str]:
        sample = _sample(state, lease, make_rollout, rid, steps, finish_reason="wrong_step")
        return [rejection.reason for rejection in state.ingest([sample], HOLDER).rejected]

    assert reasons("right", [first, wrong]) == ["wrong_step_judged_right"]  # 0.5 is not under stop_below 0.5
    assert reasons("unjudged", [first, wrong]) == ["wrong_step_unjudged"]  # its last step has no verdict yet
    assert reasons("never-posted", [first, wrong]) == ["wrong_step_unposted"]
    assert reasons("other", [first, ids("98=")]) == ["wrong_step_unposted"]  # not the tokens that were judged
    assert reasons("other", [first]) == ["wrong_step_unjudged"]  # stopped at a step judged by nobody
    assert reasons("stopped", [first, wrong]) == []
    assert state.rejected["wrong_step_unposted"] == 2
    # A run whose chains are never stopped early takes no wrong_step finish at all.
    never = tree(orchestrator={**TREE["orchestrator"], "tree": {"k": 2, "pivots": 1, "marker": "="}})
    (plain,) = never.grant_leases(HOLDER, 1)
    never.post_steps(HOLDER, _post(plain, _step(plain, "s", 0, wrong)))
    _judge(never, {("s", 0): 0.0})
    sample = _sample(never, plain, make_rollout, "s", [wrong], finish_reason="wrong_step")
    assert [r.reason for r in never.ingest([sample], HOLDER).rejected] == ["bad_finish_reason"]


PROCESS = {**TREE["orchestrator"], "tree": {"k": 1, "pivots": 0, "marker": "=", "stop_below": 0.5},
           "advantages": {"type": "grpo", "normalize_std": False, "process": "return", "process_weight": 1.0,
                          "outcome_weight": 1.0}}


def _judged_unit(state: RunState, ids: Callable[[str], list[int]], make_rollout: Any) -> dict[str, list[float] | None]:
    """A unit of three samples whose steps were posted and judged, complete; each sample's token
    advantages, hand-computed: A's steps judged [1, 1], reward 1; B's [1, 0] (stopped there),
    reward 0; C's second step unjudged when the unit completes, reward 0. Step scores of A and B
    [1, 1, 1, 0], mean 0.75: s = [.25, .25 | .25, -.75], returns A [.5, .25], B [-.5, -.75];
    outcome (grpo over [1, 0, 0], mean 1/3) A 2/3, B and C -1/3; a token's advantage is its
    step's return + outcome, and C trains on its outcome alone (None)."""
    assert state.config.group_size == 3
    (lease,) = state.grant_leases(HOLDER, 1)
    right = _right(state, lease)
    a_steps, b_steps = [ids(right[0]), ids("".join(right[1:]))], [ids(right[0]), ids("99=")]
    c_steps = [ids(right[0]), ids(right[1])]
    state.post_steps(HOLDER, _post(lease, *(_step(lease, rid, n, tokens) for rid, steps in (
        ("A", a_steps), ("B", b_steps), ("C", c_steps)) for n, tokens in enumerate(steps))))
    _judge(state, {("A", 0): 1.0, ("A", 1): 1.0, ("B", 0): 1.0, ("B", 1): 0.0, ("C", 0): 1.0})  # C's step 1: not yet
    samples = [_sample(state, lease, make_rollout, "A", a_steps), _sample(state, lease, make_rollout, "B", b_steps,
               finish_reason="wrong_step"), _sample(state, lease, make_rollout, "C", c_steps)]
    assert state.ingest(samples, HOLDER).accepted == 3
    return {
        "A": [0.5 + 2 / 3] * len(a_steps[0]) + [0.25 + 2 / 3] * len(a_steps[1]),
        "B": [-0.5 - 1 / 3] * len(b_steps[0]) + [-0.75 - 1 / 3] * len(b_steps[1]),
        "C": None,
    }


def _advantages(batch: Any) -> tuple[dict[str, Any], dict[str, float]]:
    assert batch is not None
    return ({s.rollout_id: s.token_advantages for s in batch.samples}, {s.rollout_id: s.advantage for s in batch.samples})


def _assert_advantages(batch: Any, expected: dict[str, list[float] | None]) -> None:
    tokens, outcome = _advantages(batch)
    assert set(tokens) == set(expected) and tokens["C"] is None and outcome["C"] == pytest.approx(-1 / 3, abs=1e-12)
    for rid in ("A", "B"):
        assert tokens[rid] == pytest.approx(expected[rid], abs=1e-12)


def test_verdicts_become_the_finished_samples_process_rewards(
    tree: Callable[..., RunState], ids: Callable[[str], list[int]], make_rollout: Any
) -> None:
    state = tree(orchestrator=PROCESS)
    expected = _judged_unit(state, ids, make_rollout)
    # The unit is complete: its steps left with it; C's unjudged step is leased to no scorer.
    assert state.steps.chains == {} and state.score_queue.steps_waiting() == 0 and state.lease_scores("judge/s0", 8) is None
    batch = state.take_batch(0)
    assert batch is not None and [s.reward for s in sorted(batch.samples, key=lambda s: s.rollout_id)] == [1.0, 0.0, 0.0]
    _assert_advantages(batch, expected)


def test_verdict_process_rewards_survive_a_restart(
    tree: Callable[..., RunState], ids: Callable[[str], list[int]], make_rollout: Any, tmp_path: Path
) -> None:
    journal = str(tmp_path / "journal.sqlite")
    state = tree(journal, orchestrator=PROCESS)
    expected = _judged_unit(state, ids, make_rollout)
    state.journal.flush()
    state.journal.close()
    again = tree(journal, orchestrator=PROCESS)  # the group recovered in line
    _assert_advantages(again.take_batch(0, request_id="q"), expected)
    again.journal.flush()
    again.journal.close()
    third = tree(journal, orchestrator=PROCESS)  # the batch recovered as kept, asked again
    _assert_advantages(third.take_batch(0, request_id="q"), expected)


def test_an_expired_leases_steps_go_before_any_scorer_is_leased_them(
    tree: Callable[..., RunState], ids: Callable[[str], list[int]], clock: Any
) -> None:
    state = tree()
    (lease,) = state.grant_leases(HOLDER, 1)
    state.post_steps(HOLDER, _post(lease, _step(lease, "r0", 0, ids("1="))))
    clock.advance(11.0)  # past lease_timeout_s; no worker has asked anything since
    assert state.lease_scores("judge/s0", 8) is None
    assert state.steps.chains == {} and state.score_queue.steps_waiting() == 0 and state.leases_expired == 1


def test_status_reports_step_scoring_in_a_verifier_run(tree: Callable[..., RunState], ids: Callable[[str], list[int]]) -> None:
    state = tree()
    assert not state.config.orchestrator.rewards.uses_model
    (lease,) = state.grant_leases(HOLDER, 1)
    state.post_steps(HOLDER, _post(lease, _step(lease, "r0", 0, ids("1="))))
    _judge(state, {("r0", 0): 1.0})
    scoring = state.status().scoring
    assert scoring is not None and scoring["steps_scored"] == 1 and scoring["steps_waiting"] == 0


# -- units of a variable size: a tree that branches `all_failed` ----------------------------

FAILED = {**TREE["orchestrator"], "tree": {**TREE["orchestrator"]["tree"], "branch": "all_failed"}}


def _roots(
    state: RunState, ids: Callable[[str], list[int]], make_rollout: Any, verdicts: dict[str, list[float | None]]
) -> tuple[Lease, list[Any], Callable[[dict[tuple[str, int], float]], None]]:
    """A unit's roots, one a name in `verdicts`, each of two steps (the right first step, then a
    wrong one), posted and judged as given (None: left unjudged); not yet ingested. And the
    scorer's later post on the steps left unjudged (one score lease holds them all)."""
    (lease,) = state.grant_leases(HOLDER, 1)
    steps = [ids(_right(state, lease)[0]), ids("99=")]
    state.post_steps(HOLDER, _post(lease, *(_step(lease, rid, n, tokens) for rid in verdicts for n, tokens in enumerate(steps))))
    entry = state.lease_scores("judge/s0", 64)
    assert entry is not None

    def judge(given: dict[tuple[str, int], float]) -> None:
        scores = [ScoreResult(rollout_id=rid, score=score, step=step) for (rid, step), score in given.items()]
        state.post_scores("judge/s0", ScorePost(lease_id=entry.lease_id, scorer_id="s0", scores=scores))

    judge({(rid, n): v for rid, scores in verdicts.items() for n, v in enumerate(scores) if v is not None})
    return lease, [_sample(state, lease, make_rollout, rid, steps) for rid in verdicts], judge


def _branch_of(state: RunState, lease: Lease, make_rollout: Any, parent: Any, rid: str) -> Any:
    at = parent.step_ends[0]
    return make_rollout(lease, parent.completion_token_ids[at:], rollout_id=rid, sampling=state.sampling,
                        prompt_token_ids=[*parent.prompt_token_ids, *parent.completion_token_ids[:at]],
                        node={"node_id": "b0", "parent": {"rollout_id": parent.rollout_id, "at": at}})


def test_a_unit_that_branches_all_failed_holds_branches_only_when_no_root_is_known_right(
    tree: Callable[..., RunState], ids: Callable[[str], list[int]], make_rollout: Any
) -> None:
    """A root known right (each step judged at or over stop_below) leaves its unit its roots alone:
    complete when they are in, a branch refused; roots all judged wrong somewhere wait for their
    branch node; a branch before the unit's last root is refused (whether it branches is not known)."""
    state = tree(orchestrator=FAILED)
    lease, roots, _ = _roots(state, ids, make_rollout, {"right": [1.0, 0.5], "w1": [1.0, 0.0], "w2": [0.0, None]})
    assert state.ingest(roots, HOLDER).accepted == 3
    assert lease.lease_id not in state.leases and len(state.ready) == 1  # 3 samples: no branch is waited for
    assert [r.reason for r in state.ingest([_branch_of(state, lease, make_rollout, roots[1], "b")], HOLDER).rejected] == ["group_full"]

    lease, roots, _ = _roots(state, ids, make_rollout, {"f0": [1.0, 0.0], "f1": [1.0, 0.2], "f2": [0.0, None]})
    early = _branch_of(state, lease, make_rollout, roots[0], "early")
    assert state.ingest(roots[:1], HOLDER).accepted == 1
    assert [r.reason for r in state.ingest([early], HOLDER).rejected] == ["branch_before_roots"]
    assert state.ingest(roots[1:], HOLDER).accepted == 2
    assert lease.lease_id in state.leases and state.leases[lease.lease_id].size == 3 + 2  # all failed: its branch node
    branches = [_branch_of(state, lease, make_rollout, roots[0], f"b{i}") for i in range(2)]
    assert state.ingest(branches, HOLDER).accepted == 2 and lease.lease_id not in state.leases
    batch = state.take_batch(0)
    assert batch is not None and len(batch.samples) == 3  # the first unit: its roots alone
    assert state.rejected["branch_before_roots"] == 1


def test_a_verdict_that_knows_a_root_right_after_the_roots_came_completes_their_unit(
    tree: Callable[..., RunState], ids: Callable[[str], list[int]], make_rollout: Any
) -> None:
    """The worker may send a unit before a root's last verdict came (it waited `verdict_wait_s`):
    the unit waits for branches until that verdict knows the root right, then completes with its
    roots; the branches the worker sent in the meantime, had it any, would have been taken."""
    state = tree(orchestrator=FAILED)
    lease, roots, judge = _roots(state, ids, make_rollout, {"late": [1.0, None], "w1": [1.0, 0.0], "w2": [0.0, None]})
    assert state.ingest(roots, HOLDER).accepted == 3
    assert lease.lease_id in state.leases  # "late" is not known right yet: the unit may branch
    judge({("late", 1): 1.0})
    assert lease.lease_id not in state.leases and len(state.ready) == 1
    judge({("w2", 1): 1.0})  # a verdict on a completed unit's step: nothing more happens
    assert len(state.ready) == 1


def test_a_unit_whose_journaled_verdicts_know_a_root_right_completes_at_a_restart(
    tree: Callable[..., RunState], ids: Callable[[str], list[int]], make_rollout: Any, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Stopped after the verdict was journaled but before its unit completed: the restart completes
    it with its roots, none lost, instead of waiting for branches until the lease expires."""
    journal = str(tmp_path / "journal.sqlite")
    state = tree(journal, orchestrator=FAILED)
    lease, roots, judge = _roots(state, ids, make_rollout, {"late": [1.0, None], "w1": [1.0, 0.0], "w2": [0.0, None]})
    assert state.ingest(roots, HOLDER).accepted == 3
    monkeypatch.setattr(state, "_complete_if_full", lambda lease_id: False)  # the stop, between the two
    judge({("late", 1): 1.0})
    assert lease.lease_id in state.leases
    state.journal.flush()
    state.journal.close()
    again = tree(journal, orchestrator=FAILED)
    assert lease.lease_id not in again.leases
    batch = again.take_batch(0)
    assert batch is not None and sorted(s.rollout_id for s in batch.samples) == ["late", "w1", "w2"]
