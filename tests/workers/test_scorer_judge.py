"""The `openai` judge backend (workers/scorers/judge.py) against a real aiohttp server on loopback
that speaks /v1/chat/completions and answers each sample as its completion text asks: a good
verdict, garbage first or always, a slow reply, a 500 first or always, a refusal, a bad key."""

from __future__ import annotations

import asyncio
import json
import logging
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
from aiohttp import web

from decentrl.api.wire import ScoreItem
from decentrl.config import JsonVerdictConfig, OpenAIScorerConfig, RegexVerdictConfig
from tests.openai_server import Loopback
from workers.scorers import BackendConfigError, build_scorer_backend
from workers.scorers.judge import JudgeBackend, JudgeError, Unparsed, parse_verdict, render_prompt


class FakeJudge:
    """Answers by the case named in the completion ("case=NAME"), counting requests per case."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        self.bodies: list[dict[str, Any]] = []
        self.authorization: list[str | None] = []

    def reply(self, case: str, attempt: int) -> web.Response | str:
        match case:
            case "good":
                return "The order is right. Score: 0.75"
            case "reasoned":
                return "First guess Score: 0.2, but on reflection the final Score: 0.9"
            case "garbage_once":
                return "I cannot decide." if attempt == 1 else "Score: 0.5"
            case "garbage":
                return "no verdict here"
            case "error_once":
                return web.json_response({"error": "overloaded"}, status=500) if attempt == 1 else "Score: 0.25"
            case "error":
                return web.json_response({"error": "down"}, status=503)
            case "refused":
                return web.json_response({"error": "context length exceeded"}, status=400)
            case "badkey":
                return web.json_response({"error": "invalid api key"}, status=401)
            case "json_steps":
                return 'Here: ```json\n{"verdict": {"score": 8}, "steps": [2, 10]}\n```'
            case "json_short":
                return '{"verdict": {"score": 8}, "steps": [2]}' if attempt == 1 else '{"verdict": {"score": 6}, "steps": [1, 3]}'
            case "not_chat":
                return web.Response(text="<html>proxy error</html>", content_type="text/html")
        raise AssertionError(case)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        self.authorization.append(request.headers.get("Authorization"))
        case = body["messages"][-1]["content"].split("case=")[1].split()[0]
        self.calls[case] += 1
        if case == "slow" and self.calls[case] == 1:
            await asyncio.sleep(1.5)
        answer = "Score: 1" if case == "slow" else self.reply(case, self.calls[case])
        if isinstance(answer, web.StreamResponse):
            return answer
        message = {"role": "assistant", "content": answer}
        return web.json_response({"object": "chat.completion", "choices": [{"index": 0, "message": message}]})


@pytest.fixture
def judge() -> Iterator[tuple[FakeJudge, str]]:
    fake = FakeJudge()
    app = web.Application()
    app.router.add_post("/v1/chat/completions", fake.handle)
    server = Loopback(app)
    yield fake, server.url + "/v1"
    server.close()


def item(case: str, steps: list[str] | None = None) -> ScoreItem:
    return ScoreItem(rollout_id=f"r-{case}", prompt_id=1, prompt="sort 3 1 2", completion=f"case={case} 1 2 3", steps=steps)


def config(url: str, **overrides: Any) -> OpenAIScorerConfig:
    options: dict[str, Any] = {"backoff_s": 0.01, "timeout_s": 0.5, "max_attempts": 3, **overrides}
    return OpenAIScorerConfig(base_url=url, model="judge", **options)


def test_good_replies_and_the_last_regex_match(judge: tuple[FakeJudge, str]) -> None:
    fake, url = judge
    good, reasoned = build_scorer_backend(config(url, system_prompt="Be strict.")).score([item("good"), item("reasoned")])
    assert (good.score, good.retries, good.error) == (0.75, 0, None)
    assert reasoned.score == 0.9  # the last "Score:" is the verdict
    body = fake.bodies[0]
    assert body["model"] == "judge" and body["temperature"] == 0.0 and body["max_tokens"] == 512
    assert body["messages"][0] == {"role": "system", "content": "Be strict."}
    assert "sort 3 1 2" in body["messages"][1]["content"] and fake.authorization == [None, None]


def test_unparsed_replies_are_asked_again_then_reported_as_a_failure(judge: tuple[FakeJudge, str]) -> None:
    fake, url = judge
    once, always = JudgeBackend(config(url)).score([item("garbage_once"), item("garbage")])
    assert (once.score, once.retries) == (0.5, 1) and fake.calls["garbage_once"] == 2
    assert always.score is None and not always.transient and always.retries == 2
    assert always.error is not None and "did not parse" in always.error and fake.calls["garbage"] == 3
    not_chat = JudgeBackend(config(url, max_attempts=2)).score([item("not_chat")])[0]
    assert not_chat.score is None and "not a chat completion" in (not_chat.error or "")


def test_server_errors_and_timeouts_are_retried_then_left_for_the_lease_to_expire(judge: tuple[FakeJudge, str]) -> None:
    fake, url = judge
    error_once, slow, error = JudgeBackend(config(url)).score([item("error_once"), item("slow"), item("error")])
    assert (error_once.score, error_once.retries) == (0.25, 0) and fake.calls["error_once"] == 2
    assert slow.score == 1.0 and fake.calls["slow"] == 2  # the first try timed out after 0.5 s
    assert error.score is None and error.transient and "503" in (error.error or "") and fake.calls["error"] == 3


def test_a_refused_request_fails_at_once_and_a_bad_key_stops_the_scorer(judge: tuple[FakeJudge, str]) -> None:
    fake, url = judge
    refused = JudgeBackend(config(url)).score([item("refused")])[0]
    assert refused.score is None and not refused.transient and fake.calls["refused"] == 1
    assert "context length" in (refused.error or "")
    with pytest.raises(JudgeError, match="401"):
        JudgeBackend(config(url)).score([item("badkey")])


def test_the_api_key_comes_from_the_environment_and_is_never_logged(
    judge: tuple[FakeJudge, str], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    fake, url = judge
    with pytest.raises(BackendConfigError, match="JUDGE_KEY"):
        JudgeBackend(config(url, api_key_env="JUDGE_KEY"))
    monkeypatch.setenv("JUDGE_KEY", "sk-secret-123")
    caplog.set_level(logging.DEBUG)
    backend = JudgeBackend(config(url, api_key_env="JUDGE_KEY"))
    verdicts = backend.score([item("good"), item("garbage"), item("error")])
    assert fake.authorization and set(fake.authorization) == {"Bearer sk-secret-123"}
    assert "sk-secret-123" not in caplog.text + "".join(str(v) for v in verdicts)
    with pytest.raises(JudgeError) as raised:
        backend.score([item("badkey")])
    assert "sk-secret-123" not in str(raised.value)


def test_json_verdicts_with_step_scores(judge: tuple[FakeJudge, str]) -> None:
    fake, url = judge
    verdict = JsonVerdictConfig(field="verdict.score", steps_field="steps", scale=0.1)
    template = "Steps:\n{steps}\nAnswer: {completion}\nReply as JSON {\"verdict\": {\"score\": 0-10}, \"steps\": [...]}"
    backend = JudgeBackend(config(url, verdict=verdict, prompt_template=template))
    steps, short = backend.score([item("json_steps", ["1 2", "3"]), item("json_short", ["1", "2 3"])])
    assert steps.score == pytest.approx(0.8) and steps.step_scores == pytest.approx([0.2, 1.0])
    assert short.score == pytest.approx(0.6) and short.step_scores == pytest.approx([0.1, 0.3]) and short.retries == 1
    # The two items are judged concurrently: find the first's request by its content, not its order.
    (sent,) = {b["messages"][0]["content"] for b in fake.bodies if "case=json_steps" in b["messages"][0]["content"]}
    assert "Steps:\n1. 1 2\n2. 3\n" in sent
    assert '{"verdict": {"score": 0-10}' in sent  # literal braces kept


def test_render_prompt_fills_each_placeholder_once() -> None:
    sample = ScoreItem(rollout_id="r", prompt_id=0, prompt="P {completion}", completion="C {steps}", steps=None)
    assert render_prompt("<{prompt}|{completion}|{steps}|{other}>", sample) == "<P {completion}|C {steps}||{other}>"


@pytest.mark.parametrize(
    ("reply", "verdict", "steps", "expected"),
    [
        ("Score: 7", RegexVerdictConfig(scale=0.1), None, (0.7, None)),
        ("score = -1.5", RegexVerdictConfig(), None, (-1.5, None)),
        ('{"score": "0.5"}', JsonVerdictConfig(), None, (0.5, None)),
        ('{"score": 1, "s": [0, 1]}', JsonVerdictConfig(steps_field="s"), None, (1.0, None)),  # no steps wanted
    ],
)
def test_parse_verdict_reads(reply: str, verdict: Any, steps: int | None, expected: tuple[float, Any]) -> None:
    assert parse_verdict(reply, verdict, steps) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("reply", "verdict", "steps", "why"),
    [
        ("no number", RegexVerdictConfig(), None, "no match"),
        ('{"score": true}', JsonVerdictConfig(), None, "not a number"),
        ('{"score": "high"}', JsonVerdictConfig(), None, "not a number"),
        ('{"grade": 1}', JsonVerdictConfig(), None, "no field"),
        ("{not json}", JsonVerdictConfig(), None, "not JSON"),
        ("[1, 2]", JsonVerdictConfig(), None, "no JSON object"),
        ('{"score": 1, "s": [1]}', JsonVerdictConfig(steps_field="s"), 2, "list of 2"),
        ('{"score": 1, "s": [1, null]}', JsonVerdictConfig(steps_field="s"), 2, "not a number"),
    ],
)
def test_parse_verdict_refuses(reply: str, verdict: Any, steps: int | None, why: str) -> None:
    with pytest.raises(Unparsed, match=why):
        parse_verdict(reply, verdict, steps)


def test_judge_config_is_checked() -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="completion"):
        OpenAIScorerConfig(base_url="http://x/v1", model="m", prompt_template="no placeholder {prompt}")
    assert OpenAIScorerConfig(base_url="http://x/v1", model="m", prompt_template="grade {steps}")  # steps alone will do
    with pytest.raises(ValidationError, match="capture group"):
        RegexVerdictConfig(pattern=r"(a)(b)")
    with pytest.raises(ValidationError, match="regular expression"):
        RegexVerdictConfig(pattern=r"(")
    with pytest.raises(ValidationError, match="api_key_env"):
        OpenAIScorerConfig(base_url="http://x/v1", model="m", api_key_env="sk-not-a-name")
    assert json.loads(OpenAIScorerConfig(base_url="http://x/v1", model="m").model_dump_json())["verdict"]["type"] == "regex"
