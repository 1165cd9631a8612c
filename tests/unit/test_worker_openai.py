"""The openai backend against a real OpenAI-compatible HTTP server on loopback.

The server below is a small protocol peer written for the test: aiohttp serving
/v1/completions from the tiny transformers model (token-id prompts, "token_id:N" tokens,
processed logprobs and top_logprobs, stop strings) and SGLang's /update_weights_from_disk.
The client under test only speaks HTTP to it.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import pytest
import torch
from aiohttp import web

from decentrl.config import TinyModelConfig
from decentrl.model import build_model
from decentrl.wire import SamplingParams
from tests.unit.test_worker_sampling import reference_logprobs, write_version
from workers.backends.hf import HFBackend, sampling_distribution
from workers.backends.openai import OpenAIBackend

TINY = TinyModelConfig(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64)


def completions_app(engine: HFBackend) -> web.Application:
    lock = threading.Lock()

    async def completions(request: web.Request) -> web.Response:
        body = await request.json()
        sampling = SamplingParams(
            temperature=body["temperature"], max_tokens=body["max_tokens"], top_k=body.get("top_k", 0),
            top_p=body.get("top_p", 1.0), stop=body.get("stop", []),
        )
        prompt = body["prompt"]
        with lock:
            done = engine.generate([prompt], sampling)[0]
            assert engine.model is not None
            with torch.no_grad():
                logits = engine.model(input_ids=torch.tensor([prompt + done.token_ids])).logits[0, len(prompt) - 1 : -1]
        dist = sampling_distribution(logits, sampling)  # (T, V)
        top = torch.topk(dist, min(body["logprobs"], dist.shape[-1]), dim=-1)
        logprobs = {
            "tokens": [f"token_id:{t}" for t in done.token_ids],
            "token_logprobs": done.logprobs,
            "top_logprobs": [
                {f"token_id:{i}": lp for i, lp in zip(ids, lps, strict=True)}
                for ids, lps in zip(top.indices.tolist(), top.values.tolist(), strict=True)
            ],
        }
        choice = {"index": 0, "text": "", "logprobs": logprobs, "finish_reason": done.finish_reason}
        return web.json_response({"object": "text_completion", "model": body["model"], "choices": [choice]})

    async def reload(request: web.Request) -> web.Response:
        path = (await request.json())["model_path"]
        with lock:
            engine.load(path, (engine.version or 0) + 1)
        return web.json_response({"success": True})

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/update_weights_from_disk", reload)
    return app


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, HFBackend]]:
    engine = HFBackend(seed=1)
    engine.load(write_version(str(tmp_path_factory.mktemp("boot")), build_model(TINY)), 0)
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    runner = web.AppRunner(completions_app(engine))

    async def up() -> int:
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        return runner.addresses[0][1]

    port = asyncio.run_coroutine_threadsafe(up(), loop).result(timeout=30)
    yield f"http://127.0.0.1:{port}", engine
    asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(timeout=30)
    loop.call_soon_threadsafe(loop.stop)


def test_openai_backend_swaps_weights_and_reports_sampled_logprobs(
    server: tuple[str, HFBackend], tmp_path: pytest.TempPathFactory
) -> None:
    url, engine = server
    backend = OpenAIBackend(url=url, model="tiny", chunk_tokens=3)
    sampling = SamplingParams(temperature=0.8, max_tokens=7, top_k=5)
    prompts = [[1, 7, 5, 8, 3], [1, 4, 3]]
    for version, seed in ((0, 11), (1, 12)):
        model = build_model(TINY.model_copy(update={"seed": seed})).eval()
        backend.load(write_version(str(tmp_path / f"v{version}"), model), version)  # type: ignore[operator]
        assert backend.version == version
        for prompt, completion in zip(prompts * 3, backend.generate(prompts * 3, sampling), strict=True):
            assert 1 <= len(completion.token_ids) <= 7
            # Chunks of 3 tokens, each a new request: the logprobs are still those of the
            # version loaded, over the whole prefix, truncated to the top 5 and renormalized.
            assert completion.logprobs == pytest.approx(reference_logprobs(model, prompt, completion.token_ids, sampling), abs=2e-4)
            assert completion.sampling_mask is not None
            assert all(t in kept and len(kept) == 5 for t, kept in zip(completion.token_ids, completion.sampling_mask, strict=True))
    assert engine.version == 2  # the server reloaded twice through its route


def test_openai_backend_stop_strings_and_interruption(server: tuple[str, HFBackend], tmp_path: pytest.TempPathFactory) -> None:
    url, _ = server
    backend = OpenAIBackend(url=url, model="tiny", chunk_tokens=2)
    backend.load(write_version(str(tmp_path / "v"), build_model(TINY)), 0)  # type: ignore[operator]
    stopping = SamplingParams(temperature=1.5, max_tokens=10, stop=["77", "0"])
    for completion in backend.generate([[1, 5, 3]] * 12, stopping):
        text = backend._decode(completion.token_ids[:-1])  # type: ignore[misc]
        assert "77" not in text and "0" not in text
        assert completion.sampling_mask is None
    interrupted = backend.generate([[1, 5, 3]] * 4, SamplingParams(temperature=1.0, max_tokens=10), lambda: True)
    for completion in interrupted:
        # One chunk, then the deadline: the worker continues it after a swap.
        assert len(completion.token_ids) <= 2 and completion.finish_reason in ("stop", "interrupted")
