"""Shared fixtures of the unit tests: a tiny run config, the tiny tokenizer, a fake clock, rollouts.

tests/conftest.py sets HF_HUB_OFFLINE and serves a real orchestrator on loopback
(`serve_orchestrator`); everything here is built locally.
"""

from __future__ import annotations

import copy
import uuid
from collections.abc import Callable
from typing import Any

import pytest
from transformers import PreTrainedTokenizerBase

from decentrl.config import RunConfig, parse_config
from decentrl.model import build_tiny_tokenizer
from decentrl.wire import Lease, Rollout, SamplingParams

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
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
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
