"""The orchestrator's journal disk fills (issue 46, F9): a real tmpfs of 2 MiB holds the journal and
a file fills the rest. Posts get 503 saying why, the orchestrator stays up, nothing acknowledged is
lost, and it goes on by itself when space returns. Mounting needs root (CI runs as root); the test
is skipped, saying so, elsewhere."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from decentrl.api.wire import RolloutBatch
from decentrl.tasks import build_task
from orchestrator.auth import TokenRegistry
from orchestrator.journal import Journal
from orchestrator.state import RunState
from tests.orchestrator.conftest import TOKENS, WORKER
from tests.orchestrator.test_orchestrator_service import answers


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 2 MiB tmpfs, unmounted at the end."""
    where = tmp_path / "disk"
    where.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root (CI runs as root)")
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(where)], capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {made.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=True)


def fill(path: Path) -> None:
    """Write `path` until the disk is full."""
    with contextlib.suppress(OSError), open(path, "wb") as out:
        while True:
            out.write(b"\0" * 65536)
            out.flush()


def test_a_full_journal_disk_answers_503_and_resumes_when_space_returns(
    small_disk: Path, make_config: Any, tokenizer: Any, serve_orchestrator: Any, sorted_answer: Any, completion_ids: Any,
    caplog: pytest.LogCaptureFixture,
) -> None:
    config = make_config(trainer={"groups_per_step": 8, "steps": 3})
    path = str(small_disk / "journal.sqlite")
    journal = Journal(path, run_name=config.run_name)
    state = RunState(config=config, task=build_task(config.task), tokenizer=tokenizer, journal=journal)
    posted: list[str] = []

    async def post(server: Any, batch: RolloutBatch) -> tuple[int, Any, Any]:
        return await server.call("POST", "/v1/rollouts", WORKER, data=batch.model_dump_json())

    async def scenario() -> None:
        async with serve_orchestrator(state, TokenRegistry(TOKENS)) as server:
            state.announce(0)
            leases = state.grant_leases("alice/w0", 3)
            before, during, after = (answers(server, [lease], sorted_answer, completion_ids) for lease in leases)
            status, result, _ = await post(server, before)
            assert status == 200 and result["accepted"] == len(before.rollouts)
            posted.extend(r.rollout_id for r in before.rollouts)

            fill(small_disk / "filler")
            for _ in range(2):  # a retry meets the same answer
                status, error, headers = await post(server, during)
                assert status == 503 and "journal disk is full" in error["error"] and headers["Retry-After"] == "5", error
            assert (await server.call("POST", "/v1/leases", WORKER, json={"worker_id": "w0", "max_groups": 1}))[0] == 503
            assert (await server.call("GET", "/v1/info", WORKER))[0] == 200  # up, and answering what needs no write
            assert (await server.call("GET", "/healthz"))[0] == 200
            assert not journal.acknowledged([r.rollout_id for r in during.rollouts])

            (small_disk / "filler").unlink()
            started = time.monotonic()  # no request now: the upkeep's next commit writes what was held
            while not journal.acknowledged([r.rollout_id for r in during.rollouts]):
                assert time.monotonic() - started < 5.0, "the journal did not resume by itself"
                await asyncio.sleep(0.1)
            status, result, _ = await post(server, during)  # the worker's retry: acknowledged now, once
            assert status == 200 and result["duplicates"] == len(during.rollouts) and result["accepted"] == 0
            posted.extend(r.rollout_id for r in during.rollouts)
            status, result, _ = await post(server, after)
            assert status == 200 and result["accepted"] == len(after.rollouts)
            posted.extend(r.rollout_id for r in after.rollouts)

    with caplog.at_level(logging.INFO):
        asyncio.run(scenario())
    journal.close()
    reopened = Journal(path, run_name=config.run_name)
    try:
        assert reopened.acknowledged(posted) == set(posted)  # nothing acknowledged is lost
    finally:
        reopened.close()
    assert "Traceback" not in caplog.text
    assert len([r for r in caplog.records if "the disk is full" in r.getMessage()]) == 1
    assert any("space returned" in r.getMessage() for r in caplog.records)
