"""The openai backend against a real OpenAI-compatible HTTP server on loopback.

The server (tests/openai_server.py, shared with benchmarks/worker.py) is a small protocol peer:
aiohttp serving /v1/completions from the tiny transformers model (token-id prompts, "token_id:N"
tokens, processed logprobs and top_logprobs, stop strings) and SGLang's /update_weights_from_disk.
The client under test only speaks HTTP to it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from aiohttp import web

from decentrl.api.wire import SamplingParams
from decentrl.config import TinyModelConfig
from decentrl.model.build import build_model
from tests.openai_server import Loopback, completions_app
from tests.workers.test_worker_sampling import reference_logprobs, write_version
from workers.backends.hf import HFBackend
from workers.backends.openai import OpenAIBackend

TINY = TinyModelConfig(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, HFBackend]]:
    engine = HFBackend(seed=1)
    engine.load(write_version(str(tmp_path_factory.mktemp("boot")), build_model(TINY)), 0)
    loopback = Loopback(completions_app(engine))
    yield loopback.url, engine
    loopback.close()


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


def test_openai_backend_sends_the_rows_of_a_call_at_once_for_the_server_to_batch(tmp_path: pytest.TempPathFactory) -> None:
    """The server batches concurrent requests itself, so the worker does not batch again: the
    rows of one call go at once. This server answers none until three are in flight together
    (sent one at a time, the first would wait 5 s and be refused)."""
    in_flight = [0]

    async def completions(request: web.Request) -> web.Response:
        body = await request.json()
        in_flight[0] += 1
        for _ in range(500):
            if in_flight[0] >= 3:
                break
            await asyncio.sleep(0.01)
        else:
            return web.json_response({"error": "the rows came one at a time"}, status=504)
        n = body["max_tokens"]
        logprobs = {"tokens": ["token_id:4"] * n, "token_logprobs": [-0.5] * n, "top_logprobs": [{"token_id:4": -0.5}] * n}
        return web.json_response({"choices": [{"index": 0, "text": "", "logprobs": logprobs, "finish_reason": "length"}]})

    async def reload(request: web.Request) -> web.Response:
        return web.json_response({"success": True})

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/update_weights_from_disk", reload)
    loopback = Loopback(app)
    try:
        backend = OpenAIBackend(url=loopback.url, model="tiny")
        backend.load(write_version(str(tmp_path / "v"), build_model(TINY)), 0)  # type: ignore[operator]
        completions_of_call = backend.generate([[1, 5, 3], [1, 6, 3], [1, 7, 3]], SamplingParams(temperature=1.0, max_tokens=2))
        assert [c.token_ids for c in completions_of_call] == [[4, 4]] * 3
    finally:
        loopback.close()
