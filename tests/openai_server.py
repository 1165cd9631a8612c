"""A small OpenAI-compatible server over the transformers engine, on loopback: the protocol peer
of workers/backends/openai.py in its tests (tests/workers/test_worker_openai.py) and its benchmark
(benchmarks/worker.py, which imports this module); and `PromptLogprobs`, a teacher server for
workers/scorers/teacher_server.py (tests/workers/test_scorer_teacher_server.py).

It serves /v1/completions (token-id prompts, "token_id:N" tokens, the processed logprobs of the
sampled tokens, `top_logprobs`, stop strings) and SGLang's /update_weights_from_disk, one
request at a time. `top_logprobs` are the real top-n of the distribution sampled from when a
request asks for more than one (the client does so under top-k/top-p, to learn the sampling
mask; it costs one more forward pass); with `logprobs: 1` they hold just the sampled token,
which is all the client reads then.
"""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from aiohttp import web

from decentrl.api.wire import SamplingParams
from decentrl.model.sampling import sampling_distribution
from workers.backends.hf import HFBackend


def completions_app(engine: HFBackend) -> web.Application:
    lock = threading.Lock()

    def complete(body: dict[str, Any]) -> dict[str, Any]:
        sampling = SamplingParams(
            temperature=body["temperature"], max_tokens=body["max_tokens"], top_k=body.get("top_k", 0),
            top_p=body.get("top_p", 1.0), stop=body.get("stop", []),
        )
        prompt = body["prompt"]
        with lock:
            done = engine.generate([prompt], sampling)[0]
            tokens = [f"token_id:{t}" for t in done.token_ids]
            if body["logprobs"] > 1:
                assert engine.model is not None
                with torch.no_grad():
                    logits = engine.model(input_ids=torch.tensor([prompt + done.token_ids])).logits[0, len(prompt) - 1 : -1]
                dist = sampling_distribution(logits, sampling)  # (T, V)
                top = torch.topk(dist, min(body["logprobs"], dist.shape[-1]), dim=-1)
                top_logprobs = [
                    {f"token_id:{i}": lp for i, lp in zip(ids, lps, strict=True)}
                    for ids, lps in zip(top.indices.tolist(), top.values.tolist(), strict=True)
                ]
            else:
                top_logprobs = [{t: lp} for t, lp in zip(tokens, done.logprobs, strict=True)]
        logprobs = {"tokens": tokens, "token_logprobs": done.logprobs, "top_logprobs": top_logprobs}
        choice = {"index": 0, "text": "", "logprobs": logprobs, "finish_reason": done.finish_reason}
        return {"object": "text_completion", "model": body["model"], "choices": [choice]}

    async def completions(request: web.Request) -> web.Response:
        return web.json_response(await asyncio.to_thread(complete, await request.json()))

    async def reload(request: web.Request) -> web.Response:
        path = (await request.json())["model_path"]
        with lock:
            engine.load(path, (engine.version or 0) + 1)
        return web.json_response({"success": True})

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/update_weights_from_disk", reload)
    return app


class PromptLogprobs:
    """/v1/completions answering the log-probs of a token-id prompt's own tokens from a causal LM,
    as vLLM does: `prompt_logprobs: 0` -> choices[0].prompt_logprobs (null first, then
    {"<id>": {"logprob", "rank", "decoded_token"}} for the id at each position); `echo: true` with
    `logprobs` -> choices[0].logprobs.token_logprobs (null first, the prompt's, then the one greedy
    token generated). GET /v1/models lists `name`; with `key`, both want "Bearer KEY" (401 else).

    `fault(ids, nth)`, set by a test, may replace the nth (1-based) answer to a prompt of these
    ids: a web.Response is sent as it is, a callable is applied to the answer's JSON first."""

    def __init__(self, model: torch.nn.Module, name: str = "teacher", key: str | None = None) -> None:
        self.model, self.name, self.key = model.eval(), name, key
        self.lock = threading.Lock()
        self.calls: Counter[tuple[int, ...]] = Counter()
        self.bodies: list[dict[str, Any]] = []
        self.authorization: list[str | None] = []
        self.fault: Callable[[list[int], int], Any] = lambda ids, nth: None

    def logprobs(self, ids: list[int]) -> tuple[list[float], int]:
        """log p(ids[t] | ids[:t]) for t >= 1 (float64 over the model's logits) and the greedy next id."""
        with torch.no_grad():
            logits = self.model(input_ids=torch.tensor([ids])).logits[0].double()
        logprobs = logits.log_softmax(-1)
        return [logprobs[t - 1, ids[t]].item() for t in range(1, len(ids))], int(logprobs[-1].argmax())

    def answer(self, body: dict[str, Any]) -> dict[str, Any]:
        ids = body["prompt"]
        with self.lock:
            values, generated = self.logprobs(ids)
        choice: dict[str, Any] = {"index": 0, "text": "x", "finish_reason": "length", "logprobs": None}
        if body.get("prompt_logprobs") is not None:
            choice["prompt_logprobs"] = [None] + [
                {str(token): {"logprob": value, "rank": 1, "decoded_token": ""}} for token, value in zip(ids[1:], values, strict=True)
            ]
        if body.get("echo") and body.get("logprobs") is not None:
            with self.lock:
                last = self.logprobs([*ids, generated])[0][-1]
            choice["logprobs"] = {"tokens": [f"token_id:{t}" for t in [*ids, generated]],
                                  "token_logprobs": [None, *values, last], "top_logprobs": None}
        return {"object": "text_completion", "model": self.name, "choices": [choice]}

    def refused(self, request: web.Request) -> web.Response | None:
        self.authorization.append(request.headers.get("Authorization"))
        if self.key is not None and request.headers.get("Authorization") != f"Bearer {self.key}":
            return web.json_response({"error": "invalid api key"}, status=401)
        return None

    async def completions(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.bodies.append(body)
        if (refused := self.refused(request)) is not None:
            return refused
        if body.get("model") != self.name:
            return web.json_response({"error": f"the model {body.get('model')!r} does not exist"}, status=404)
        key = tuple(body["prompt"])
        self.calls[key] += 1
        fault = self.fault(list(key), self.calls[key])
        if isinstance(fault, web.Response):
            return fault
        answer = await asyncio.to_thread(self.answer, body)
        return web.json_response(fault(answer) if fault is not None else answer)

    async def models(self, request: web.Request) -> web.Response:
        if (refused := self.refused(request)) is not None:
            return refused
        return web.json_response({"object": "list", "data": [{"id": self.name, "object": "model", "max_model_len": 2048}]})

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/v1/models", self.models)
        return app


class Loopback:
    """An aiohttp app on 127.0.0.1 (a free port) in a background event loop; close() stops it."""

    def __init__(self, app: web.Application) -> None:
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.runner = web.AppRunner(app)

        async def up() -> int:
            await self.runner.setup()
            await web.TCPSite(self.runner, "127.0.0.1", 0).start()
            return self.runner.addresses[0][1]

        self.url = f"http://127.0.0.1:{asyncio.run_coroutine_threadsafe(up(), self.loop).result(timeout=60)}"

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(timeout=60)
        self.loop.call_soon_threadsafe(self.loop.stop)
