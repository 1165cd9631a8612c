"""Units of roles (issue 48, docs/architecture.md "The unit of work, widened"): a proposer's sample,
the solver node the orchestrator derives from it and leases as sub-leases to any worker, rewards
per role, the straggler bound (`min_fill`, `node_closed`), bad inputs, resends and restarts.

The unit here: one proposer sample, 4 solver samples in sub-leases of 2, closing short at 2
solver samples 10 s after the node is made.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from transformers import PreTrainedTokenizerBase

from decentrl.api.wire import DerivedParent, Lease, RolesUnit, RolloutNode
from decentrl.config import ConfigError, parse_config
from orchestrator.lease_table import LeaseClosed
from orchestrator.state import RunState
from tests.conftest import BASE_CONFIG, _merge

ALICE, BOB = "alice/w0", "bob/w0"
ROLES = {"solvers": 4, "sub_lease_size": 2, "min_fill": 2, "close_after_s": 10.0}


def roles_config(**roles: Any) -> dict[str, Any]:
    return {
        "task": {"type": "propose", "min_digits": 2, "max_digits": 5, "num_prompts": 64, "solver_reward": "exact"},
        "orchestrator": {"roles": {**ROLES, **roles}, "advantages": {"type": "roles"}},
        "trainer": {"groups_per_step": 1},
    }


@pytest.fixture
def roles_state(run_state: Callable[..., RunState]) -> Callable[..., RunState]:
    def make(journal: str | None = None, **roles: Any) -> RunState:
        return run_state(journal, **roles_config(**roles))

    return make


def _solve(state: RunState, make_rollout: Any, sub: Lease, holder: str, count: int = 2) -> int:
    """`count` right answers to "9027=" posted on sub-lease `sub`; how many were accepted."""
    return state.ingest([make_rollout(sub, "0279", node=sub.node) for _ in range(count)], holder).accepted


def _propose(state: RunState, make_rollout: Any, text: str = "9027") -> tuple[Lease, Any]:
    [unit] = state.grant_leases(ALICE, 1)
    proposal = make_rollout(unit, text, node=unit.node)
    assert state.ingest([proposal], ALICE).accepted == 1
    return unit, proposal


def test_a_unit_of_roles_trains_together_with_each_sample_its_role(
    roles_state: Callable[..., RunState], make_rollout: Any, tokenizer: PreTrainedTokenizerBase,
) -> None:
    state = roles_state()
    unit, proposal = _propose(state, make_rollout)
    assert isinstance(unit.unit, RolesUnit) and unit.unit.sizes == [1, 4] and unit.group_size == 1
    assert unit.node is not None and unit.node.role == "proposer"
    assert not state.ready, "the proposer's reward waits for its solvers"
    # The solver node: made by the orchestrator, leased as sub-leases to whoever asks, each worker as it frees up.
    mine = state.grant_leases(ALICE, 1)
    theirs = state.grant_leases(BOB, 1)
    for sub in mine + theirs:
        assert sub.unit_id == unit.lease_id and sub.group_size == 2
        assert sub.node == RolloutNode(node_id="solver", parent=DerivedParent(rollout_id=proposal.rollout_id, derived=0), role="solver")
        assert sub.prompt_token_ids == tokenizer("9027=").input_ids, "the task's solver prompt, rendered by the orchestrator"
    assert state.lease_capacity() >= 0 and len(state.leases) == 3, "the unit and its two sub-leases"
    answers = {ALICE: ["0279", "0279"], BOB: ["0279", "7777"]}
    for holder, sub in ((ALICE, mine[0]), (BOB, theirs[0])):
        posted = [make_rollout(sub, text, node=sub.node) for text in answers[holder]]
        assert state.ingest(posted, holder).accepted == 2
    [group] = state.ready
    assert group.lease_id == unit.lease_id and group.size == 5
    assert group.rewards == [0.25, 1.0, 1.0, 1.0, 0.0], "solvers: correctness; proposer: 1 - p (Absolute Zero), p = 3/4"
    assert state.leases == {}, "the unit and its sub-leases are closed"
    batch = state.take_batch(0)
    assert batch is not None and len(batch.samples) == 5
    assert {s.group_id for s in batch.samples} == {unit.lease_id}
    solver_advantages = [s.advantage for s in batch.samples[1:]]
    assert solver_advantages == pytest.approx([0.25, 0.25, 0.25, -0.75]), "a node's own mean as baseline"
    assert batch.samples[0].advantage == pytest.approx(0.25 - 0.05 * 0.25), "SPIRAL's moving average, from 0"
    assert state.kept.baselines == pytest.approx({"proposer": 0.05 * 0.25})


def test_an_invalid_proposal_ends_its_unit_with_the_validity_reward(
    roles_state: Callable[..., RunState], make_rollout: Any,
) -> None:
    state = roles_state()
    unit, _ = _propose(state, make_rollout, "9")  # one digit: fewer than min_digits
    [lease] = state.grant_leases(BOB, 1)  # the next lease request judges the proposal
    assert lease.unit_id is None, "no solver node to lease: a new unit"
    [group] = state.ready
    assert group.lease_id == unit.lease_id and group.rewards == [-1.0] and group.size == 1


def test_bad_samples_of_a_unit_are_refused_with_their_reason(
    roles_state: Callable[..., RunState], make_rollout: Any,
) -> None:
    state = roles_state()
    [unit] = state.grant_leases(ALICE, 1)
    derived = RolloutNode(node_id="solver", parent=DerivedParent(rollout_id="x", derived=0), role="solver")
    cases = {
        "node_mismatch": [
            make_rollout(unit, "12", node=RolloutNode(node_id="root", role="solver")),
            make_rollout(unit, "12", node=RolloutNode(node_id="other", role="proposer")),
            make_rollout(unit, "12", node=RolloutNode(node_id="root", role="proposer", policy="b")),
            make_rollout(unit, "12", node=derived),  # a worker never declares a derived node
        ],
    }
    for reason, rollouts in cases.items():
        answer = state.ingest(rollouts, ALICE)
        assert [r.reason for r in answer.rejected] == [reason] * len(rollouts)
    first = make_rollout(unit, "90", node=unit.node)
    assert state.ingest([first, make_rollout(unit, "91", node=unit.node)], ALICE).rejected[0].reason == "node_full"
    [sub] = state.grant_leases(BOB, 1)
    wrong_node = sub.node.model_copy(update={"node_id": "solver2"})  # type: ignore[union-attr]
    bad = {
        "node_mismatch": make_rollout(sub, "09", node=wrong_node),
        "prompt_mismatch": make_rollout(sub, "09", node=sub.node, prompt_token_ids=unit.prompt_token_ids),
        "not_lease_holder": make_rollout(sub, "09", node=sub.node),
    }
    for reason, rollout in bad.items():
        holder = ALICE if reason == "not_lease_holder" else BOB
        assert [r.reason for r in state.ingest([rollout], holder).rejected] == [reason]
    good = [make_rollout(sub, "09", node=sub.node) for _ in range(2)]
    answer = state.ingest(good, BOB)
    assert answer.accepted == 2
    assert state.ingest(good[:1], BOB).duplicates == 1, "a resend is a duplicate, not a third sample"
    late = make_rollout(sub, "09", node=sub.node)
    assert [r.reason for r in state.ingest([late], BOB).rejected] == ["group_full"], "the sub-lease is filled"


def test_a_plain_run_refuses_nodes(run_state: Callable[..., RunState], make_rollout: Any) -> None:
    state = run_state()
    [lease] = state.grant_leases(ALICE, 1)
    rollout = make_rollout(lease, "1234", node=RolloutNode(node_id="root", role="proposer"))
    assert [r.reason for r in state.ingest([rollout], ALICE).rejected] == ["node_without_unit"]


def test_a_straggling_node_closes_short_and_late_samples_are_refused_and_counted(
    roles_state: Callable[..., RunState], make_rollout: Any, clock: Any,
) -> None:
    state = roles_state()
    _propose(state, make_rollout)
    [fast] = state.grant_leases(ALICE, 1)
    [slow] = state.grant_leases(BOB, 1)
    assert _solve(state, make_rollout, fast, ALICE) == 2
    clock.advance(5.0)
    state.expire_leases()
    assert not state.ready, "within close_after_s the node waits"
    clock.advance(5.5)  # the node was made 10.5 s ago; it holds 2 = min_fill samples
    with pytest.raises(LeaseClosed, match="node_closed"):
        state.renew_lease(slow.lease_id, BOB)  # the next request closes it short; the slow sub-lease is told so
    [group] = state.ready
    assert group.size == 3 and group.rewards == [0.0, 1.0, 1.0], "closed short at min_fill: p = 1, no learnability"
    late = make_rollout(slow, "0279", node=slow.node)
    answer = state.ingest([late], BOB)
    assert [r.reason for r in answer.rejected] == ["node_closed"]
    assert state.rejected["node_closed"] == 1 and state.lease_policy.closed_short == 1


def test_an_expired_sub_lease_goes_out_again_and_keeps_its_unit(
    roles_state: Callable[..., RunState], make_rollout: Any, clock: Any,
) -> None:
    state = roles_state(min_fill=4)
    unit, _ = _propose(state, make_rollout)
    first = state.grant_leases(BOB, 2)
    assert len(first) == 2
    clock.advance(6.0)
    state.renew_lease(first[0].lease_id, BOB)  # renewing a sub-lease keeps its unit open too
    clock.advance(6.0)  # first[1] is past its 10 s; first[0] and the unit are not
    assert state.expire_leases() == 1
    assert unit.lease_id in state.leases
    [again] = state.grant_leases(ALICE, 1)
    assert again.unit_id == unit.lease_id and again.group_size == 2, "its samples go out again, not its prompt"
    for holder, sub in ((BOB, first[0]), (ALICE, again)):
        assert _solve(state, make_rollout, sub, holder) == 2
    assert len(state.ready) == 1 and state.ready[0].size == 5
    assert state.dropped == {}, "nothing acknowledged was dropped"


def test_an_expired_unit_drops_whole_with_its_sub_leases(
    roles_state: Callable[..., RunState], make_rollout: Any, clock: Any,
) -> None:
    state = roles_state()
    unit, _ = _propose(state, make_rollout)
    [sub] = state.grant_leases(BOB, 1)
    assert _solve(state, make_rollout, sub, BOB, 1) == 1
    clock.advance(11.0)  # nobody renews: the unit and its sub-leases expire
    state.expire_leases()
    assert state.leases == {} and not state.ready
    assert state.dropped["lease_expired"] == 2, "the proposer's sample and the solver's, counted once"
    late = make_rollout(sub, "0279", node=sub.node)
    [rejection] = state.ingest([late], BOB).rejected
    assert rejection.reason in ("lease_expired", "group_dropped"), "its own deadline, or its unit's"


def test_a_restart_keeps_every_acknowledged_sample_of_a_unit(
    roles_state: Callable[..., RunState], make_rollout: Any, tmp_path: Path,
) -> None:
    journal = str(tmp_path / "journal.sqlite")
    state = roles_state(journal)
    unit, proposal = _propose(state, make_rollout)
    [sub] = state.grant_leases(BOB, 1)
    assert _solve(state, make_rollout, sub, BOB, 1) == 1
    state.journal.flush()  # what the app commits before it answers
    state.journal.close()
    again = roles_state(journal)
    recovered = again.leases[unit.lease_id]
    assert [r.rollout_id for r in recovered.samples][0] == proposal.rollout_id and len(recovered.samples) == 2
    assert recovered.samples[1].node == sub.node and recovered.samples[1].prompt_token_ids == sub.prompt_token_ids
    late = make_rollout(sub, "0279", node=sub.node)
    assert [r.reason for r in again.ingest([late], BOB).rejected] == ["unknown_or_expired_lease"], "sub-leases are not journaled"
    subs = again.grant_leases(ALICE, 2)
    assert [s.group_size for s in subs] == [2, 1], "the node's 3 missing samples go out again"
    for s in subs:
        assert again.ingest([make_rollout(s, "0279", node=s.node) for _ in range(s.group_size)], ALICE).accepted == s.group_size
    [group] = again.ready
    assert group.size == 5 and group.rewards[0] == 0.0, "all solved: p = 1"


def test_the_roles_config_errors_say_what_to_fix() -> None:
    config = _merge(BASE_CONFIG, roles_config())
    config["orchestrator"]["roles"]["min_fill"] = 5
    with pytest.raises(ConfigError, match="lower min_fill"):
        parse_config(config)
    config = _merge(BASE_CONFIG, roles_config())
    del config["orchestrator"]["roles"]
    with pytest.raises(ConfigError, match="set all three or none"):
        parse_config(config)
    config = _merge(BASE_CONFIG, roles_config())
    config["deterministic"] = True
    with pytest.raises(ConfigError, match="deterministic = false"):
        parse_config(config)


def test_a_frozen_role_trains_nothing(roles_state: Callable[..., RunState], make_rollout: Any) -> None:
    state = roles_state()
    state.config = state.config.model_copy(update={"orchestrator": state.config.orchestrator.model_copy(update={
        "advantages": state.config.orchestrator.advantages.model_copy(update={"frozen_roles": ["proposer"]})})})
    _propose(state, make_rollout)
    [sub] = state.grant_leases(BOB, 1)
    _solve(state, make_rollout, sub, BOB)
    [other] = state.grant_leases(BOB, 1)
    assert state.ingest([make_rollout(other, "7777", node=other.node) for _ in range(2)], BOB).accepted == 2
    batch = state.take_batch(0)
    assert batch is not None and batch.samples[0].advantage == 0.0 and batch.samples[0].reward == 0.5
    assert [s.advantage for s in batch.samples[1:]] == pytest.approx([0.5, 0.5, -0.5, -0.5])


def test_a_stale_sample_drops_its_unit_whole(roles_state: Callable[..., RunState], make_rollout: Any) -> None:
    state = roles_state()
    unit, _ = _propose(state, make_rollout)
    [sub] = state.grant_leases(BOB, 1)
    state.announce(2)  # max_staleness 1: version 0 can no longer train
    late = make_rollout(sub, "0279", node=sub.node, policy_version=0)
    assert [r.reason for r in state.ingest([late], BOB).rejected] == ["stale"]
    assert unit.lease_id not in state.leases and sub.lease_id not in state.leases, "the unit and its sub-leases"
    assert state.dropped["stale_at_ingest"] == 1 and state.stale_dropped == 2, "the proposer's sample, then this one"
    [again] = state.grant_leases(ALICE, 1)
    assert again.unit_id is None and again.prompt_id == unit.prompt_id, "its prompt goes out again as a new unit"


def test_the_repetition_penalty_lowers_a_repeated_proposal(
    run_state: Callable[..., RunState], make_rollout: Any,
) -> None:
    config = roles_config()
    config["task"].update(repetition_penalty=0.5, repetition_window=4)
    state = run_state(**config, max_staleness=3)  # room for three units at version 0
    rewards = []
    for text in ("9027", "9027", "5511"):
        _propose(state, make_rollout, text)
        subs = state.grant_leases(BOB, 2)
        for sub, answer in zip(subs, ("".join(sorted(text)), "7777"), strict=True):  # half right
            assert state.ingest([make_rollout(sub, answer, node=sub.node) for _ in range(2)], BOB).accepted == 2
        rewards.append(state.ready[-1].rewards[0])
    # Learnability 1 - 1/2 each; penalty 0.5 x share of the window: 1/1, 2/2, then 1/3.
    assert rewards == pytest.approx([0.0, 0.0, 0.5 - 0.5 / 3])


def test_the_proposer_reads_the_exact_pass_rate_while_solvers_get_partial_credit(
    run_state: Callable[..., RunState], make_rollout: Any,
) -> None:
    config = roles_config()
    config["task"].update(solver_reward="positions", pass_rate="exact")
    state = run_state(None, **config)
    _propose(state, make_rollout)  # "9027": its answer is "0279"
    for sub in state.grant_leases(BOB, 2):
        assert state.ingest([make_rollout(sub, text, node=sub.node) for text in ("0279", "0297")], BOB).accepted == 2
    [group] = state.ready
    assert group.rewards == [0.5, 1.0, 0.5, 1.0, 0.5], "p = 2/4 exact answers: 1 - p = 0.5 (their mean reward, 0.75, would give 0.25)"


def test_a_size_proposal_is_solved_as_the_problem_the_task_drew(
    run_state: Callable[..., RunState], make_rollout: Any, tokenizer: PreTrainedTokenizerBase,
) -> None:
    # proposal = "size": the solvers' prompt is the drawn problem (rendered by the orchestrator),
    # never the proposer's text, and their answers are scored against it.
    config = roles_config()
    config["task"]["proposal"] = "size"
    state = run_state(None, **config)
    unit, _ = _propose(state, make_rollout, "1234")
    drawn = state.task.propose("1234", unit.prompt_id)
    assert drawn is not None and len(drawn.digits) == 4
    subs = state.grant_leases(BOB, 2)
    assert [s.prompt_token_ids for s in subs] == [tokenizer(drawn.digits + "=").input_ids] * 2
    right, wrong = "".join(sorted(drawn.digits)), "1234" if drawn.digits != "1234" else "9999"
    for sub in subs:
        assert state.ingest([make_rollout(sub, right, node=sub.node), make_rollout(sub, wrong, node=sub.node)], BOB).accepted == 2
    [group] = state.ready
    assert group.lease_id == unit.lease_id and group.rewards[1:] == [1.0, float(wrong == right), 1.0, float(wrong == right)]
