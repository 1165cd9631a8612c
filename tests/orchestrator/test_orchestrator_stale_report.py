"""What the staleness rule throws away, reported, and the option that keeps late groups.

Each batch carries a `stale_report`: the samples dropped as stale since the previous batch, their
mean completion length and (where it was computed) their mean reward, to hold against the batch
itself (the length bias of dropping late groups, tinker-cookbook PR 822). `orchestrator.keep_late`
lets a group already leased lag that many versions beyond max_staleness and still train.

BASE_CONFIG (conftest): group_size 3, groups_per_step 2, max_staleness 1, max_tokens 6.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from decentrl.api.wire import Lease, TrainBatch
from decentrl.config import ConfigError
from decentrl.trainer.checkpoint import Progress
from decentrl.trainer.metrics import StepTimes, step_record
from orchestrator.state import RunState

HOLDER = "alice/w0"
LONG, SHORT = [4, 5, 6, 7, 2], [4, 2]  # completion ids (2 ends a generation in the tiny tokenizer's config)


@pytest.fixture
def post(make_rollout: Any) -> Callable[..., Any]:
    def send(state: RunState, lease: Lease, ids: list[int], count: int, version: int = 0) -> Any:
        return state.ingest([make_rollout(lease, ids, policy_version=version) for _ in range(count)], HOLDER)

    return send


def late_groups(state: RunState, post: Any) -> tuple[TrainBatch | None, list[Lease]]:
    """A long group completes under version 0 and a short one is still open when the trainer
    reaches version 2; then two fresh groups under version 2 make a batch."""
    long, short = state.grant_leases(HOLDER, 2)
    assert post(state, long, LONG, 3).accepted == 3
    assert post(state, short, SHORT, 2).accepted == 2
    state.announce(1)
    state.announce(2)  # the trainer holds version 2: version 0 lags 2 > max_staleness 1
    last = post(state, short, SHORT, 1)
    fresh = state.grant_leases(HOLDER, 2)
    for lease in fresh:
        assert post(state, lease, SHORT, 3, version=2).accepted == 3
    assert last is not None
    return state.take_batch(2, request_id="step-2"), [long, short]


def test_a_batch_reports_what_went_stale_since_the_previous_one(run_state: Any, post: Any) -> None:
    state = run_state()
    batch, _ = late_groups(state, post)
    assert batch is not None and batch.stale_report is not None
    report = batch.stale_report
    # The long group (3 samples of 5 tokens, rewarded) was evicted; the short one (2 open + the
    # late sample, 2 tokens each, never rewarded) dropped at ingest.
    assert report.samples == 6 and state.stale_dropped == 6
    assert report.mean_length == pytest.approx((3 * 5 + 3 * 2) / 6)
    assert report.mean_reward is not None  # the evicted group's rewards
    assert sum(len(s.completion_token_ids) for s in batch.samples) / len(batch.samples) == 2  # what trains is short
    # The tally starts again: the next batch reports nothing new.
    for lease in state.grant_leases(HOLDER, 2):
        post(state, lease, SHORT, 3, version=2)
    following = state.take_batch(2)
    assert following is not None and following.stale_report is not None and following.stale_report.samples == 0
    assert following.stale_report.mean_length is None


def test_the_report_reaches_the_trainers_metrics(run_state: Any, post: Any) -> None:
    batch, _ = late_groups(run_state(), post)
    assert batch is not None
    record = step_record(
        step=3, batch=batch, trained=batch.samples, loss=0.0, grad_norm=0.0, stats={},
        times=StepTimes(wait_for_batch=0.0, compute=1.0, publish_wait=0.0, checkpoint=0.0),
        progress=Progress(busy_s=1.0, wall_s=1.0), replayed=False,
    )
    assert record["stale_report_samples"] == 6 and record["stale_report_length_mean"] == pytest.approx(3.5)
    assert record["completion_length_mean"] == 2


def test_keep_late_trains_the_late_groups_instead(run_state: Any, post: Any) -> None:
    state = run_state(orchestrator={"keep_late": 1})
    assert state.config.train_staleness == 2
    # Leasing still keeps to max_staleness: (0 + 1 + 1) * 2 groups under version 0.
    assert state.lease_capacity() == 4
    batch, (long, short) = late_groups(state, post)
    assert state.stale_dropped == 0 and not state.dropped
    assert batch is not None and batch.stale_report is not None and batch.stale_report.samples == 0
    assert {s.group_id for s in batch.samples} == {long.lease_id, short.lease_id}  # the late groups, first in line
    assert batch.staleness_histogram == {"2": 6}


def test_the_report_of_a_kept_batch_survives_a_restart(run_state: Any, post: Any, tmp_path: Path) -> None:
    path = str(tmp_path / "journal.sqlite")
    state = run_state(journal=path)
    batch, _ = late_groups(state, post)
    assert batch is not None
    state.journal.flush()
    state.journal.close()
    again = run_state(journal=path).served_batch("step-2")
    assert again is not None and again.stale_report == batch.stale_report


@pytest.mark.parametrize("value", [-1, 65, "one", 1.5])
def test_a_bad_keep_late_is_named(make_config: Any, value: Any) -> None:
    with pytest.raises(ConfigError, match="keep_late"):
        make_config(orchestrator={"keep_late": value})
