"""The `teacher` scorer backend with `[scorer.server]` (workers/scorers/teacher_server.py) against a
real aiohttp server on loopback (tests/openai_server.py `PromptLogprobs`) answering vLLM's
`prompt_logprobs` and the classic `echo` form from the tiny teacher of test_scorer_teacher.py.

Its log-probs are held to a direct forward of that teacher (and to the directory teacher's own
verdicts); an answer that does not fit (too few, another id, NaN, positive, a missing field) is a
failure posted and counted by the orchestrator, never a crash; 5xx is retried; the key never
reaches a log or an error; the config refuses half a teacher or two."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from transformers import AutoModelForCausalLM

from decentrl.config import ConfigError, TeacherScorerConfig, parse_config
from decentrl.model.build import load_text_tokenizer
from decentrl.tasks import build_task
from orchestrator.auth import TokenRegistry
from orchestrator.state import RunState
from tests.openai_server import Loopback, PromptLogprobs
from tests.workers.test_scorer_teacher import item, reference_logprobs, run_info, teacher_dir  # noqa: F401 - a fixture
from workers.scorer import Scorer, checked
from workers.scorers import BackendConfigError, build_scorer_backend
from workers.scorers.teacher_server import TeacherServerBackend, TeacherServerError

CASES = [([1, 5, 6, 7, 3], [4, 5, 2]), ([1, 9, 3], [12, 4, 13, 6, 5, 2]), ([1, 8, 3], [8])]


@pytest.fixture
def served(teacher_dir: Path) -> Iterator[tuple[PromptLogprobs, str]]:  # noqa: F811 - the fixture imported above
    fake = PromptLogprobs(AutoModelForCausalLM.from_pretrained(teacher_dir))
    server = Loopback(fake.app())
    yield fake, server.url + "/v1"
    server.close()


def config(url: str, **server: Any) -> TeacherScorerConfig:
    options = {"base_url": url, "model": "teacher", "backoff_s": 0.01, "timeout_s": 5.0, **server}
    return TeacherScorerConfig.model_validate({"server": options})


@pytest.mark.parametrize("form", ["prompt_logprobs", "echo"])
def test_log_probs_are_the_servers_at_the_completion_positions(
    served: tuple[PromptLogprobs, str], teacher_dir: Path, form: str  # noqa: F811
) -> None:
    fake, url = served
    verdicts = build_scorer_backend(config(url, logprobs=form), run=run_info()).score([item(p, c) for p, c in CASES])
    local = build_scorer_backend(TeacherScorerConfig(path=str(teacher_dir)), run=run_info()).score([item(p, c) for p, c in CASES])
    for (prompt, completion), verdict, hf in zip(CASES, verdicts, local, strict=True):
        assert verdict.error is None and not verdict.transient
        assert verdict.token_logprobs == pytest.approx(reference_logprobs(teacher_dir, prompt, completion), abs=1e-6)
        assert verdict.token_logprobs == pytest.approx(hf.token_logprobs, abs=1e-5)  # the directory's teacher agrees
        assert verdict.score == pytest.approx(hf.score, abs=1e-5)
    body = next(b for b in fake.bodies if b["prompt"] == CASES[0][0] + CASES[0][1])
    assert body["model"] == "teacher" and body["max_tokens"] == 1 and body["temperature"] == 0.0
    wanted = {"prompt_logprobs": 0} if form == "prompt_logprobs" else {"echo": True, "logprobs": 0}
    assert {k: body[k] for k in wanted} == wanted and fake.authorization[-1] is None


FAULTS: dict[str, Any] = {
    "too few": lambda a: {**a, "choices": [{**a["choices"][0], "prompt_logprobs": a["choices"][0]["prompt_logprobs"][:-1]}]},
    "another id": lambda a: {**a, "choices": [{**a["choices"][0], "prompt_logprobs": [
        None, *[{str(int(k) + 1): v for k, v in e.items()} for e in a["choices"][0]["prompt_logprobs"][1:]]]}]},
    "nan": lambda a: {**a, "choices": [{**a["choices"][0], "prompt_logprobs": [
        None, *[{k: {"logprob": float("nan")} for k in e} for e in a["choices"][0]["prompt_logprobs"][1:]]]}]},
    "positive": lambda a: {**a, "choices": [{**a["choices"][0], "prompt_logprobs": [
        None, *[{k: 0.5 for k in e} for e in a["choices"][0]["prompt_logprobs"][1:]]]}]},
    "missing": lambda a: {**a, "choices": [{"index": 0, "text": "x"}]},
    "not json": web.Response(text="<html>proxy</html>", content_type="text/html"),
}
WHY = {"too few": "7 prompt log-probs for the 8 token ids sent (3 of the completion)", "another id": "no log-prob for id 4",
       "nan": "is not finite", "positive": "0.5 is not finite and <= 0", "missing": "no choices[0].prompt_logprobs",
       "not json": "not JSON"}


def test_an_answer_that_does_not_fit_the_completion_fails_the_sample_at_once(served: tuple[PromptLogprobs, str]) -> None:
    fake, url = served
    names = list(FAULTS)
    cases = {(1, 5, 6, 7, 3, 4, 5, 2 + i): name for i, name in enumerate(names)}  # one sample per fault, told apart by its last id
    fake.fault = lambda ids, nth: FAULTS.get(cases.get(tuple(ids), ""))
    verdicts = build_scorer_backend(config(url), run=run_info()).score(
        [item([1, 5, 6, 7, 3], [4, 5, 2 + i]) for i in range(len(names))]
    )
    for name, verdict, sample in zip(names, verdicts, cases, strict=True):
        assert verdict.score is None and not verdict.transient and WHY[name] in (verdict.error or ""), (name, verdict)
        assert fake.calls[sample] == 1  # the same ids get the same answer: not asked again
        assert checked(item([1, 5, 6, 7, 3], list(sample[5:])), verdict, 0.0, 1.0).failure == "parse"


def test_server_errors_are_retried_a_refusal_fails_the_sample_and_a_lost_model_stops_the_scorer(
    served: tuple[PromptLogprobs, str]
) -> None:
    fake, url = served
    statuses = {(1, 5, 3, 4, 2): [500], (1, 5, 3, 4, 3): [503] * 5, (1, 5, 3, 4, 4): [400]}
    fake.fault = lambda ids, nth: (web.json_response({"error": "no"}, status=statuses[tuple(ids)][nth - 1])
                                   if nth <= len(statuses.get(tuple(ids), [])) else None)
    once, always, refused = TeacherServerBackend(config(url), run_info()).score([item([1, 5, 3], [4, c]) for c in (2, 3, 4)])
    assert once.error is None and once.token_logprobs is not None and fake.calls[(1, 5, 3, 4, 2)] == 2
    assert always.score is None and always.transient and "503" in (always.error or "") and fake.calls[(1, 5, 3, 4, 3)] == 3
    assert refused.score is None and not refused.transient and "refused" in (refused.error or "")
    assert fake.calls[(1, 5, 3, 4, 4)] == 1
    backend = TeacherServerBackend(config(url), run_info())
    fake.name = "renamed"  # the server now serves another model: every request is a 404
    with pytest.raises(TeacherServerError, match="404"):
        backend.score([item([1, 5, 3], [4, 2])])


def test_the_key_comes_from_the_environment_and_is_never_logged(
    teacher_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture  # noqa: F811
) -> None:
    fake = PromptLogprobs(AutoModelForCausalLM.from_pretrained(teacher_dir), key="sk-teacher-123")
    server = Loopback(fake.app())
    try:
        url = server.url + "/v1"
        with pytest.raises(BackendConfigError, match="TEACHER_KEY"):
            TeacherServerBackend(config(url, api_key_env="TEACHER_KEY"), run_info())
        caplog.set_level(logging.DEBUG)
        monkeypatch.setenv("TEACHER_KEY", "sk-wrong-456")
        with pytest.raises(BackendConfigError, match="refused the key") as refused:
            TeacherServerBackend(config(url, api_key_env="TEACHER_KEY"), run_info())
        assert "sk-wrong-456" not in str(refused.value)
        monkeypatch.setenv("TEACHER_KEY", "sk-teacher-123")
        backend = TeacherServerBackend(config(url, api_key_env="TEACHER_KEY"), run_info())
        fake.fault = lambda ids, nth: web.json_response({"error": "down"}, status=503) if ids[-1] == 3 else None
        good, down = backend.score([item([1, 5, 3], [4, 2]), item([1, 5, 3], [4, 3])])
        assert good.token_logprobs is not None and down.transient
        assert fake.authorization[-1] == "Bearer sk-teacher-123"
        fake.key = "sk-rotated-789"  # the key was revoked: the scorer stops, naming the status, not the key
        with pytest.raises(TeacherServerError, match="401") as stopped:
            backend.score([item([1, 5, 3], [4, 2])])
        assert caplog.text.count("its tokenizer cannot be checked") == 1  # warned once, at start-up
        everything = caplog.text + str(stopped.value) + str(good) + str(down)
        assert "sk-teacher-123" not in everything and "sk-wrong-456" not in everything
    finally:
        server.close()


def test_the_server_must_serve_the_model_and_the_run_must_distill(served: tuple[PromptLogprobs, str]) -> None:
    _, url = served
    with pytest.raises(BackendConfigError, match=r"does not serve \[scorer.server\] model = 'other' \(it serves teacher\)"):
        build_scorer_backend(config(url, model="other"), run=run_info())
    with pytest.raises(BackendConfigError, match="does not distill"):
        build_scorer_backend(config(url), run=run_info(vocab_digest=None))


@pytest.mark.parametrize(
    ("scorer", "why"),
    [
        ({"type": "teacher"}, "set [scorer] path (a model directory) or [scorer.server]"),
        ({"type": "teacher", "path": "/m", "server": {"base_url": "http://h/v1", "model": "t"}}, "both name a teacher"),
        ({"type": "teacher", "server": {"model": "t"}}, "base_url"),
        ({"type": "teacher", "server": {"base_url": "h:8000", "model": "t"}}, "base_url"),
        ({"type": "teacher", "server": {"base_url": "http://h/v1"}}, "model"),
        ({"type": "teacher", "server": {"base_url": "http://h/v1", "model": "t"}, "temperature": 0.7}, "temperature 1"),
        ({"type": "teacher", "server": {"base_url": "http://h/v1", "model": "t", "logprobs": "top"}}, "logprobs"),
        ({"type": "teacher", "server": {"base_url": "http://h/v1", "model": "t", "api_key_env": "A KEY"}}, "api_key_env"),
    ],
)
def test_teacher_server_config_is_checked(scorer: dict[str, Any], why: str) -> None:
    with pytest.raises(ConfigError) as refused:
        parse_config({"scorer": scorer}, source="test")
    assert why in str(refused.value)


def test_failures_are_posted_and_counted_by_the_orchestrator(
    served: tuple[PromptLogprobs, str], make_config: Any, make_rollout: Any, serve_orchestrator: Any
) -> None:
    fake, url = served
    orchestrator = {"lease_wait_s": 0.0, "rewards": {"type": "sum", "model_weight": 0.0}, "advantages": {"distill": {}}}
    run = make_config(orchestrator=orchestrator)
    state = RunState(config=run, task=build_task(run.task), tokenizer=load_text_tokenizer(run.model))
    state.announce(0)
    for lease in state.grant_leases("w/w0", 1):
        assert state.ingest([make_rollout(lease, "0123"[: i + 1]) for i in range(lease.group_size)], "w/w0").accepted
    fake.fault = lambda ids, nth: FAULTS["too few"]  # every answer one log-prob short
    scorer_config = config(url).model_copy(update={"min_wait_s": 0.05})

    async def scenario() -> dict[str, Any]:
        async with serve_orchestrator(state, TokenRegistry([{"name": "teacher", "role": "scorer", "token": "s"}])) as server:
            client = server.client("s")
            backend = await asyncio.to_thread(build_scorer_backend, scorer_config, await asyncio.to_thread(client.info))
            counts = await asyncio.to_thread(Scorer(scorer_config, scorer_id="t0", client=client, backend=backend).run,
                                             max_leases=1)
            return {"failed": counts.failed, "scored": counts.scored, **(state.status().scoring or {})}

    done = asyncio.run(asyncio.wait_for(scenario(), timeout=60))
    assert done["failed"] == run.group_size and done["scored"] == 0
    assert done["judge_parse_failures"] == run.group_size  # the orchestrator counted them too
