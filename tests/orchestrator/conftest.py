"""Fixtures the orchestrator's tests share beyond tests/conftest.py."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from transformers import PreTrainedTokenizerBase

from decentrl.tasks import build_task
from orchestrator.journal import Journal
from orchestrator.state import RunState


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
