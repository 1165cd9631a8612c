"""A scorer killed mid-run (a real `decentrl scorer` process, SIGKILL) loses nothing: its score
leases (the one it scores and the one it holds ahead) expire, their samples go to another scorer process, every group is scored and the
trainer's batches are served. The orchestrator is the real app on loopback (tests/conftest.py)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from decentrl.tasks import build_task
from orchestrator.auth import TokenRegistry
from orchestrator.state import RunState

ROOT = Path(__file__).resolve().parents[2]
TOKENS = [
    {"name": "judge-a", "role": "scorer", "token": "scorer-a"},
    {"name": "judge-b", "role": "scorer", "token": "scorer-b"},
    {"name": "trainer", "role": "trainer", "token": "trainer-secret"},
]
GROUPS = 2


def start_scorer(url: str, token: str, scorer_id: str, delay_s: float, log: Path, *sets: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "decentrl", "scorer", "--orchestrator", url, "--scorer-id", scorer_id,
         "--set", "scorer.type=python", "--set", "scorer.function=tests.scorer_functions:by_length",
         "--set", f"scorer.options={{delay_s = {delay_s}}}", "--set", "scorer.min_wait_s=0.1",
         *(arg for name in sets for arg in ("--set", name))],
        env={**os.environ, "DECENTRL_TOKEN": token, "PYTHONPATH": str(ROOT)},
        stdout=log.open("wb"), stderr=subprocess.STDOUT,
    )


async def wait_for(condition: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.1)


def test_a_killed_scorers_leases_go_to_another_and_the_run_completes(
    make_config: Any, tokenizer: Any, make_rollout: Any, sorted_answer: Any, serve_orchestrator: Any, tmp_path: Path
) -> None:
    config = make_config(orchestrator={"lease_wait_s": 0.5, "rewards": {"type": "model", "lease_timeout_s": 3.0}},
                         trainer={"groups_per_step": GROUPS, "steps": 3})
    state = RunState(config=config, task=build_task(config.task), tokenizer=tokenizer)
    state.announce(0)
    for lease in state.grant_leases("alice/w0", GROUPS):
        answer = sorted_answer(state.task.prompt(lease.prompt_id).text)
        state.ingest([make_rollout(lease, answer) for _ in range(lease.group_size)], "alice/w0")
    samples = GROUPS * config.group_size

    async def scenario() -> None:
        async with serve_orchestrator(state, TokenRegistry(TOKENS)) as server:
            # It never finishes scoring its first group, and holds the second in hand (leases_ahead = 1).
            doomed = start_scorer(server.url, "scorer-a", "a", 600.0, tmp_path / "a.log",
                                  f"scorer.max_items={config.group_size}", "scorer.leases_ahead=1")
            survivor = None
            try:
                await wait_for(lambda: state.score_queue.leased() == samples, 60, "scorer a to lease every sample")
                await asyncio.sleep(4.0)  # it renews both leases: nothing expires yet
                assert state.score_queue.leased() == samples and state.score_queue.counts["scores_reassigned"] == 0
                assert len(state.score_queue.leases) == GROUPS  # one being scored, one in hand
                os.kill(doomed.pid, signal.SIGKILL)
                await asyncio.to_thread(doomed.wait, 10)
                survivor = start_scorer(server.url, "scorer-b", "b", 0.0, tmp_path / "b.log")
                await wait_for(lambda: len(state.ready) == GROUPS, 60, "scorer b to score the reassigned samples")
                assert state.score_queue.counts["scores_reassigned"] == samples
                status, batch, _ = await server.call("GET", "/v1/batch?trainer_version=0", "trainer-secret")
                assert status == 200 and len(batch["samples"]) == samples
                assert {s["reward"] for s in batch["samples"]} == {0.4}  # four digits, "1234" scored by length
            finally:
                for process in (doomed, survivor):
                    if process is not None and process.poll() is None:
                        process.send_signal(signal.SIGTERM)  # it finishes its request: keep serving
                        await asyncio.to_thread(process.wait, 20)

    asyncio.run(asyncio.wait_for(scenario(), timeout=150))
