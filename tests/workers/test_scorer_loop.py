"""The scorer loop (workers/scorer.py) against the real orchestrator on loopback: it leases the
samples of complete groups, scores them with a backend, posts, and the groups reach the trainer
with those rewards; bad verdicts (NaN, out of range, no score, wrong step count) go as parse
failures the orchestrator counts; an unreachable judge's samples are not posted and are leased
again; an orchestrator down for longer than the client's max_wait_s is waited out (leases asked
for, renewed and posted again); a lease is renewed while scoring outlives it; the next lease is held (and renewed) while
one is scored, or not with leases_ahead = 0; a backend that raises stops the scorer and its leases
expire; a stop finishes and posts the batch in hand;
a real `decentrl scorer` process exits cleanly on SIGTERM; a reward model's step scores fit the
steps the orchestrator split; a judge that never parses is retried, then scored as the run says
(the fake judge server of test_scorer_judge.py, counted by the orchestrator)."""

from __future__ import annotations

import asyncio
import math
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from transformers import PreTrainedTokenizerBase

from decentrl.api.client import OrchestratorClient
from decentrl.api.wire import ScoreItem, ScoreLease
from decentrl.config import HFScorerConfig, OpenAIScorerConfig, PythonScorerConfig
from decentrl.tasks import build_task
from orchestrator.auth import TokenRegistry
from orchestrator.state import RunState
from tests.core.test_store_ranges import free_port
from tests.workers.test_scorer_judge import judge  # noqa: F401 - the fake judge server, a fixture
from workers import lease_loop, scorer
from workers.scorer import Scorer, checked
from workers.scorers import Verdict, build_scorer_backend

SCORER = "scorer-secret"
TOKENS = [{"name": "judge", "role": "scorer", "token": SCORER}, {"name": "trainer", "role": "trainer", "token": "t"}]
REPO = Path(__file__).resolve().parents[2]


def run(coro: Awaitable[None]) -> None:
    asyncio.run(asyncio.wait_for(coro, timeout=60))  # type: ignore[arg-type]


@pytest.fixture
def scoring_state(
    make_config: Any, tokenizer: PreTrainedTokenizerBase, make_rollout: Any
) -> Callable[..., RunState]:
    """A run with model rewards (real clock: leases expire in real time) and `groups` complete
    groups waiting for their scores; completions are "0", "01", "012" (lengths 2, 3, 4 with eos)."""

    def make(groups: int = 1, advantages: dict[str, Any] | None = None, **rewards: Any) -> RunState:
        orchestrator = {"lease_wait_s": 0.0, "rewards": {"type": "model", **rewards}, "advantages": advantages or {}}
        config = make_config(orchestrator=orchestrator)
        state = RunState(config=config, task=build_task(config.task), tokenizer=tokenizer)
        state.announce(0)
        for lease in state.grant_leases("w/w0", groups):
            rollouts = [make_rollout(lease, "0123"[: i + 1]) for i in range(lease.group_size)]
            assert state.ingest(rollouts, "w/w0").accepted == lease.group_size
        assert state.status().groups_scoring == groups
        return state

    return make


def by_length(items: list[ScoreItem]) -> list[Verdict]:
    return [Verdict(len(item.completion) / 10) for item in items]


class Scripted:
    """A backend answering each sample by its completion's length from `verdicts`, after `delay_s`."""

    def __init__(self, verdicts: dict[int, Verdict], delay_s: float = 0.0) -> None:
        self.verdicts = verdicts
        self.delay_s = delay_s
        self.calls = 0
        self.scoring = False  # inside a call, between its start and its answer

    def score(self, items: list[ScoreItem]) -> list[Verdict]:
        self.calls += 1
        self.scoring = True
        time.sleep(self.delay_s)
        self.scoring = False
        return [self.verdicts[len(item.completion)] for item in items]


def scoring(state: RunState) -> dict[str, int]:
    return state.status().scoring or {}


def test_the_loop_scores_every_group_with_a_python_function(
    scoring_state: Any, serve_orchestrator: Any
) -> None:
    state = scoring_state(groups=2)
    config = PythonScorerConfig(function="tests.workers.test_scorer_loop:by_length", max_items=4, min_wait_s=0.05)

    async def scenario() -> None:
        async with serve_orchestrator(state, TokenRegistry(TOKENS)) as server:
            scorer = Scorer(config, scorer_id="s0", client=server.client(SCORER), backend=build_scorer_backend(config))
            counts = await asyncio.to_thread(scorer.run, max_leases=2)  # 6 samples, 4 a lease
            assert (counts.leases, counts.scored, counts.failed, counts.lost) == (2, 6, 0, 0)

    run(scenario())
    assert len(state.ready) == 2 and state.status().groups_scoring == 0
    for group in state.ready:
        assert sorted(reward for _, reward in group.samples) == pytest.approx([0.1, 0.2, 0.3])


def test_bad_verdicts_go_as_parse_failures_and_unreachable_ones_are_not_posted(
    scoring_state: Any, serve_orchestrator: Any
) -> None:
    state = scoring_state(groups=1, on_parse_failure="default", default_score=0.5, lease_timeout_s=1.0)
    first = Scripted({
        1: Verdict(float("nan")),  # the completions "0", "01", "012" decode to 1, 2, 3 characters
        2: Verdict(None, error="judge reply did not parse: no match", retries=2),
        3: Verdict(None, error="judge unreachable: 503", transient=True),
    })

    async def scenario() -> None:
        async with serve_orchestrator(state, TokenRegistry(TOKENS)) as server:
            scorer = Scorer(PythonScorerConfig(function="m:f", min_wait_s=0.05), scorer_id="s0",
                            client=server.client(SCORER), backend=first)
            counts = await asyncio.to_thread(scorer.run, max_leases=1)
            assert (counts.scored, counts.failed, counts.transient, counts.parse_retries) == (0, 2, 1, 2)
            assert scoring(state)["judge_parse_failures"] == 2 and scoring(state)["judge_parse_retries"] == 2
            assert state.status().groups_scoring == 1  # the third sample waits for its lease to expire
            scorer.backend = Scripted({3: Verdict(0.9)})
            counts = await asyncio.to_thread(scorer.run, max_leases=2)  # leased again after 1 s
            assert counts.scored == 1 and scoring(state)["score_leases_expired"] == 1

    run(scenario())
    (group,) = state.ready
    assert sorted(reward for _, reward in group.samples) == pytest.approx([0.5, 0.5, 0.9])  # default, default, scored


@pytest.mark.parametrize(
    ("verdict", "item_steps", "why"),
    [
        (Verdict(float("nan")), None, "score_range"),
        (Verdict(float("inf")), None, "score_range"),
        (Verdict(1.5), None, "score_range"),
        (Verdict(-0.1), None, "score_range"),
        (Verdict(True), None, "not a number"),  # type: ignore[arg-type]
        (Verdict(None, error="the judge refused the request"), None, "refused"),
        (Verdict(0.5), ["a", "b"], "2 steps but none"),
        (Verdict(0.5, [0.1]), ["a", "b"], "2 steps but 1"),
        (Verdict(0.5, [0.1, math.nan]), ["a", "b"], "score_range"),
        (Verdict(0.5, [0.1, 2.0]), ["a", "b"], "score_range"),
    ],
)
def test_checked_turns_bad_verdicts_into_parse_failures(
    verdict: Verdict, item_steps: list[str] | None, why: str, caplog: pytest.LogCaptureFixture
) -> None:
    sample = ScoreItem(rollout_id="r1", prompt_id=0, prompt="p", completion="ab", steps=item_steps)
    result = checked(sample, verdict, 0.0, 1.0)
    assert result.score is None and result.failure == "parse" and result.step_scores is None
    assert why in caplog.text and "r1" in caplog.text


def test_checked_passes_good_verdicts_as_floats_and_leaves_unwanted_step_scores_out() -> None:
    plain = ScoreItem(rollout_id="r1", prompt_id=0, prompt="p", completion="ab")
    stepped = plain.model_copy(update={"steps": ["a", "b"]})
    assert checked(plain, Verdict(1, [0.2]), 0.0, 1.0).model_dump() == {  # type: ignore[arg-type]
        "rollout_id": "r1", "score": 1.0, "step_scores": None, "failure": None, "token_logprobs": None, "step": None}
    result = checked(stepped, Verdict(0.0, [0, 1.0]), 0.0, 1.0)  # type: ignore[list-item]
    assert result.score == 0.0 and result.step_scores == [0.0, 1.0] and type(result.step_scores[0]) is float
    partial = stepped.model_copy(update={"step": 1})  # a partial step (POST /v1/steps): its score alone
    assert checked(partial, Verdict(1, [0.5, 0.5]), 0.0, 1.0).model_dump(exclude_none=True) == {  # type: ignore[union-attr]
        "rollout_id": "r1", "score": 1.0, "step": 1}
    assert checked(partial, Verdict(None, error="unreadable"), 0.0, 1.0) is None  # never a failure: leased again


def test_a_lease_is_renewed_while_scoring_outlives_it(scoring_state: Any, serve_orchestrator: Any) -> None:
    state = scoring_state(groups=1, lease_timeout_s=1.0)
    slow = Scripted({n: Verdict(0.25) for n in (1, 2, 3)}, delay_s=2.5)

    async def scenario() -> None:
        async with serve_orchestrator(state, TokenRegistry(TOKENS)) as server:
            scorer = Scorer(PythonScorerConfig(function="m:f"), scorer_id="s0", client=server.client(SCORER), backend=slow)
            counts = await asyncio.to_thread(scorer.run, max_leases=1)
            assert (counts.scored, counts.lost) == (3, 0)
            assert scoring(state).get("score_leases_expired", 0) == 0

    run(scenario())
    assert len(state.ready) == 1


def test_an_orchestrator_down_past_max_wait_is_waited_out(
    scoring_state: Any, serve_orchestrator: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The orchestrator stops while the first lease is scored and is back 4.5 s later (15x the
    client's max_wait_s): the post, the next lease request and a renewal (due at half the 6 s lease,
    given up by the client some 1 s later) meet the outage and are tried again; nothing is lost and
    no lease expires. Until 2026-11-29 the first
    of them to fail past max_wait_s stopped the scorer."""
    for module in (lease_loop, scorer):
        monkeypatch.setattr(module, "backoff", lambda failures, base_s=0.5, cap_s=30.0: 0.2)
    state = scoring_state(groups=2, lease_timeout_s=6.0)
    slow = Scripted({n: Verdict(0.5) for n in (1, 2, 3)}, delay_s=0.5)
    config = PythonScorerConfig(function="m:f", max_items=3, leases_ahead=0, min_wait_s=0.05)
    port, tokens = free_port(), TokenRegistry(TOKENS)

    async def scenario() -> None:
        async with serve_orchestrator(state, tokens, port=port) as server:
            client = OrchestratorClient(server.url, SCORER, timeout_s=10.0, max_wait_s=0.3)
            scoring_ = Scorer(config, scorer_id="s0", client=client, backend=slow)
            running = asyncio.ensure_future(asyncio.to_thread(scoring_.run, max_leases=2))
            while not slow.scoring:
                await asyncio.sleep(0.01)
        await asyncio.sleep(4.5)  # down: connections refused
        async with serve_orchestrator(state, tokens, port=port):
            counts = await running
            assert (counts.leases, counts.scored, counts.lost) == (2, 6, 0)

    caplog.set_level("WARNING")
    run(scenario())
    assert len(state.ready) == 2 and scoring(state).get("score_leases_expired", 0) == 0
    warnings = [record.getMessage() for record in caplog.records]
    for failed in ("not posted", "lease request failed", "renewing leases failed"):
        assert any(failed in message for message in warnings), (failed, warnings)
    assert SCORER not in caplog.text


async def most_leased(state: RunState, scorer: Scorer, backend: Scripted, **run: Any) -> tuple[int, int]:
    """Run the scorer; the most samples and leases it held while the backend was on its first call."""
    samples = leases = 0
    running = asyncio.ensure_future(asyncio.to_thread(scorer.run, **run))
    while not running.done():
        # Inside the first call, not after it: then the next lease may be granted before this one's post lands.
        if backend.calls == 1 and backend.scoring:
            samples = max(samples, state.score_queue.leased())
            leases = max(leases, len(state.score_queue.leases))
        await asyncio.sleep(0.02)
    await running
    return samples, leases


@pytest.mark.parametrize("ahead", [0, 1])
def test_the_next_lease_is_in_hand_while_one_is_scored(
    scoring_state: Any, serve_orchestrator: Any, ahead: int
) -> None:
    state = scoring_state(groups=2)
    slow = Scripted({n: Verdict(0.5) for n in (1, 2, 3)}, delay_s=0.6)
    config = PythonScorerConfig(function="m:f", max_items=3, leases_ahead=ahead, min_wait_s=0.05)

    async def scenario() -> None:
        async with serve_orchestrator(state, TokenRegistry(TOKENS)) as server:
            scorer = Scorer(config, scorer_id="s0", client=server.client(SCORER), backend=slow)
            held = await most_leased(state, scorer, slow, max_leases=2)
            assert held == ((3, 1) if ahead == 0 else (6, 2))  # the second group waits in hand, or in the queue
            assert (scorer.counts.leases, scorer.counts.scored, slow.calls) == (2, 6, 2)

    run(scenario())
    assert len(state.ready) == 2


def test_a_lease_in_hand_is_renewed_while_it_waits(scoring_state: Any, serve_orchestrator: Any) -> None:
    state = scoring_state(groups=2, lease_timeout_s=1.0)
    slow = Scripted({n: Verdict(0.25) for n in (1, 2, 3)}, delay_s=1.6)  # the second lease waits 1.6 s

    async def scenario() -> None:
        async with serve_orchestrator(state, TokenRegistry(TOKENS)) as server:
            config = PythonScorerConfig(function="m:f", max_items=3, leases_ahead=1)
            scorer = Scorer(config, scorer_id="s0", client=server.client(SCORER), backend=slow)
            assert await most_leased(state, scorer, slow, max_leases=2) == (6, 2)
            assert (scorer.counts.scored, scorer.counts.lost) == (6, 0)
            assert scoring(state).get("score_leases_expired", 0) == 0

    run(scenario())
    assert len(state.ready) == 2


def test_a_backend_that_raises_stops_the_scorer_and_its_leases_expire(
    scoring_state: Any, serve_orchestrator: Any
) -> None:
    state = scoring_state(groups=2, lease_timeout_s=1.0)

    class Broken:
        def score(self, items: list[ScoreItem]) -> list[Verdict]:
            time.sleep(0.3)  # the next lease is fetched meanwhile
            raise RuntimeError("the model does not fit")

    async def scenario() -> None:
        async with serve_orchestrator(state, TokenRegistry(TOKENS)) as server:
            config = PythonScorerConfig(function="m:f", max_items=3, leases_ahead=1)
            scorer = Scorer(config, scorer_id="s0", client=server.client(SCORER), backend=Broken())
            with pytest.raises(RuntimeError, match="does not fit"):
                await asyncio.to_thread(scorer.run)
            assert len(state.score_queue.leases) == 2
            await asyncio.sleep(1.5)  # no longer renewed: both expire
            assert state.score_queue.expire() == 2 and state.score_queue.counts["scores_reassigned"] == 6

    run(scenario())


def test_a_post_for_a_lease_that_is_gone_is_counted_lost(scoring_state: Any, serve_orchestrator: Any) -> None:
    state = scoring_state(groups=1)
    gone = ScoreLease(
        lease_id="f" * 32, deadline=time.time() + 10, score_range=(0.0, 1.0),
        items=[ScoreItem(rollout_id="r1", prompt_id=0, prompt="p", completion="c")],
    )

    async def scenario() -> None:
        async with serve_orchestrator(state, TokenRegistry(TOKENS)) as server:
            scorer = Scorer(PythonScorerConfig(function="m:f"), scorer_id="s0", client=server.client(SCORER),
                            backend=Scripted({}))
            await asyncio.to_thread(scorer.post, gone, [Verdict(0.5)])
            assert scorer.counts.lost == 1 and scorer.counts.scored == 0

    run(scenario())


def test_a_stop_finishes_and_posts_the_batch_in_hand_and_an_idle_scorer_stops_at_once(
    scoring_state: Any, serve_orchestrator: Any
) -> None:
    state = scoring_state(groups=1)
    slow = Scripted({n: Verdict(0.5) for n in (1, 2, 3)}, delay_s=1.0)

    async def scenario() -> None:
        async with serve_orchestrator(state, TokenRegistry(TOKENS)) as server:
            scorer = Scorer(PythonScorerConfig(function="m:f", min_wait_s=30), scorer_id="s0",
                            client=server.client(SCORER), backend=slow)
            threading.Timer(0.3, scorer.request_stop).start()  # while the batch is being scored
            counts = await asyncio.to_thread(scorer.run)
            assert (counts.leases, counts.scored) == (1, 3) and slow.calls == 1
            idle = Scorer(PythonScorerConfig(function="m:f", min_wait_s=30), scorer_id="s1",
                          client=server.client(SCORER), backend=slow)
            threading.Timer(0.3, idle.request_stop).start()  # nothing to score: it waits 30 s unless stopped
            started = time.monotonic()
            assert (await asyncio.to_thread(idle.run)).leases == 0
            assert time.monotonic() - started < 5

    run(scenario())
    assert len(state.ready) == 1


@pytest.mark.integration
def test_decentrl_scorer_exits_cleanly_on_sigterm_after_posting(
    scoring_state: Any, serve_orchestrator: Any, tmp_path: Path
) -> None:
    state = scoring_state(groups=1)

    async def scenario() -> None:
        async with serve_orchestrator(state, TokenRegistry(TOKENS)) as server:
            log = (tmp_path / "scorer.log").open("wb")
            process = subprocess.Popen(
                [sys.executable, "-m", "decentrl", "scorer", "--orchestrator", server.url, "--scorer-id", "sig",
                 "--set", "scorer.type=python", "--set", "scorer.function=tests.scorer_functions:by_length",
                 "--set", "scorer.options={delay_s = 2.0}", "--set", "scorer.min_wait_s=0.1"],
                env={**os.environ, "DECENTRL_TOKEN": SCORER, "PYTHONPATH": str(REPO)}, cwd=REPO, stdout=log, stderr=log,
            )
            try:
                deadline = time.monotonic() + 30
                while scoring(state).get("leased", 0) < 3:  # the process leased the samples and is scoring
                    assert time.monotonic() < deadline and process.poll() is None, (tmp_path / "scorer.log").read_text()
                    await asyncio.sleep(0.05)
                process.send_signal(signal.SIGTERM)
                code = await asyncio.to_thread(process.wait, 30)
            finally:
                if process.poll() is None:
                    process.kill()
            text = (tmp_path / "scorer.log").read_text()
            assert code == 0, text
            assert "stopping" in text and SCORER not in text
            assert len(state.ready) == 1  # the batch in hand was posted before it exited

    run(scenario())


def test_a_reward_model_posts_step_scores_for_the_steps_the_orchestrator_split(
    scoring_state: Any, serve_orchestrator: Any, chat_dir: Path, tmp_path: Path
) -> None:
    from tests.workers.test_scorer_hf import write_classifier

    state = scoring_state(
        groups=1, step_scores=True, advantages={"steps": {"type": "delimiter", "delimiter": "1"}}
    )  # "0" -> ["0"]; "01" -> ["0"] (a trailing delimiter closes no step); "012" -> ["0", "2"]
    config = HFScorerConfig(path=str(write_classifier(chat_dir, tmp_path / "rm", num_labels=1)), transform="sigmoid")
    model = build_scorer_backend(config)
    seen: list[tuple[ScoreItem, Verdict]] = []

    class Spy:
        def score(self, items: list[ScoreItem]) -> list[Verdict]:
            verdicts = model.score(items)
            seen.extend(zip(items, verdicts, strict=True))
            return verdicts

    async def scenario() -> None:
        async with serve_orchestrator(state, TokenRegistry(TOKENS)) as server:
            scorer = Scorer(config, scorer_id="s0", client=server.client(SCORER), backend=Spy())
            counts = await asyncio.to_thread(scorer.run, max_leases=1)
            # accepted: the orchestrator refuses a post whose step scores do not match the steps
            assert (counts.scored, counts.failed, counts.lost) == (3, 0, 0)

    run(scenario())
    (group,) = state.ready
    assert sorted((item.steps, len(verdict.step_scores or ())) for item, verdict in seen) == [
        (["0"], 1), (["0"], 1), (["0", "2"], 2)]
    assert sorted(reward for _, reward in group.samples) == pytest.approx(sorted(v.score for _, v in seen))


def test_a_judge_that_never_parses_is_retried_then_scored_as_the_run_says(
    scoring_state: Any, serve_orchestrator: Any, judge: Any  # noqa: F811 - the fixture imported above
) -> None:
    fake, url = judge
    state = scoring_state(groups=1, on_parse_failure="default", default_score=0.5)
    config = OpenAIScorerConfig(
        base_url=url, model="judge", prompt_template="case=garbage {completion}", backoff_s=0.01, max_attempts=3
    )

    async def scenario() -> None:
        async with serve_orchestrator(state, TokenRegistry(TOKENS)) as server:
            scorer = Scorer(config, scorer_id="s0", client=server.client(SCORER), backend=build_scorer_backend(config))
            counts = await asyncio.to_thread(scorer.run, max_leases=1)
            assert (counts.scored, counts.failed, counts.parse_retries) == (0, 3, 6)
            assert scoring(state)["judge_parse_failures"] == 3 and scoring(state)["judge_parse_retries"] == 6

    run(scenario())
    assert fake.calls["garbage"] == 9  # 3 samples, 3 tries each
    (group,) = state.ready
    assert [reward for _, reward in group.samples] == [0.5, 0.5, 0.5]  # the default, never a silent 0
