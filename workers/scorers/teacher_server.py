"""The `teacher` scorer backend with `[scorer.server]`: the teacher behind an OpenAI-compatible
completions server, `concurrency` samples at a time. One POST per sample of its token ids as they
are, read back as vLLM's `prompt_logprobs` or the classic `echo` form; the score as in teacher.py.
docs/rewards_backends.md has what each answer leads to, and why the tokenizer is the operator's.
"""

from __future__ import annotations

import json
import logging
import math
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from decentrl.api.wire import RunInfo, ScoreItem
from decentrl.config.scorer import TeacherScorerConfig, TeacherServerConfig
from workers.scorers.base import NO_ANSWER, BackendConfigError, Refused, Unreachable, Verdict, attempts, distilled, headers, post
from workers.scorers.teacher import item_problem

log = logging.getLogger("decentrl.scorer.teacher")


class TeacherServerError(Exception):
    """The server refuses every request (a wrong key, model name or URL): the scorer cannot work."""


class BadAnswer(Exception):
    """The server's answer holds no usable log-prob per completion token; the message says why."""


def completion_logprobs(answer: object, form: str, prompt: list[int], completion: list[int]) -> list[float]:
    """The log-prob of each completion token read from a /completions answer, strictly; raises BadAnswer."""
    try:
        choice = answer["choices"][0]  # type: ignore[index]
        entries = choice["prompt_logprobs"] if form == "prompt_logprobs" else choice["logprobs"]["token_logprobs"]
    except (KeyError, IndexError, TypeError):
        field = "choices[0].prompt_logprobs" if form == "prompt_logprobs" else "choices[0].logprobs.token_logprobs"
        raise BadAnswer(f"the answer has no {field}") from None
    if not isinstance(entries, list):
        raise BadAnswer("the answer's log-probs are not a list")
    sent = len(prompt) + len(completion)
    if form == "prompt_logprobs" and len(entries) != sent:
        raise BadAnswer(f"{len(entries)} prompt log-probs for the {sent} token ids sent ({len(completion)} of the completion)")
    if form == "echo" and not sent <= len(entries) <= sent + 1:
        raise BadAnswer(f"{len(entries)} echoed log-probs for the {sent} token ids sent ({len(completion)} of the "
                        "completion) and at most one generated")
    values = []
    for t, (entry, token) in enumerate(zip(entries[len(prompt) : sent], completion, strict=True)):
        if form == "prompt_logprobs":
            if not isinstance(entry, dict) or str(token) not in entry:
                raise BadAnswer(f"completion token {t}: no log-prob for id {token} (the id sent there)")
            entry = entry[str(token)]
            if isinstance(entry, dict):
                entry = entry.get("logprob")
        if isinstance(entry, bool) or not isinstance(entry, int | float):
            raise BadAnswer(f"completion token {t}: the log-prob is not a number ({str(entry)[:40]!r})")
        value = float(entry)
        if not math.isfinite(value) or value > 0:
            raise BadAnswer(f"completion token {t}: log-prob {value!r} is not finite and <= 0")
        values.append(value)
    return values


class TeacherServerBackend:
    def __init__(self, config: TeacherScorerConfig, run: RunInfo) -> None:
        assert config.server is not None
        self.config, self.server = config, config.server
        self.url = self.server.base_url.rstrip("/") + "/completions"
        self._headers = headers(self.server.api_key_env, "[scorer.server]")
        vocab_size, digest = distilled(run)
        self._check_model(self.server)
        log.warning(
            "teacher server %s (model %r): its tokenizer cannot be checked against the run's (%d tokens, digest %s...); "
            "it must be the student's, the same tokens under the same ids - that is the operator's to ensure",
            self.server.base_url, self.server.model, vocab_size, digest[:12],
        )
        self._pool = ThreadPoolExecutor(self.server.concurrency, thread_name_prefix="teacher")

    def _check_model(self, server: TeacherServerConfig) -> None:
        """GET BASE_URL/models: a bad key or a model the server does not serve stops the scorer at
        start-up; a server without the route, or not up yet, is let be (its requests will tell)."""
        request = urllib.request.Request(server.base_url.rstrip("/") + "/models", headers=self._headers)
        try:
            with urllib.request.urlopen(request, timeout=server.timeout_s) as response:
                served = [model.get("id") for model in json.loads(response.read())["data"]]
        except urllib.error.HTTPError as exc:
            if exc.code in (401, 403):
                raise BackendConfigError(f"the teacher server at {server.base_url} refused the key ({exc.code}): "
                                         f"check [scorer.server] api_key_env") from None
            log.warning("teacher server %s: GET /models answered %d; the model name is not checked", server.base_url, exc.code)
            return
        except NO_ANSWER as exc:
            log.warning("teacher server %s not reachable at start-up (%s); scoring will retry", server.base_url, exc)
            return
        except (ValueError, KeyError, TypeError, AttributeError):
            log.warning("teacher server %s: GET /models is not a model list; the model name is not checked", server.base_url)
            return
        if server.model not in served:
            raise BackendConfigError(
                f"the teacher server at {server.base_url} does not serve [scorer.server] model = {server.model!r} "
                f"(it serves {', '.join(map(str, served[:10])) or 'none'})"
            )

    def score(self, items: list[ScoreItem]) -> list[Verdict]:
        return list(self._pool.map(self.teacher, items))

    def teacher(self, item: ScoreItem) -> Verdict:
        server = self.server
        if (problem := item_problem(item, self.config.max_length)) is not None:
            return Verdict(None, error=problem)
        prompt, completion = item.prompt_token_ids or [], item.completion_token_ids or []
        body: dict[str, Any] = {"model": server.model, "prompt": [*prompt, *completion], "max_tokens": 1, "temperature": 0.0}
        body.update({"prompt_logprobs": 0} if server.logprobs == "prompt_logprobs" else {"echo": True, "logprobs": 0})
        data = json.dumps(body).encode()
        for attempt in attempts(server.max_attempts, server.backoff_s):
            try:
                logprobs = completion_logprobs(self._ask(data), server.logprobs, prompt, completion)
                return Verdict(math.exp(sum(logprobs) / len(logprobs)), token_logprobs=logprobs)
            except BadAnswer as exc:
                return Verdict(None, error=f"the teacher server's answer: {exc}")
            except Refused as exc:
                return Verdict(None, error=f"the teacher server refused the request: {exc}")
            except Unreachable as exc:
                error = f"teacher server unreachable: {exc}"
            log.info("sample %s, try %d of %d: %s", item.rollout_id, attempt + 1, server.max_attempts, error)
        return Verdict(None, error=error, transient=True)

    def _ask(self, body: bytes) -> object:
        """The server's answer as JSON; raises Unreachable, Refused, BadAnswer or TeacherServerError."""
        payload = post(self.url, body, self._headers, self.server.timeout_s,
                       lambda answer: TeacherServerError(f"the teacher server at {self.url} answered {answer}"))
        try:
            return json.loads(payload)
        except ValueError:
            raise BadAnswer("the answer is not JSON") from None
