"""DAPO's dynamic sampling on the orchestrator's side (`[orchestrator.dynamic_sampling]`): each step
consumes `ceil(oversample * groups_per_step)` complete groups, trains those with a reward signal
(topped up when too few have one), drops the rest as `zero_signal` or `surplus`; the lease budget
grows by the same factor; a deterministic run skips the same places in every replay.

BASE_CONFIG (conftest): group_size 3, groups_per_step 2, max_staleness 1; the sorting task.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from decentrl.api.wire import BranchParent, Lease, RolloutNode, ScorePost, ScoreResult
from decentrl.config import ConfigError
from decentrl.rl.advantages import tree_advantages
from decentrl.rl.determinism import required_version
from orchestrator.batches import pick_signal
from orchestrator.buffer import Group
from orchestrator.metrics import Metrics
from orchestrator.state import RunState

HOLDER = "alice/w0"
DYNAMIC = {"orchestrator": {"dynamic_sampling": {"enabled": True, "oversample": 2.0}}}


@pytest.fixture
def make_state(run_state: Callable[..., RunState]) -> Callable[..., RunState]:
    def make(journal: str | None = None, **overrides: Any) -> RunState:
        return run_state(journal, **{**DYNAMIC, **overrides})

    return make


@pytest.fixture
def post(make_rollout: Any, sorted_answer: Callable[[str], str]) -> Callable[..., None]:
    """Post `lease`'s whole group: all right (no signal) or, with `signal`, one wrong answer."""

    def send(state: RunState, lease: Lease, *, signal: bool) -> None:
        right = sorted_answer(state.task.prompt(lease.prompt_id).text)
        answers = [right] * lease.group_size
        if signal:
            answers[0] = "x"
        version = lease.policy_version or 0
        rollouts = [
            make_rollout(lease, answer, policy_version=version, sample_index=j if lease.index is not None else None)
            for j, answer in enumerate(answers)
        ]
        assert state.ingest(rollouts, HOLDER).accepted == lease.group_size

    return send


def group(name: str, rewards: list[float], make_rollout: Any) -> Group:
    lease = Lease(lease_id=name, prompt_id=0, prompt_token_ids=[1, 2], group_size=len(rewards), deadline=0.0)
    rollouts = [make_rollout(lease, [4, 5]) for _ in rewards]
    return Group.of(name, 0, rollouts, rewards)


def test_pick_signal_trains_the_first_groups_with_a_signal_in_order_and_names_what_it_drops(make_rollout: Any) -> None:
    flat, mixed, flat2, mixed2, mixed3 = (
        group("flat", [1.0, 1.0], make_rollout), group("mixed", [0.0, 1.0], make_rollout),
        group("flat2", [0.0, 0.0], make_rollout), group("mixed2", [0.5, 0.0], make_rollout),
        group("mixed3", [0.2, 0.1], make_rollout),
    )
    train, dropped = pick_signal([flat, mixed, flat2, mixed2, mixed3], 2)
    assert [g.lease_id for g in train] == ["mixed", "mixed2"]
    assert [(g.lease_id, why) for g, why in dropped] == [("flat", "zero_signal"), ("flat2", "zero_signal"), ("mixed3", "surplus")]
    # Too few with a signal: topped up in window order with those without one; a step trains `wanted`.
    train, dropped = pick_signal([flat, mixed, flat2], 2)
    assert [g.lease_id for g in train] == ["flat", "mixed"] and [(g.lease_id, why) for g, why in dropped] == [("flat2", "zero_signal")]
    # Without oversampling the window is the batch, signal or not.
    assert pick_signal([flat, flat2], 2) == ([flat, flat2], [])
    # Process rewards: equal outcomes, different step scores, carry a signal.
    flat.step_ends, flat.step_scores = [[1], [1]], [[0.0], [1.0]]
    assert [g.lease_id for g in pick_signal([flat2, flat], 1)[0]] == ["flat"]
    # On-policy distillation: the teacher's grades are a signal of their own.
    flat2.teacher_logprobs = [[-1.0, -2.0], [-0.5, -0.1]]
    assert [g.lease_id for g in pick_signal([flat2, flat], 1)[0]] == ["flat2"]


def test_a_tree_has_a_signal_only_where_a_node_s_rewards_differ(make_rollout: Any) -> None:
    """A tree unit's advantages are per node (its roots against their mean, each pivot's branches
    against theirs: decentrl/rl/advantages.py `tree_advantages`): roots that agree and branches
    that agree among themselves give every sample advantage 0, however the nodes differ."""
    lease = Lease(lease_id="tree", prompt_id=0, prompt_token_ids=[1, 2], group_size=2, deadline=0.0)
    roots = [make_rollout(lease, [4, 5, 6]) for _ in range(2)]
    branch = RolloutNode(node_id="b0", parent=BranchParent(rollout_id=roots[0].rollout_id, at=1))
    branches = [make_rollout(lease, [5, 6], node=branch) for _ in range(2)]
    rollouts = roots + branches

    def tree(rewards: list[float]) -> Group:
        return Group.of("tree", 0, rollouts, rewards)

    assert tree_advantages([0.0, 0.0, 1.0, 1.0], [None, None, ("r", 1), ("r", 1)], 1.0) == [0.0] * 4
    flat_nodes, branches_differ, roots_differ = tree([0.0, 0.0, 1.0, 1.0]), tree([0.0, 0.0, 1.0, 0.0]), tree([1.0, 0.0, 1.0, 1.0])
    train, dropped = pick_signal([flat_nodes, branches_differ, roots_differ], 2)
    assert train == [branches_differ, roots_differ] and dropped == [(flat_nodes, "zero_signal")]


def test_a_step_trains_the_groups_with_a_signal_and_drops_the_others_counted(make_state: Any, post: Any) -> None:
    state = make_state()
    assert state.config.places_per_step == 4
    # The budget is raised by the oversampling: (0 + 1 + 1) * 4 places, not * 2.
    leases = state.grant_leases(HOLDER, 16)
    assert len(leases) == 8
    for lease, signal in zip(leases[:4], [False, True, False, True], strict=True):
        post(state, lease, signal=signal)
    batch = state.take_batch(0)
    assert batch is not None
    assert {s.group_id for s in batch.samples} == {leases[1].lease_id, leases[3].lease_id}
    assert state.groups_served == 2 and state.counters.groups_skipped == 2
    assert state.dropped["zero_signal"] == 2 * 3
    skipped = state.lease_state(leases[0].lease_id, HOLDER)
    assert skipped.state == "skipped"
    assert state.status().dropped == {"zero_signal": 6}


def test_a_step_waits_for_all_the_groups_it_consumes(make_state: Any, post: Any) -> None:
    state = make_state()
    leases = state.grant_leases(HOLDER, 8)
    for lease in leases[:3]:
        post(state, lease, signal=True)
    assert state.take_batch(0) is None  # 3 of the 4 groups the step consumes
    post(state, leases[3], signal=True)
    batch = state.take_batch(0)
    assert batch is not None and len({s.group_id for s in batch.samples}) == 2
    assert state.dropped["surplus"] == 2 * 3


def test_off_by_default_a_step_takes_groups_per_step_groups_signal_or_not(make_state: Any, post: Any) -> None:
    state = make_state(orchestrator={"dynamic_sampling": {"enabled": False}})
    assert state.config.places_per_step == 2
    leases = state.grant_leases(HOLDER, 16)
    assert len(leases) == 4
    for lease in leases[:2]:
        post(state, lease, signal=False)
    assert state.take_batch(0) is not None and not state.dropped and state.counters.groups_skipped == 0


def test_a_deterministic_run_skips_the_same_places_in_every_replay_and_after_a_restart(
    make_state: Any, post: Any, tmp_path: Path
) -> None:
    def run(journal: str) -> tuple[list[int], list[str]]:
        state = make_state(journal=journal, deterministic=True)
        leases = state.grant_leases(HOLDER, 8)
        # Places are pinned by the places a step consumes (4), not groups_per_step (2).
        assert [lease.policy_version for lease in leases] == [
            required_version(lease.index, groups_per_step=4, max_staleness=1) for lease in leases
        ]
        for lease in reversed(leases[:4]):  # completion order does not matter
            post(state, lease, signal=lease.index in (0, 2))
        batch = state.take_batch(0)
        assert batch is not None
        state.journal.flush()
        state.journal.close()
        restarted = make_state(journal=journal, deterministic=True)
        assert restarted.counters.groups_skipped == 2 and restarted.counters.groups_consumed == 4
        trained = sorted(next(lease.index for lease in leases if lease.lease_id == s.group_id) for s in batch.samples)
        return sorted(set(trained)), sorted(restarted.dropped)

    first, second = run(str(tmp_path / "a.sqlite")), run(str(tmp_path / "b.sqlite"))
    assert first == second == ([0, 2], ["zero_signal"])


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"orchestrator": {"dynamic_sampling": {"enabled": True, "oversample": 0.5}}}, "oversample"),
        ({"orchestrator": {"dynamic_sampling": {"enabled": True, "oversample": 9}}}, "oversample"),
        ({"orchestrator": {"dynamic_sampling": {"enabled": "yes"}}}, "enabled"),
        ({"orchestrator": {"dynamic_sampling": {"oversampel": 2}}}, "oversampel"),
    ],
)
def test_bad_dynamic_sampling_settings_are_named(make_config: Any, overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        make_config(**overrides)


def test_a_buffer_bound_below_the_groups_a_step_consumes_is_refused(make_state: Any) -> None:
    with pytest.raises(ValueError, match="max_buffer_groups .3. must be at least the groups a step consumes .4"):
        make_state(orchestrator={"max_buffer_groups": 3, **DYNAMIC["orchestrator"]})


def test_with_model_scores_the_signal_is_judged_on_the_scores_and_reported(make_state: Any, post: Any) -> None:
    state = make_state(orchestrator={**DYNAMIC["orchestrator"], "rewards": {"type": "model"}})
    leases = state.grant_leases(HOLDER, 4)
    for lease in leases:
        post(state, lease, signal=False)  # the verifier would see no signal; the scorers decide
    entry = state.lease_scores("judge/s0", 64)
    assert entry is not None and len(entry.rollout_ids) == 12
    by_group: dict[str, list[str]] = {lease.lease_id: [] for lease in leases}
    for item in state.score_queue.items(entry):
        by_group[state.score_queue.samples[item.rollout_id].group_id].append(item.rollout_id)
    scores = []
    for lease, varied in zip(leases, [True, False, True, False], strict=True):
        scores += [ScoreResult(rollout_id=rid, score=0.1 * i if varied else 0.5) for i, rid in enumerate(by_group[lease.lease_id])]
    assert state.take_batch(0) is None  # held back until scored
    state.post_scores("judge/s0", ScorePost(lease_id=entry.lease_id, scorer_id="s0", scores=scores))
    batch = state.take_batch(0)
    assert batch is not None and {s.group_id for s in batch.samples} == {leases[0].lease_id, leases[2].lease_id}
    assert state.status().groups_skipped == 2 and state.dropped == {"zero_signal": 6}
    metrics = Metrics(state).render().decode()
    assert "decentrl_groups_skipped_total 2.0" in metrics


def test_a_deterministic_run_refuses_to_restart_with_another_oversample(make_state: Any, tmp_path: Path) -> None:
    """The places a step consumes pin each place's version: changing them between starts would
    sample places under other versions than the first start did (a free-running run may)."""
    journal = str(tmp_path / "j.sqlite")
    state = make_state(journal=journal, deterministic=True)
    state.grant_leases(HOLDER, 2)
    state.journal.flush()
    state.journal.close()
    other = {"orchestrator": {"dynamic_sampling": {"enabled": True, "oversample": 3.0}}}
    with pytest.raises(ValueError, match="consumed 4 places a step, the config says 6"):
        make_state(journal=journal, deterministic=True, **other)
    make_state(journal=journal, deterministic=True).journal.close()  # the same setting starts
    free = str(tmp_path / "free.sqlite")
    state = make_state(journal=free)
    state.grant_leases(HOLDER, 2)
    state.journal.flush()
    state.journal.close()
    make_state(journal=free, **other).journal.close()
