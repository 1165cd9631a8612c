"""The one lease-close path (orchestrator/leases.py, `LeaseBook.close`), through RunState.

Every way a lease closes without training (expired, released, stale at ingest or later, its
worker banned, its check failed) must do the same four things: journal the close and drop the
samples' bodies, count the samples under `dropped[reason]`, and have integrity forget their
content (orchestrator/integrity.py: it may honestly come again). BASE_CONFIG (conftest):
group_size 3, lease_timeout_s 10.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from transformers import PreTrainedTokenizerBase

from decentrl.api.wire import Lease, Rollout
from decentrl.tasks import build_task
from orchestrator.journal import Journal
from orchestrator.state import RunState

HOLDER = "alice/w0"
GROUP = 3


def _one(state: RunState, lease: Lease, make: Callable[..., Rollout], version: int = 0) -> Rollout:
    return make(lease, "".join(sorted(state.task.prompt(lease.prompt_id).text.rstrip("="))), policy_version=version)


def expired(state: RunState, lease: Lease, make: Any, clock: Any) -> list[Rollout]:
    posted = [_one(state, lease, make)]
    state.ingest(posted, HOLDER)
    clock.advance(11)
    assert state.expire_leases() == 1
    return posted


def released(state: RunState, lease: Lease, make: Any, clock: Any) -> list[Rollout]:
    posted = [_one(state, lease, make)]
    state.ingest(posted, HOLDER)
    state.release_lease(lease.lease_id, HOLDER)
    return posted


def stale_at_ingest(state: RunState, lease: Lease, make: Any, clock: Any) -> list[Rollout]:
    posted = [_one(state, lease, make)]
    state.ingest(posted, HOLDER)
    state.announce(2)
    late = _one(state, lease, make)
    assert [r.reason for r in state.ingest([late], HOLDER).rejected] == ["stale"]
    return posted


def completes_stale(state: RunState, lease: Lease, make: Any, clock: Any) -> list[Rollout]:
    posted = [_one(state, lease, make)]
    state.ingest(posted, HOLDER)
    state.announce(2)
    rest = [_one(state, lease, make, version=2) for _ in range(GROUP - 1)]
    assert state.ingest(rest, HOLDER).accepted == GROUP - 1
    return posted + rest


def evicted(state: RunState, lease: Lease, make: Any, clock: Any) -> list[Rollout]:
    posted = [_one(state, lease, make) for _ in range(GROUP)]
    state.ingest(posted, HOLDER)
    assert len(state.ready) == 1
    state.announce(2)
    return posted


def banned(state: RunState, lease: Lease, make: Any, clock: Any) -> list[Rollout]:
    posted = [_one(state, lease, make) for _ in range(GROUP)]
    state.ingest(posted, HOLDER)
    assert state.drop_banned("alice") == GROUP
    return posted


def failed_check(state: RunState, lease: Lease, make: Any, clock: Any) -> list[Rollout]:
    posted = [_one(state, lease, make) for _ in range(GROUP)]
    state.ingest(posted, HOLDER)
    (job,) = state.verify_queue
    state.verification_done({lease.lease_id: {job.rollouts[0].rollout_id: "logprob_mismatch"}})
    return posted


CLOSES = {
    expired: ("expired", "lease_expired", 1),
    released: ("released", "lease_released", 1),
    stale_at_ingest: ("dropped", "stale_at_ingest", 1),
    completes_stale: ("dropped", "stale_in_buffer", GROUP),
    evicted: ("dropped", "stale_in_buffer", GROUP),
    banned: ("dropped", "banned_worker", GROUP),
    failed_check: ("dropped", "failed_verification", GROUP - 1),  # the failed sample is a rejection
}


@pytest.mark.parametrize("close", list(CLOSES), ids=lambda close: close.__name__)
def test_every_close_without_training_journals_counts_and_forgets(
    close: Callable[..., list[Rollout]], make_config: Any, tokenizer: PreTrainedTokenizerBase, clock: Any,
    make_rollout: Any, tmp_path: Path,
) -> None:
    status, reason, counted = CLOSES[close]
    # Verification on (content is kept for replay detection); only `failed_check` holds groups back.
    checks = 1 if close is failed_check else 0
    verification = {"enabled": True, "new_worker_checks": checks, "spot_check_fraction": 0.0}
    config = make_config(max_staleness=1, orchestrator={"verification": verification})
    path = str(tmp_path / "journal.sqlite")
    state = RunState(
        config=config, task=build_task(config.task), tokenizer=tokenizer, clock=clock,
        journal=Journal(path, run_name=config.run_name),
    )
    state.announce(0)
    (lease,) = state.grant_leases(HOLDER, 1)

    posted = close(state, lease, make_rollout, clock)

    assert state.lease_state(lease.lease_id, HOLDER).state == status
    assert state.dropped == {reason: counted}
    assert not state.ready and not state.pending and lease.lease_id not in state.leases
    for rollout in posted:  # the same content under another lease and version is no replay now
        probe = rollout.model_copy(update={"lease_id": "another", "policy_version": 7})
        assert state.integrity.replay_of(probe) is not None
    state.journal.flush()
    with sqlite3.connect(path) as db:
        assert db.execute("SELECT status FROM leases WHERE lease_id = ?", (lease.lease_id,)).fetchone()[0] == status
        bodies = db.execute("SELECT COUNT(*) FROM rollouts WHERE lease_id = ? AND data IS NOT NULL", (lease.lease_id,))
        assert bodies.fetchone()[0] == 0
        assert db.execute("SELECT COUNT(*) FROM content").fetchone()[0] == 0
