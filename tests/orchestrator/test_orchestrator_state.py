"""Unit tests for orchestrator.state.RunState: leases, ingest checks, scoring, groups, batches.

A fake clock stands in for time; the tiny tokenizer and the real sorting verifier do the rest.
BASE_CONFIG (conftest): group_size 3, groups_per_step 2, max_staleness 1, max_tokens 6.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
from pydantic import ValidationError
from transformers import PreTrainedTokenizerBase

from decentrl.api.encoding import MEDIA_MSGPACK, TypedList, encode_model, unpack_msgpack
from decentrl.api.wire import Lease, Rejection, Rollout, SamplingParams
from decentrl.tasks import build_task
from orchestrator.state import RunState

HOLDER = "alice/w0"
GROUP = 3  # BASE_CONFIG group_size

MakeState = Callable[..., RunState]


@pytest.fixture
def make_state(make_config: Any, tokenizer: PreTrainedTokenizerBase, clock: Any) -> MakeState:
    def make(**overrides: Any) -> RunState:
        config = make_config(**overrides)
        return RunState(config=config, task=build_task(config.task), tokenizer=tokenizer, clock=clock)

    return make


@pytest.fixture
def answer(sorted_answer: Callable[[str], str]) -> Callable[[RunState, Lease], str]:
    """The right answer to a lease's prompt."""

    def right(state: RunState, lease: Lease) -> str:
        return sorted_answer(state.task.prompt(lease.prompt_id).text)

    return right


@pytest.fixture
def complete_group(make_rollout: Any, answer: Any) -> Callable[..., list[Rollout]]:
    """Post a whole group of right answers for `lease`; returns the rollouts posted."""

    def post(state: RunState, lease: Lease, *, policy_version: int = 0, logprob: float = -1.0) -> list[Rollout]:
        rollouts = [
            make_rollout(lease, answer(state, lease), policy_version=policy_version, logprob=logprob)
            for _ in range(lease.group_size)
        ]
        result = state.ingest(rollouts, HOLDER)
        assert result.accepted == len(rollouts), result
        return rollouts

    return post


# -- leases -------------------------------------------------------------------------------


def test_no_leases_before_a_version_is_announced(make_state: MakeState) -> None:
    state = make_state()
    assert state.grant_leases(HOLDER, 4) == []
    assert state.lease_capacity() == 0
    state.announce(0)
    assert len(state.grant_leases(HOLDER, 4)) == 4


def test_lease_carries_prompt_tokens_group_size_and_deadline(
    make_state: MakeState, tokenizer: PreTrainedTokenizerBase, clock: Any
) -> None:
    state = make_state()
    state.announce(0)
    (lease,) = state.grant_leases(HOLDER, 1)
    assert lease.prompt_token_ids == tokenizer(state.task.prompt(lease.prompt_id).text).input_ids
    assert lease.group_size == GROUP
    assert lease.deadline == clock() + 10.0


@pytest.mark.parametrize("max_staleness", [0, 1, 2])
def test_lease_budget_is_respected(make_state: MakeState, max_staleness: int) -> None:
    state = make_state(max_staleness=max_staleness)
    state.announce(0)
    granted = state.grant_leases(HOLDER, 100)
    # Version 0 plus max_staleness versions of slack, groups_per_step (2) groups each.
    assert len(granted) == (max_staleness + 1) * 2
    assert state.grant_leases(HOLDER, 100) == []
    assert len({lease.lease_id for lease in granted}) == len(granted)
    assert len({lease.prompt_id for lease in granted}) == len(granted)


def test_synchronous_budget_reopens_only_with_the_next_version(
    make_state: MakeState, complete_group: Any
) -> None:
    state = make_state(max_staleness=0)
    state.announce(0)
    leases = state.grant_leases(HOLDER, 100)
    assert len(leases) == 2
    for lease in leases:
        complete_group(state, lease)
    assert state.take_batch(0) is not None
    # Served groups still count: nothing more may start under version 0.
    assert state.grant_leases(HOLDER, 100) == []
    state.announce(1)
    assert len(state.grant_leases(HOLDER, 100)) == 2


# -- ingest and scoring -------------------------------------------------------------------


def test_ingest_scores_with_the_verifier_not_the_claimed_reward(
    make_state: MakeState, make_rollout: Any, answer: Any
) -> None:
    state = make_state(trainer={"groups_per_step": 1})
    state.announce(0)
    (lease,) = state.grant_leases(HOLDER, 1)
    right = answer(state, lease)
    rollouts = [
        make_rollout(lease, right, claimed_reward=0.0),  # verifier: 1.0
        make_rollout(lease, right[:2] + "==", claimed_reward=1.0),  # two positions right: 0.5
        make_rollout(lease, "====", claimed_reward=1.0),  # verifier: 0.0
    ]
    result = state.ingest(rollouts, HOLDER)
    assert (result.accepted, result.duplicates, result.rejected) == (3, 0, [])
    assert state.rollouts_accepted == 3

    batch = state.take_batch(0)
    assert batch is not None
    by_completion = {tuple(s.completion_token_ids): s for s in batch.samples}
    expected = {0: (1.0, 0.5), 1: (0.5, 0.0), 2: (0.0, -0.5)}  # (reward, reward - group mean 0.5)
    for index, (reward, advantage) in expected.items():
        sample = by_completion[tuple(rollouts[index].completion_token_ids)]
        assert sample.reward == pytest.approx(reward)
        assert sample.advantage == pytest.approx(advantage)
        assert sample.prompt_token_ids == lease.prompt_token_ids
        assert sample.logprobs == rollouts[index].logprobs
        assert sample.policy_version == 0
    assert batch.trainer_version == 0
    assert batch.rollouts_accepted == 3


def test_duplicate_rollout_id_is_counted_once(make_state: MakeState, make_rollout: Any, answer: Any) -> None:
    state = make_state()
    state.announce(0)
    (lease,) = state.grant_leases(HOLDER, 1)
    rollout = make_rollout(lease, answer(state, lease))

    first = state.ingest([rollout, rollout], HOLDER)
    assert (first.accepted, first.duplicates) == (1, 1)
    resend = state.ingest([rollout], HOLDER)
    assert (resend.accepted, resend.duplicates, resend.rejected) == (0, 1, [])
    assert state.rollouts_accepted == 1
    assert len(state.leases[lease.lease_id].samples) == 1


REJECTIONS: dict[str, Callable[[RunState, Lease], dict[str, Any]]] = {
    "wrong_run": lambda state, lease: {"run_name": "another-run"},
    "unknown_or_expired_lease": lambda state, lease: {"lease_id": "no-such-lease"},
    "not_lease_holder": lambda state, lease: {"holder": "mallory/w0"},
    "prompt_mismatch": lambda state, lease: {"prompt_id": (lease.prompt_id + 1) % state.task.num_prompts},
    "prompt_tokens_mismatch": lambda state, lease: {"prompt_token_ids": lease.prompt_token_ids[:-1]},
    "sampling_mismatch": lambda state, lease: {"sampling": SamplingParams(temperature=0.5, max_tokens=6)},
    "sampling_max_tokens_mismatch": lambda state, lease: {"sampling": SamplingParams(temperature=1.0, max_tokens=7)},
    "future_version": lambda state, lease: {"policy_version": 1},
    "token_out_of_vocabulary": lambda state, lease: {"completion": [4, len(state.tokenizer)]},
    "negative_token": lambda state, lease: {"completion": [4, -1]},
    "too_many_tokens": lambda state, lease: {"completion": [4] * 7},
    "bad_token_versions": lambda state, lease: {"completion": [4, 2], "token_versions": [0, 1]},
}
REASON = {
    "prompt_tokens_mismatch": "prompt_mismatch",
    "sampling_max_tokens_mismatch": "sampling_mismatch",
    "negative_token": "token_out_of_vocabulary",
}


@pytest.mark.parametrize("encoding", ["json", "msgpack"])
@pytest.mark.parametrize("case", sorted(REJECTIONS))
def test_rejection_reasons(case: str, encoding: str, make_state: MakeState, make_rollout: Any, answer: Any) -> None:
    state = make_state()
    state.announce(0)
    (lease,) = state.grant_leases(HOLDER, 1)
    fields = REJECTIONS[case](state, lease)
    holder = fields.pop("holder", HOLDER)
    completion = fields.pop("completion", answer(state, lease))
    bad = make_rollout(lease, completion, **fields)
    if encoding == "msgpack":  # typed arrays: checked over their bytes (numpy), not element by element
        bad = Rollout.model_validate(unpack_msgpack(encode_model(bad, MEDIA_MSGPACK)))
        assert type(bad.completion_token_ids) is TypedList

    result = state.ingest([bad], holder)

    reason = REASON.get(case, case)
    assert result.accepted == 0
    assert result.rejected == [Rejection(rollout_id=bad.rollout_id, reason=reason)]
    assert state.rejected == {reason: 1}
    assert state.status().rollouts_rejected == {reason: 1}
    assert state.rollouts_accepted == 0
    # The lease is untouched: its holder can still answer it properly.
    assert state.leases[lease.lease_id].samples == []
    good = state.ingest([make_rollout(lease, answer(state, lease))], HOLDER)
    assert good.accepted == 1


def test_a_group_takes_no_more_than_group_size_samples(
    make_state: MakeState, make_rollout: Any, answer: Any
) -> None:
    state = make_state(trainer={"groups_per_step": 1})
    state.announce(0)
    (lease,) = state.grant_leases(HOLDER, 1)
    rollouts = [make_rollout(lease, answer(state, lease)) for _ in range(GROUP + 1)]
    result = state.ingest(rollouts, HOLDER)
    assert result.accepted == GROUP
    assert [r.rollout_id for r in result.rejected] == [rollouts[-1].rollout_id]
    batch = state.take_batch(0)
    assert batch is not None and len(batch.samples) == GROUP


def test_extra_sample_of_a_complete_group_is_rejected_as_group_full(
    make_state: MakeState, make_rollout: Any, answer: Any
) -> None:
    state = make_state()
    state.announce(0)
    (lease,) = state.grant_leases(HOLDER, 1)
    rollouts = [make_rollout(lease, answer(state, lease)) for _ in range(GROUP + 1)]
    result = state.ingest(rollouts, HOLDER)
    assert [r.reason for r in result.rejected] == ["group_full"]


@pytest.mark.parametrize("logprob", [float("nan"), float("-inf")])
def test_rollout_with_non_finite_logprob_is_not_accepted(
    logprob: float, make_state: MakeState, make_rollout: Any, answer: Any
) -> None:
    state = make_state()
    state.announce(0)
    (lease,) = state.grant_leases(HOLDER, 1)
    # Refused already by the wire schema, so the orchestrator's ingest never sees it.
    with pytest.raises(ValidationError, match="logprobs must be finite"):
        make_rollout(lease, answer(state, lease), logprob=logprob)
    assert state.rollouts_accepted == 0


# -- staleness ----------------------------------------------------------------------------


def test_stale_rollout_is_rejected_and_frees_its_lease(
    make_state: MakeState, make_rollout: Any, answer: Any
) -> None:
    state = make_state(max_staleness=0, trainer={"groups_per_step": 1})
    state.announce(0)
    (lease,) = state.grant_leases(HOLDER, 1)
    assert state.ingest([make_rollout(lease, answer(state, lease))], HOLDER).accepted == 1
    state.announce(1)  # the trainer now holds version 1: version-0 samples are stale

    late = make_rollout(lease, answer(state, lease), policy_version=0)
    result = state.ingest([late], HOLDER)
    assert result.rejected == [Rejection(rollout_id=late.rollout_id, reason="stale")]
    assert lease.lease_id not in state.leases
    assert state.stale_dropped == 2  # this sample and the one already in the group
    # The slot and the prompt are free again: the next lease is the same prompt.
    (again,) = state.grant_leases(HOLDER, 1)
    assert again.prompt_id == lease.prompt_id and again.lease_id != lease.lease_id
    # Further samples of the dropped group have no lease to answer any more; the orchestrator
    # still remembers the lease (dedupe_window_s), so it says precisely why.
    rest = state.ingest([make_rollout(lease, answer(state, lease))], HOLDER)
    assert [r.reason for r in rest.rejected] == ["group_dropped"]


def test_rollout_one_version_behind_is_accepted_with_staleness_one(
    make_state: MakeState, make_rollout: Any, answer: Any
) -> None:
    state = make_state(max_staleness=1, trainer={"groups_per_step": 1})
    state.announce(0)
    (lease,) = state.grant_leases(HOLDER, 1)
    state.announce(1)
    rollouts = [make_rollout(lease, answer(state, lease), policy_version=0) for _ in range(GROUP)]
    assert state.ingest(rollouts, HOLDER).accepted == GROUP
    assert state.take_batch(1) is not None


@pytest.mark.parametrize("how", ["announce", "take_batch"])
def test_groups_that_go_stale_are_evicted(how: str, make_state: MakeState, complete_group: Any) -> None:
    state = make_state(max_staleness=1)
    state.announce(0)
    (lease,) = state.grant_leases(HOLDER, 1)
    complete_group(state, lease, policy_version=0)
    state.announce(1)
    assert state.status().groups_ready == 1  # one version behind: still fresh
    assert state.stale_dropped == 0

    capacity_before = state.lease_capacity()
    if how == "announce":
        state.announce(2)
    else:
        assert state.take_batch(2) is None  # the trainer moved on without this group
    assert state.status().groups_ready == 0
    assert state.stale_dropped == GROUP
    assert state.take_batch(2) is None
    # The evicted group no longer counts against the budget.
    if how == "take_batch":
        assert state.lease_capacity() == capacity_before + 1


def test_expired_lease_is_leased_again_and_late_rollout_rejected(
    make_state: MakeState, make_rollout: Any, answer: Any, clock: Any
) -> None:
    state = make_state()  # lease_timeout_s = 10
    state.announce(0)
    (lease,) = state.grant_leases(HOLDER, 1)

    clock.advance(10.0)  # exactly at the deadline the lease still holds
    on_time = state.ingest([make_rollout(lease, answer(state, lease))], HOLDER)
    assert on_time.accepted == 1

    clock.advance(0.5)
    (again,) = state.grant_leases("bob/w1", 1)
    assert again.prompt_id == lease.prompt_id
    assert again.lease_id != lease.lease_id
    assert state.leases_expired == 1
    assert lease.lease_id not in state.leases

    # A late result of an expired lease is rejected (the prompt went to bob), with its own reason.
    late = make_rollout(lease, answer(state, lease))
    result = state.ingest([late], HOLDER)
    assert result.rejected == [Rejection(rollout_id=late.rollout_id, reason="lease_expired")]
    # The new holder answers the new lease.
    fresh = state.ingest([make_rollout(again, answer(state, again), worker_id="w1")], "bob/w1")
    assert fresh.accepted == 1


# Verification on, every sample accepted unchecked: integrity keeps content hashes (replays).
KEEP_CONTENT = {"verification": {"enabled": True, "new_worker_checks": 0, "spot_check_fraction": 0.0}}


@pytest.mark.parametrize("path", ["completes_stale", "evicted_from_buffer"])
def test_a_group_dropped_as_stale_forgets_its_content(
    path: str, make_state: MakeState, make_rollout: Any, answer: Any
) -> None:
    """orchestrator/integrity.py: the content of a lease closed without training may honestly
    come again. Both stale paths (a group completing after its first sample went stale, and a
    group evicted from the buffer as the trainer moves on) once skipped `forget_lease`, so the
    same answer sampled again for the prompt's next lease was refused as a replay, a strike."""
    state = make_state(max_staleness=1, trainer={"groups_per_step": 1}, task={"num_prompts": 1}, orchestrator=KEEP_CONTENT)
    state.announce(0)
    (lease,) = state.grant_leases(HOLDER, 1)
    first = make_rollout(lease, answer(state, lease), policy_version=0)
    if path == "completes_stale":
        assert state.ingest([first], HOLDER).accepted == 1
        state.announce(2)  # the trainer holds version 2: the version-0 sample is stale now
        rest = [make_rollout(lease, answer(state, lease), policy_version=2) for _ in range(GROUP - 1)]
        assert state.ingest(rest, HOLDER).accepted == GROUP - 1  # each fresh; the group is not
    else:
        group = [first] + [make_rollout(lease, answer(state, lease), policy_version=0) for _ in range(GROUP - 1)]
        assert state.ingest(group, HOLDER).accepted == GROUP
        assert len(state.ready) == 1
        state.announce(2)
    assert state.dropped == {"stale_in_buffer": GROUP} and state.stale_dropped == GROUP
    assert not state.ready and lease.lease_id not in state.leases

    (again,) = state.grant_leases(HOLDER, 1)
    assert again.prompt_id == lease.prompt_id  # a pool of one prompt
    resampled = first.model_copy(update={"rollout_id": "resampled", "lease_id": again.lease_id, "policy_version": 2})
    result = state.ingest([resampled], HOLDER)
    assert (result.accepted, result.rejected) == (1, [])
    assert state.integrity.workers["alice"].strikes == 0


def test_without_a_journal_the_state_holds_a_null_one(make_state: MakeState, complete_group: Any) -> None:
    """Journaling off: the same code path, recording nothing; the status says so."""
    state = make_state()
    assert state.journal.durable is False and state.status().journal is False
    state.announce(0)
    for lease in state.grant_leases(HOLDER, 2):
        complete_group(state, lease)
    assert state.take_batch(0) is not None
    asyncio.run(state.journal.commit())  # awaitable, answers at once
    assert state.journal.failed is None


# -- batches ------------------------------------------------------------------------------


def test_take_batch_never_serves_a_group_twice(make_state: MakeState, complete_group: Any) -> None:
    state = make_state(max_staleness=1)
    state.announce(0)
    leases = state.grant_leases(HOLDER, 100)
    assert len(leases) == 4
    posted = set()
    for i, lease in enumerate(leases):
        # Each group's logprobs tag its samples, so served samples can be traced to their group.
        complete_group(state, lease, logprob=-(i + 1) / 10)
        posted.add(-(i + 1) / 10)

    first, second = state.take_batch(0), state.take_batch(0)
    assert first is not None and second is not None
    assert state.take_batch(0) is None
    tags_first = {s.logprobs[0] for s in first.samples}
    tags_second = {s.logprobs[0] for s in second.samples}
    assert len(tags_first) == len(tags_second) == 2
    assert tags_first.isdisjoint(tags_second)
    assert tags_first | tags_second == posted
    assert len(first.samples) == len(second.samples) == 2 * GROUP
    assert state.groups_served == 4


def test_take_batch_waits_for_a_full_batch(make_state: MakeState, complete_group: Any) -> None:
    state = make_state()
    state.announce(0)
    first, second = state.grant_leases(HOLDER, 2)
    complete_group(state, first)
    assert state.take_batch(0) is None
    assert state.status().groups_ready == 1  # not consumed by the failed attempt
    complete_group(state, second)
    batch = state.take_batch(0)
    assert batch is not None and len(batch.samples) == 2 * GROUP


def test_staleness_histogram_counts_samples_per_staleness(
    make_state: MakeState, complete_group: Any
) -> None:
    state = make_state(max_staleness=1)
    state.announce(0)
    old, new = state.grant_leases(HOLDER, 2)
    complete_group(state, old, policy_version=0)
    state.announce(1)
    complete_group(state, new, policy_version=1)

    batch = state.take_batch(1)
    assert batch is not None
    assert batch.trainer_version == 1
    assert batch.staleness_histogram == {"0": GROUP, "1": GROUP}
    assert sorted(s.policy_version for s in batch.samples) == [0] * GROUP + [1] * GROUP
    assert batch.stale_dropped == 0


def test_status_counters(make_state: MakeState, complete_group: Any, clock: Any) -> None:
    state = make_state()
    state.announce(0)
    leases = state.grant_leases(HOLDER, 3)
    complete_group(state, leases[0])
    complete_group(state, leases[1])
    clock.advance(3.0)
    status = state.status()
    assert status.policy_version == 0
    assert status.rollouts_accepted == 2 * GROUP
    assert status.groups_ready == 2
    assert status.leases_active == 1
    assert status.uptime_s == pytest.approx(3.0)
    assert status.reward_mean_recent is None  # nothing served yet
    state.take_batch(0)
    after = state.status()
    assert after.groups_served == 2 and after.groups_ready == 0
    assert after.reward_mean_recent == pytest.approx(1.0)
