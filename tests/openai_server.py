"""A small OpenAI-compatible server over the transformers engine, on loopback: the protocol peer
of workers/backends/openai.py in its tests (tests/workers/test_worker_openai.py) and its benchmark
(benchmarks/worker.py, which imports this module).

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
