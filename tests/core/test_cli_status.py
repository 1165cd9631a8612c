"""`decentrl status URL` against a real orchestrator on loopback, and help texts that keep their
bracketed words (rich markup once ate "[sampling]" from `decentrl eval --help`)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from typing import Any

from decentrl.tasks import build_task
from orchestrator.auth import TokenRegistry
from orchestrator.state import RunState

TOKENS = [{"name": "volunteer", "role": "worker", "token": "volunteer-secret-1"}]


def decentrl(*args: str, token: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "200", **({"DECENTRL_TOKEN": token} if token else {})}
    return subprocess.run([sys.executable, "-m", "decentrl", *args], capture_output=True, text=True, env=env, timeout=120)


def test_help_keeps_bracketed_words() -> None:
    assert "instead of the run's [sampling]." in decentrl("eval", "--help").stdout


def test_status_prints_the_run_for_any_token(make_config: Any, tokenizer: Any, serve_orchestrator: Any) -> None:
    config = make_config()
    state = RunState(config=config, task=build_task(config.task), tokenizer=tokenizer)

    async def scenario() -> None:
        async with serve_orchestrator(state, TokenRegistry(TOKENS)) as server:
            shown = await asyncio.to_thread(decentrl, "status", server.url, token="volunteer-secret-1")
            assert shown.returncode == 0, shown.stderr
            assert "run unit" in shown.stdout and "rollouts accepted 0" in shown.stdout
            raw = await asyncio.to_thread(decentrl, "status", server.url, "--json", token="volunteer-secret-1")
            assert json.loads(raw.stdout)["run_name"] == "unit"
            refused = await asyncio.to_thread(decentrl, "status", server.url, token="wrong")
            assert refused.returncode == 1 and "401" in refused.stdout and "wrong" not in refused.stdout

    asyncio.run(asyncio.wait_for(scenario(), timeout=120))
