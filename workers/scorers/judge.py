"""The `openai` scorer backend: an LLM judge behind an OpenAI-compatible chat completions API,
asked `concurrency` samples at a time; what each answer leads to is in docs/rewards_backends.md.
"""

from __future__ import annotations

import json
import logging
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from decentrl.api.wire import ScoreItem
from decentrl.config import JsonVerdictConfig, OpenAIScorerConfig, RegexVerdictConfig
from workers.scorers.base import Refused, Unreachable, Verdict, attempts, headers, post

log = logging.getLogger("decentrl.scorer.judge")
PLACEHOLDER = re.compile(r"\{(prompt|completion|steps)\}")


class JudgeError(Exception):
    """The judge refuses every request (a wrong key, model name or URL): the scorer cannot work."""


class Unparsed(Exception):
    """The judge's reply holds no verdict; the message says what was missing."""


def render_prompt(template: str, item: ScoreItem) -> str:
    """The template with each placeholder replaced once (text inserted is never re-read as a placeholder)."""
    steps = "\n".join(f"{i}. {step}" for i, step in enumerate(item.steps or (), start=1))
    values = {"prompt": item.prompt, "completion": item.completion, "steps": steps}
    return PLACEHOLDER.sub(lambda match: values[match.group(1)], template)


def parse_verdict(
    reply: str, verdict: RegexVerdictConfig | JsonVerdictConfig, steps: int | None
) -> tuple[float, list[float] | None]:
    """(score, step scores) read from a reply; raises Unparsed. `steps`: how many step scores
    the item wants (None: none); only a JSON verdict with `steps_field` gives them."""
    if isinstance(verdict, RegexVerdictConfig):
        matches = re.findall(verdict.pattern, reply)
        if not matches:
            raise Unparsed(f"no match for {verdict.pattern!r}")
        return _number(matches[-1], "the captured text") * verdict.scale, None
    start, end = reply.find("{"), reply.rfind("}")
    try:
        data = json.loads(reply[start : end + 1]) if 0 <= start < end else None
    except json.JSONDecodeError as exc:
        raise Unparsed(f"the reply's {{...}} is not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise Unparsed("no JSON object in the reply")
    score = _number(_field(data, verdict.field), f"field {verdict.field!r}") * verdict.scale
    if steps is None or verdict.steps_field is None:
        return score, None
    values = _field(data, verdict.steps_field)
    if not isinstance(values, list) or len(values) != steps:
        raise Unparsed(f"field {verdict.steps_field!r} is not a list of {steps} step scores")
    return score, [_number(value, f"a step score in {verdict.steps_field!r}") * verdict.scale for value in values]


def _field(data: dict[str, Any], path: str) -> object:
    value: object = data
    for key in path.split("."):
        if not isinstance(value, dict) or key not in value:
            raise Unparsed(f"no field {path!r}")
        value = value[key]
    return value


def _number(value: object, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise Unparsed(f"{what} is not a number")
    try:
        return float(value)
    except ValueError:
        raise Unparsed(f"{what} is not a number ({str(value)[:40]!r})") from None


class JudgeBackend:
    def __init__(self, config: OpenAIScorerConfig) -> None:
        self.config = config
        self.url = config.base_url.rstrip("/") + "/chat/completions"
        self._headers = headers(config.api_key_env, "[scorer]")
        self._pool = ThreadPoolExecutor(config.concurrency, thread_name_prefix="judge")

    def score(self, items: list[ScoreItem]) -> list[Verdict]:
        return list(self._pool.map(self.judge, items))

    def judge(self, item: ScoreItem) -> Verdict:
        config = self.config
        messages = [{"role": "system", "content": config.system_prompt}] if config.system_prompt else []
        messages.append({"role": "user", "content": render_prompt(config.prompt_template, item)})
        body = json.dumps({
            "model": config.model, "messages": messages, "temperature": config.temperature,
            "max_tokens": config.max_tokens,
        }).encode()
        steps = None if item.steps is None else len(item.steps)
        unparsed = 0
        for attempt in attempts(config.max_attempts, config.backoff_s):
            try:
                score, step_scores = parse_verdict(self._ask(body), config.verdict, steps)
                return Verdict(score, step_scores, retries=unparsed)
            except Refused as exc:
                return Verdict(None, error=f"the judge refused the request: {exc}", retries=unparsed)
            except Unparsed as exc:
                error, transient = f"judge reply did not parse: {exc}", False
                unparsed += attempt + 1 < config.max_attempts  # a retry follows
            except Unreachable as exc:
                error, transient = f"judge unreachable: {exc}", True
            log.info("sample %s, try %d of %d: %s", item.rollout_id, attempt + 1, config.max_attempts, error)
        return Verdict(None, error=error, retries=unparsed, transient=transient)

    def _ask(self, body: bytes) -> str:
        """The text of the judge's reply; raises Unreachable, Refused, Unparsed (an answer
        without a reply's text) or JudgeError."""
        payload = post(self.url, body, self._headers, self.config.timeout_s,
                       lambda answer: JudgeError(f"the judge at {self.url} answered {answer}"))
        try:
            content = json.loads(payload)["choices"][0]["message"]["content"]
        except (ValueError, KeyError, IndexError, TypeError):
            raise Unparsed("the answer is not a chat completion") from None
        if not isinstance(content, str):
            raise Unparsed("the reply has no text")
        return content
