"""Fixtures the orchestrator's tests share beyond tests/conftest.py."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from typing import TYPE_CHECKING, Any

import pytest
from transformers import PreTrainedTokenizerBase

from decentrl.tasks import build_task
from orchestrator.auth import TokenRegistry
from orchestrator.journal import Journal
from orchestrator.state import RunState

if TYPE_CHECKING:
    from tests.conftest import LiveOrchestrator

# The tokens of the apps `serve` starts: one per role.
WORKER, TRAINER, SCORER, ADMIN = "worker-secret", "trainer-secret", "scorer-secret", "admin-secret"
TOKENS = [
    {"name": "alice", "role": "worker", "token": WORKER},
    {"name": "trainer", "role": "trainer", "token": TRAINER},
    {"name": "judge", "role": "scorer", "token": SCORER},
    {"name": "root", "role": "admin", "token": ADMIN},
]
STORE_URL = "memory://unit-store"
ServeFn = Callable[..., AbstractAsyncContextManager["LiveOrchestrator"]]


@pytest.fixture
def run_state(make_config: Any, tokenizer: PreTrainedTokenizerBase, clock: Any) -> Callable[..., RunState]:
    """`run_state(journal=None, **config_overrides)`: a RunState on BASE_CONFIG (with a journal
    at that path, recovering what it holds), version 0 announced."""

    def make(journal: str | None = None, **overrides: Any) -> RunState:
        config = make_config(**overrides)
        opened = Journal(journal, run_name=config.run_name) if journal is not None else None
        state = RunState(config=config, task=build_task(config.task), tokenizer=tokenizer, clock=clock, journal=opened)
        if state.published_version is None:
            state.announce(0)
        return state

    return make


@pytest.fixture
def serve(make_config: Any, tokenizer: PreTrainedTokenizerBase, serve_orchestrator: Any) -> ServeFn:
    """`async with serve(**config_overrides) as server:` the app on loopback over a new RunState
    (no journal, no version published yet), with the tokens above and the store at STORE_URL."""

    def running(**overrides: Any) -> AbstractAsyncContextManager[LiveOrchestrator]:
        config = make_config(**overrides)
        state = RunState(config=config, task=build_task(config.task), tokenizer=tokenizer)
        return serve_orchestrator(state, TokenRegistry(TOKENS), store_url=STORE_URL)

    return running
