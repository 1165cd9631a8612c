"""Deterministic runs on the orchestrator's side (docs/reproducibility.md): leases pinned to the
version their place in the consumption order fixes, rollouts under another version refused,
batches in place order whatever order groups complete in, a lost place leased again as it was."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from transformers import PreTrainedTokenizerBase

from decentrl.api.wire import Lease
from decentrl.rl.determinism import required_version, sample_seed
from decentrl.tasks import build_task
from orchestrator.state import RunState

HOLDER = "alice/w0"


@pytest.fixture
def state(make_config: Any, tokenizer: PreTrainedTokenizerBase, clock: Any) -> RunState:
    # groups_per_step 2, max_staleness 1: places 0-3 are sampled under version 0, 4-5 under 1, ...
    config = make_config(deterministic=True)
    run = RunState(config=config, task=build_task(config.task), tokenizer=tokenizer, clock=clock)
    run.announce(0)
    return run


@pytest.fixture
def post(make_rollout: Any, sorted_answer: Callable[[str], str]) -> Callable[..., Any]:
    def send(state: RunState, lease: Lease, version: int | None = None) -> Any:
        answer = sorted_answer(state.task.prompt(lease.prompt_id).text)
        used = lease.policy_version if version is None else version
        rollouts = [make_rollout(lease, answer, policy_version=used, sample_index=j) for j in range(lease.group_size)]
        return state.ingest(rollouts, HOLDER)

    return send


def test_leases_name_their_place_and_the_version_it_requires(state: RunState) -> None:
    leases = state.grant_leases(HOLDER, 8)
    assert len(leases) == 4  # the budget: (0 + 1 + 1) * 2 places under version 0
    assert [lease.index for lease in leases] == [0, 1, 2, 3]
    assert [lease.policy_version for lease in leases] == [0, 0, 0, 0]
    queue = state.lease_book.prompts
    assert [lease.prompt_id for lease in leases] == [queue.order[i] for i in range(4)]
    assert required_version(4, groups_per_step=2, max_staleness=1) == 1
    assert required_version(9, groups_per_step=2, max_staleness=0) == 4


def test_a_rollout_under_another_version_is_rejected_by_name(state: RunState, post: Any) -> None:
    lease = state.grant_leases(HOLDER, 1)[0]
    state.announce(1)
    result = post(state, lease, version=1)  # fresh, published, but not the version the lease names
    assert result.accepted == 0
    assert {r.reason for r in result.rejected} == {"wrong_version"}
    assert post(state, lease).accepted == lease.group_size  # the lease stays open for the right one


@pytest.mark.parametrize("index", [None, 3, "twice"])
def test_each_sample_names_its_own_place_in_the_group(state: RunState, make_rollout: Any, index: Any) -> None:
    """The verifier re-draws a sample's tokens from the seed of its index: a deterministic run's
    group holds indices 0..group_size-1, each once (group_size 3 here)."""
    lease = state.grant_leases(HOLDER, 1)[0]
    first = make_rollout(lease, "1234", sample_index=0)
    assert state.ingest([first], HOLDER).accepted == 1
    bad = make_rollout(lease, "1234", sample_index=0 if index == "twice" else index)
    assert [r.reason for r in state.ingest([bad], HOLDER).rejected] == ["bad_sample_index"]
    assert state.ingest([make_rollout(lease, "1234", sample_index=j) for j in (1, 2)], HOLDER).accepted == 2


def test_groups_enter_batches_in_place_order_whatever_order_they_complete(state: RunState, post: Any) -> None:
    leases = state.grant_leases(HOLDER, 4)
    post(state, leases[1])
    post(state, leases[3])
    post(state, leases[2])
    assert state.take_batch(0) is None  # place 0 is missing: no batch may skip it
    post(state, leases[0])
    first = state.take_batch(0)
    assert first is not None
    assert [s.group_id for s in first.samples[:: leases[0].group_size]] == [leases[0].lease_id, leases[1].lease_id]
    second = state.take_batch(0)
    assert second is not None
    assert [s.group_id for s in second.samples[:: leases[0].group_size]] == [leases[2].lease_id, leases[3].lease_id]


def test_a_lost_place_is_leased_again_with_its_prompt_and_version(state: RunState, clock: Any) -> None:
    first = state.grant_leases(HOLDER, 4)
    state.release_lease(first[2].lease_id, HOLDER)
    clock.advance(state.config.orchestrator.lease_timeout_s + 1)  # the others expire
    again = state.grant_leases(HOLDER, 4)
    assert [(l.index, l.prompt_id, l.policy_version) for l in again] == [
        (l.index, l.prompt_id, l.policy_version) for l in first
    ]


def test_sample_seeds_are_stable_and_distinct() -> None:
    seeds = {sample_seed(7, prompt, j, version) for prompt in range(4) for j in range(4) for version in range(4)}
    assert len(seeds) == 64
    assert all(0 <= seed < 2**63 for seed in seeds)
    assert sample_seed(7, 1, 2, 3) == sample_seed(7, 1, 2, 3) != sample_seed(8, 1, 2, 3)


def test_without_determinism_the_prompt_order_is_still_the_seeds(
    make_config: Any, tokenizer: PreTrainedTokenizerBase, clock: Any
) -> None:
    """Issue 17 item 4: deterministic = false still seeds the prompt order (task.seed)."""

    def first_prompts(seed: int) -> list[int]:
        config = make_config(deterministic=False, max_staleness=3, task={"seed": seed})
        run = RunState(config=config, task=build_task(config.task), tokenizer=tokenizer, clock=clock)
        run.announce(0)
        leases = run.grant_leases(HOLDER, 8)
        assert len(leases) == 8 and all(lease.index is None and lease.policy_version is None for lease in leases)
        return [lease.prompt_id for lease in leases]

    assert first_prompts(5) == first_prompts(5)
    assert first_prompts(5) != first_prompts(6)
