"""Tree units (issue 47, docs/architecture.md "The unit of work, widened"): the wire's unit and
node fields with their bad inputs, and the ingest rules of a tree's branches (orchestrator/checks.py
`node_problem`), its completion at `unit_size`, and a branch sample through the journal.

BASE_CONFIG (conftest): group_size 3; the tree here has k = 2 continuations of 1 pivot.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from decentrl.api.encoding import unpack_msgpack
from decentrl.api.wire import Lease, Rollout, RolloutNode, TreeUnit, problems
from decentrl.config import ConfigError, load_config
from orchestrator.leases import unit_size
from orchestrator.state import RunState

HOLDER = "alice/w0"
TREE = {"tree": {"k": 2, "pivots": 1}}


@pytest.fixture
def tree_state(run_state: Callable[..., RunState]) -> Callable[..., RunState]:
    def make(journal: str | None = None, **tree: Any) -> RunState:
        return run_state(journal, orchestrator={"tree": {"k": 2, "pivots": 1, **tree}}, trainer={"groups_per_step": 1})

    return make


def _root(make_rollout: Any, lease: Lease, ids: list[int], ends: list[int] | None, **fields: Any) -> Rollout:
    return make_rollout(lease, ids, step_ends=ends, **fields)


def _branch(
    make_rollout: Any, lease: Lease, parent: Rollout, at: int, ids: list[int], node_id: str = "b0", **fields: Any
) -> Rollout:
    prompt = [*parent.prompt_token_ids, *parent.completion_token_ids[:at]]
    node = {"node_id": node_id, "parent": {"rollout_id": parent.rollout_id, "at": at}}
    return make_rollout(lease, ids, prompt_token_ids=prompt, node=node, **fields)


def _reasons(state: RunState, *rollouts: Rollout) -> list[str]:
    return [rejection.reason for rejection in state.ingest(list(rollouts), HOLDER).rejected]


@pytest.fixture
def ids(completion_ids: Callable[[str], list[int]]) -> list[int]:
    return completion_ids("0123")  # a completion of a few tokens, eos last


# -- the wire -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("node", "says"),
    [
        ({"node_id": "a/b"}, "node_id"),
        ({"node_id": ""}, "node_id"),
        ({"node_id": "x" * 65}, "node_id"),
        ({"node_id": "b", "parent": {"rollout_id": "r"}}, "rollout_id and at"),
        ({"node_id": "b", "parent": {"rollout_id": "r", "at": 0}}, "greater than or equal to 1"),
        ({"node_id": "b", "parent": {"rollout_id": "r", "at": True}}, "valid integer"),
        ({"node_id": "b", "parent": {"rollout_id": "r", "at": 3, "derived": 0}}, "Extra inputs"),
        ({"node_id": "b", "parent": {"rollout_id": "", "at": 3}}, "at least 1"),
        ({"node_id": "b", "parent": {"rollout_id": "r", "derived": -1}}, "greater than or equal to 0"),
        ({"node_id": "b", "parent": 7}, "rollout_id and at"),
        ({"node_id": "b", "role": "Solver!"}, "role"),
        ({"node_id": "b", "policy": "x" * 40}, "policy"),
        ({"node_id": "b", "extra": 1}, "Extra inputs"),
    ],
)
def test_a_bad_node_is_refused_saying_what_to_fix(node: dict[str, Any], says: str) -> None:
    with pytest.raises(ValidationError) as caught:
        RolloutNode.model_validate(node)
    assert says in problems(caught.value)


def test_a_node_takes_a_branch_or_a_derived_parent() -> None:
    branch = RolloutNode.model_validate({"node_id": "b0", "parent": {"rollout_id": "r", "at": 4}})
    derived = RolloutNode.model_validate({"node_id": "d0", "parent": {"rollout_id": "r", "derived": 1}, "role": "solver"})
    assert (branch.parent.at, derived.parent.derived, derived.role) == (4, 1, "solver")  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("unit", "says"),
    [
        ({"kind": "forest"}, "tag"),
        ({"kind": "tree", "k": 0, "pivots": 1, "boundary": {"type": "marker"}}, "greater than or equal to 1"),
        ({"kind": "tree", "k": 65, "pivots": 1, "boundary": {"type": "marker"}}, "less than or equal to 64"),
        ({"kind": "tree", "k": 2, "pivots": -1, "boundary": {"type": "marker"}}, "greater than or equal to 0"),
        ({"kind": "tree", "k": 2, "pivots": 1, "boundary": {"type": "comma"}}, "marker"),
        ({"kind": "tree", "k": 2, "pivots": 1, "boundary": {"type": "marker", "marker": ""}}, "at least 1"),
        ({"kind": "tree", "k": 2, "pivots": 1, "boundary": {"type": "tokens", "tokens": 0}}, "greater than or equal to 1"),
        ({"kind": "tree", "k": 2, "pivots": 1, "boundary": {"type": "marker"}, "verdict_lag_tokens": -1}, "greater than or equal to 0"),
        ({"kind": "tree", "k": 2, "pivots": 1, "boundary": {"type": "marker"}, "verdict_lag_tokens": True}, "valid integer"),
        ({"kind": "tree", "k": 2, "pivots": 1, "boundary": {"type": "marker"}, "verdict_lag_tokens": 1.5}, "valid integer"),
        ({"kind": "tree", "k": 2, "pivots": 1, "boundary": {"type": "marker"}, "branch": "sometimes"}, "'always' or 'all_failed'"),
        ({"kind": "tree", "k": 2, "pivots": 1, "boundary": {"type": "marker"}, "branch": 1}, "'always' or 'all_failed'"),
        ({"kind": "roles", "roles": ["proposer", "solver"], "sizes": [1]}, "one size a role"),
        ({"kind": "roles", "roles": ["solver", "solver"], "sizes": [1, 1]}, "distinct"),
        ({"kind": "roles", "roles": ["proposer"], "sizes": [2], "min_fill": 3}, "min_fill"),
        ({"kind": "roles", "roles": [], "sizes": []}, "at least 1"),
    ],
)
def test_a_bad_unit_is_refused_saying_what_to_fix(unit: dict[str, Any], says: str) -> None:
    lease = {"lease_id": "l", "prompt_id": 0, "prompt_token_ids": [1], "group_size": 2, "deadline": 0.0, "unit": unit}
    with pytest.raises(ValidationError) as caught:
        Lease.model_validate(lease)
    assert says in problems(caught.value)


@pytest.mark.parametrize(
    ("ends", "says"), [([0, 2], "step_ends"), ([2, 2], "step_ends"), ([3, 2], "step_ends"), ([1, 99], "step_ends")]
)
def test_bad_step_ends_are_refused(make_rollout: Any, ends: list[int], says: str) -> None:
    lease = Lease(lease_id="l", prompt_id=0, prompt_token_ids=[1], group_size=2, deadline=0.0)
    with pytest.raises(ValidationError) as caught:
        make_rollout(lease, [5, 6, 7], step_ends=ends)
    assert says in problems(caught.value)


def test_a_tree_lease_owes_its_root_and_every_branch(tree_state: Callable[..., RunState]) -> None:
    state = tree_state(k=3, pivots=2)
    (lease,) = state.grant_leases(HOLDER, 1)
    assert isinstance(lease.unit, TreeUnit) and (lease.unit.k, lease.unit.pivots) == (3, 2)
    assert unit_size(lease) == 3 + 2 * 3
    assert Lease.model_validate_json(lease.model_dump_json()) == lease  # what a worker reads back


def test_a_tree_lease_carries_its_verdict_lag(tree_state: Callable[..., RunState]) -> None:
    (lease,) = tree_state(stop_below=0.5, verdict_lag_tokens=3).grant_leases(HOLDER, 1)
    assert isinstance(lease.unit, TreeUnit) and lease.unit.verdict_lag_tokens == 3
    (plain,) = tree_state().grant_leases(HOLDER, 1)
    assert isinstance(plain.unit, TreeUnit) and plain.unit.verdict_lag_tokens is None  # unset: whenever a verdict arrives


@pytest.mark.parametrize(
    ("value", "says"),
    [("-1", "greater than or equal to 0"), ("2.5", "valid integer"), ("true", "valid integer"), ('"3"', "valid integer"),
     ("5000", "less than or equal to 4096")],
    ids=["negative", "not-an-integer", "bool", "string", "too-large"],
)
def test_a_bad_verdict_lag_is_a_config_error_naming_the_field(tmp_path: Path, value: str, says: str) -> None:
    path = tmp_path / "run.toml"
    path.write_text(f"[orchestrator.tree]\nk = 2\nstop_below = 0.5\nverdict_lag_tokens = {value}\n")
    with pytest.raises(ConfigError) as caught:
        load_config(str(path))
    assert "orchestrator.tree.verdict_lag_tokens" in str(caught.value) and says in str(caught.value)


@pytest.mark.parametrize("value", ['"sometimes"', "true", '""'])
def test_a_bad_branch_rule_is_a_config_error_naming_the_field_and_its_choices(tmp_path: Path, value: str) -> None:
    path = tmp_path / "run.toml"
    path.write_text(f"[orchestrator.tree]\nk = 2\nbranch = {value}\n")
    with pytest.raises(ConfigError) as caught:
        load_config(str(path))
    assert "orchestrator.tree.branch" in str(caught.value) and "'always' or 'all_failed'" in str(caught.value)


def test_a_deterministic_tree_run_is_refused(make_config: Any) -> None:
    with pytest.raises((ValidationError, ConfigError), match="does not support deterministic"):
        make_config(deterministic=True, orchestrator=TREE)


def test_a_tree_run_on_the_openai_backend_is_refused(make_config: Any) -> None:
    # Tree leases are decoded step by step: hf and vllm can, an OpenAI-compatible server cannot.
    openai = {"backend": "openai", "openai": {"url": "http://127.0.0.1:8000", "model": "m"}}
    with pytest.raises((ValidationError, ConfigError), match="worker.backend = 'openai' cannot"):
        make_config(orchestrator=TREE, worker=openai)
    for backend in ("hf", "vllm"):
        assert make_config(orchestrator=TREE, worker={"backend": backend}).worker.backend == backend


# -- ingest -------------------------------------------------------------------------------


def test_a_tree_completes_with_its_branches_and_trains_their_prefix_as_prompt(
    tree_state: Callable[..., RunState], make_rollout: Any, ids: list[int]
) -> None:
    state = tree_state()
    (lease,) = state.grant_leases(HOLDER, 1)
    roots = [_root(make_rollout, lease, ids, [2, len(ids)]) for _ in range(3)]
    assert state.ingest(roots, HOLDER).accepted == 3
    assert lease.lease_id in state.leases  # 3 of 5: the unit waits for its branch node
    branches = [_branch(make_rollout, lease, roots[0], 2, ids[2:]) for _ in range(2)]
    assert state.ingest(branches, HOLDER).accepted == 2
    assert lease.lease_id not in state.leases and len(state.ready) == 1
    batch = state.take_batch(0)
    assert batch is not None and len(batch.samples) == 5
    branch_samples = [s for s in batch.samples if s.rollout_id in {b.rollout_id for b in branches}]
    assert [len(s.prompt_token_ids) for s in branch_samples] == [len(lease.prompt_token_ids) + 2] * 2
    assert all(s.completion_token_ids == ids[2:] for s in branch_samples)
    packed = unpack_msgpack(state.batch_msgpack(batch))  # the trainer's msgpack: a branch packs its own prompt
    assert [list(s["prompt_token_ids"]) for s in packed["samples"]] == [list(s.prompt_token_ids) for s in batch.samples]


def test_a_root_sample_may_name_itself_root_and_no_other_node_without_a_parent(
    tree_state: Callable[..., RunState], make_rollout: Any, ids: list[int]
) -> None:
    state = tree_state()
    (lease,) = state.grant_leases(HOLDER, 1)
    named = _root(make_rollout, lease, ids, [2], node={"node_id": "root"})
    other = _root(make_rollout, lease, ids, [2], node={"node_id": "trunk"})
    assert _reasons(state, named, other) == ["node_mismatch"]


def test_branch_rules(tree_state: Callable[..., RunState], make_rollout: Any, ids: list[int]) -> None:
    state = tree_state(k=2, pivots=1)
    (lease,) = state.grant_leases(HOLDER, 1)
    root, unbounded = _root(make_rollout, lease, ids, [2, len(ids)]), _root(make_rollout, lease, ids, None)
    assert state.ingest([root, unbounded], HOLDER).accepted == 2
    stranger = make_rollout(lease, ids, rollout_id="not-posted")
    assert _reasons(state, _branch(make_rollout, lease, stranger, 2, ids[2:])) == ["unknown_parent"]
    assert _reasons(state, _branch(make_rollout, lease, root, 1, ids[1:])) == ["bad_pivot"]  # not a boundary it named
    assert _reasons(state, _branch(make_rollout, lease, root, len(ids), ids)) == ["bad_pivot"]  # its end: nothing to continue
    assert _reasons(state, _branch(make_rollout, lease, unbounded, 2, ids[2:])) == ["bad_pivot"]  # named none
    wrong_prefix = _branch(make_rollout, lease, root, 2, ids[2:])
    wrong_prefix = wrong_prefix.model_copy(update={"prompt_token_ids": [*lease.prompt_token_ids, ids[1], ids[0]]})
    assert _reasons(state, wrong_prefix) == ["prompt_mismatch"]
    derived = make_rollout(lease, ids, node={"node_id": "d", "parent": {"rollout_id": root.rollout_id, "derived": 0}})
    assert _reasons(state, derived) == ["node_mismatch"]  # a worker never supplies a derived prompt
    role = _branch(make_rollout, lease, root, 2, ids[2:])
    node = role.node.model_copy(update={"role": "solver"})  # type: ignore[union-attr]
    assert _reasons(state, role.model_copy(update={"node": node})) == ["node_mismatch"]
    first = _branch(make_rollout, lease, root, 2, ids[2:], node_id="b0")
    assert _reasons(state, first) == []
    assert _reasons(state, _branch(make_rollout, lease, root, 2, ids[2:], node_id="b1")) == ["node_mismatch"]  # one pivot, one node
    brother = _root(make_rollout, lease, ids, [2, len(ids)])
    assert _reasons(state, brother) == []
    assert _reasons(state, _branch(make_rollout, lease, brother, 2, ids[2:], node_id="b0")) == ["node_mismatch"]  # one node, one parent
    assert _reasons(state, _branch(make_rollout, lease, brother, 2, ids[2:], node_id="b1")) == ["too_many_pivots"]
    assert _reasons(state, _root(make_rollout, lease, ids, [2])) == ["node_full"]  # the root holds group_size
    assert _reasons(state, _branch(make_rollout, lease, root, 2, ids[2:], node_id="b0")) == []  # k = 2: complete
    assert lease.lease_id not in state.leases
    assert state.rejected["unknown_parent"] == 1


def test_a_tree_whose_roots_cannot_branch_trains_as_their_group(
    tree_state: Callable[..., RunState], make_rollout: Any, ids: list[int]
) -> None:
    """Roots that name no step boundary before their ends (chains of one step, or none named) leave
    no pivot: the unit completes with its roots, as a group, once they are all in; nothing more is
    taken for it."""
    state = tree_state(k=2, pivots=1)
    (lease,) = state.grant_leases(HOLDER, 1)
    roots = [_root(make_rollout, lease, ids, [len(ids)]), _root(make_rollout, lease, ids, None)]
    assert state.ingest(roots, HOLDER).accepted == 2
    assert lease.lease_id in state.leases  # 2 of its 3 roots: it may still branch from the third
    last = _root(make_rollout, lease, ids, [len(ids)])
    assert _reasons(state, last) == []
    assert lease.lease_id not in state.leases and len(state.ready) == 1
    assert _reasons(state, _branch(make_rollout, lease, roots[0], 2, ids[2:])) == ["group_full"]
    batch = state.take_batch(0)
    assert batch is not None and [s.rollout_id for s in batch.samples] == [r.rollout_id for r in [*roots, last]]


def test_a_tree_holds_as_many_pivots_as_its_roots_name_boundaries_if_fewer(
    tree_state: Callable[..., RunState], make_rollout: Any, ids: list[int]
) -> None:
    """Three pivots asked, one boundary named by the roots: the unit holds one branch node; a second
    pivot is refused as ever (no other boundary), and the unit completes with that node's k."""
    state = tree_state(k=2, pivots=3)
    (lease,) = state.grant_leases(HOLDER, 1)
    assert unit_size(lease) == 3 + 3 * 2  # nothing known of its roots yet
    roots = [_root(make_rollout, lease, ids, [2, len(ids)]), _root(make_rollout, lease, ids, [len(ids)]),
             _root(make_rollout, lease, ids, [len(ids)])]
    assert state.ingest(roots, HOLDER).accepted == 3
    assert unit_size(lease, roots) == 3 + 1 * 2 and lease.lease_id in state.leases  # waits for its one branch node
    assert _reasons(state, _branch(make_rollout, lease, roots[1], 2, ids[2:], node_id="b1")) == ["bad_pivot"]
    assert _reasons(state, _branch(make_rollout, lease, roots[0], 2, ids[2:])) == []
    assert lease.lease_id in state.leases
    assert _reasons(state, _branch(make_rollout, lease, roots[0], 2, ids[2:])) == []
    assert lease.lease_id not in state.leases and len(state.ready) == 1


def test_a_node_in_a_plain_group_is_refused(run_state: Callable[..., RunState], make_rollout: Any, ids: list[int]) -> None:
    state = run_state()
    (lease,) = state.grant_leases(HOLDER, 1)
    assert _reasons(state, make_rollout(lease, ids, node={"node_id": "root"})) == ["node_without_unit"]
    assert _reasons(state, make_rollout(lease, ids, step_ends=[2])) == ["node_without_unit"]
    assert _reasons(state, make_rollout(lease, ids, finish_reason="wrong_step")) == ["bad_finish_reason"]


def test_a_chain_stopped_at_a_wrong_step_ends_with_that_step(
    tree_state: Callable[..., RunState], make_rollout: Any, ids: list[int]
) -> None:
    state = tree_state()
    (lease,) = state.grant_leases(HOLDER, 1)
    cut = ids[:2]
    assert _reasons(state, _root(make_rollout, lease, cut, [1], finish_reason="wrong_step")) == ["bad_finish_reason"]
    # This tree stops no chain early (no stop_below): a wrong_step finish has no verdict to stand on
    # (its verdict is checked in tests/orchestrator/test_orchestrator_steps.py).
    assert _reasons(state, _root(make_rollout, lease, cut, [1, 2], finish_reason="wrong_step")) == ["bad_finish_reason"]


def test_a_branch_sample_survives_a_restart(
    tree_state: Callable[..., RunState], make_rollout: Any, ids: list[int], tmp_path: Path
) -> None:
    journal = str(tmp_path / "journal.sqlite")
    state = tree_state(journal)
    (lease,) = state.grant_leases(HOLDER, 1)
    roots = [_root(make_rollout, lease, ids, [2, len(ids)]) for _ in range(3)]
    branch = _branch(make_rollout, lease, roots[1], 2, ids[2:])
    assert state.ingest([*roots, branch], HOLDER).accepted == 4
    state.journal.flush()
    state.journal.close()
    again = tree_state(journal)
    recovered = again.leases[lease.lease_id]
    assert recovered.lease.unit == lease.unit
    (kept,) = [sample for sample in recovered.samples if sample.rollout_id == branch.rollout_id]
    assert kept.node == branch.node and list(kept.prompt_token_ids) == list(branch.prompt_token_ids)
    assert _reasons(again, _branch(make_rollout, lease, roots[1], 2, ids[2:])) == []  # the rules hold after it
    assert lease.lease_id not in again.leases


def test_a_tree_batch_trains_global_plus_lambda_local_and_its_prefix_as_prompt(make_rollout: Any) -> None:
    from decentrl.config import AdvantageConfig
    from orchestrator.batches import build_batch
    from orchestrator.buffer import Group

    lease = Lease(lease_id="t", prompt_id=0, prompt_token_ids=[1, 5], group_size=3, deadline=0.0)
    roots = [make_rollout(lease, [3, 4, 5, 6], step_ends=[2, 4]) for _ in range(3)]
    branches = [_branch(make_rollout, lease, roots[0], 2, [7, 8]) for _ in range(2)]
    samples = [roots[0], *branches, roots[1], roots[2]]  # arrival order: root, its branches, the rest
    group = Group.of("t", 0, samples, [0.0, 1.0, 0.0, 1.0, 0.0])
    batch = build_batch([group], trainer_version=0, batch_id="x", advantages=AdvantageConfig(local_weight=0.5),
                        rollouts_accepted=5, stale_dropped=0)
    # Global: roots 0, 1, 0 around 1/3; local: branches 1, 0 around 1/2, times lambda = 0.5.
    assert [s.advantage for s in batch.samples] == pytest.approx([-1 / 3, 0.25, -0.25, 2 / 3, -1 / 3])
    assert [list(s.prompt_token_ids) for s in batch.samples[1:3]] == [[1, 5, 3, 4]] * 2
    assert [list(s.completion_token_ids) for s in batch.samples[1:3]] == [[7, 8]] * 2


def test_a_branch_is_rewarded_on_its_whole_answer_its_prefix_then_its_continuation(
    tree_state: Callable[..., RunState], make_rollout: Any, completion_ids: Callable[[str], list[int]]
) -> None:
    """A branch's reward judges the prefix it continues and its continuation together (the task's
    answer), not the continuation alone: a right continuation of a root's right first tokens is
    right, a wrong one wrong. Model scorers are handed the same whole answer."""
    state = tree_state()
    (lease,) = state.grant_leases(HOLDER, 1)
    right = "".join(sorted(state.task.prompt(lease.prompt_id).text.removesuffix("=")))
    wrong = right[:2] + ("9" if right[2] != "9" else "0") + right[3:]
    roots = [_root(make_rollout, lease, completion_ids(wrong), [2, len(wrong) + 1]) for _ in range(3)]
    assert state.ingest(roots, HOLDER).accepted == 3
    branches = [_branch(make_rollout, lease, roots[0], 2, completion_ids(text)[2:], node_id="b0") for text in (right, wrong)]
    assert state.ingest(branches, HOLDER).accepted == 2
    (group,) = state.ready
    partial = state.task.reward(state.task.prompt(lease.prompt_id), wrong)  # sorting's credit for a misplaced digit
    assert partial < 1.0 and group.rewards == [partial] * 3 + [1.0, partial]
    items = state.rewards.items(group.rollouts, None)
    assert [item.completion for item in items[3:]] == [right, wrong]
