"""Two policies (issue 48 item 3, `[orchestrator.roles] policies = "per_role"`): each role its own
model, trainer and stream of versions. A proposer worker is leased units, a solver worker their
solver nodes; each sample is judged fresh against its own policy's stream; each trainer's batch
holds its policy's samples of a unit, and the unit is served once both took it. Bad inputs: the
config, and every route that names a policy."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from decentrl.config import ConfigError, parse_config
from orchestrator.auth import TokenRegistry
from orchestrator.state import RunState
from tests.conftest import BASE_CONFIG, ServeOrchestrator, _merge
from tests.orchestrator.test_orchestrator_roles import roles_config

ALICE, BOB = "alice/w0", "bob/w0"
TWO = {"policies": "per_role"}


@pytest.fixture
def two_policies(run_state: Callable[..., RunState]) -> Callable[..., RunState]:
    def make(journal: str | None = None) -> RunState:
        state = run_state(journal, num_workers=2, **roles_config(**TWO))
        if state.stream("proposer").published is None:
            state.announce(0, "proposer")
        return state

    return make


def _unit(state: RunState, make_rollout: Any, *, proposer_version: int = 0, solver_version: int = 0) -> str:
    """One unit through: proposed by ALICE (a proposer worker), solved by BOB (a solver worker)."""
    [unit] = state.grant_leases(ALICE, 1, "proposer")
    assert unit.node is not None and unit.node.policy == "proposer"
    assert state.ingest([make_rollout(unit, "9027", node=unit.node, policy_version=proposer_version)], ALICE).accepted == 1
    subs = state.grant_leases(BOB, 4, "solver")
    assert [s.group_size for s in subs] == [2, 2] and all(s.node is not None and s.node.policy == "solver" for s in subs)
    for sub in subs:
        posted = [make_rollout(sub, text, node=sub.node, policy_version=solver_version) for text in ("0279", "7777")]
        assert state.ingest(posted, BOB).accepted == 2
    return unit.lease_id


@pytest.fixture
def taken_by_the_proposer(two_policies: Callable[..., RunState], make_rollout: Any) -> Callable[..., RunState]:
    """A run of two policies holding one ready unit that the proposer's trainer took and the solver's has not."""

    def make(journal: str | None = None) -> RunState:
        state = two_policies(journal)
        _unit(state, make_rollout)
        assert state.take_batch(0, policy="proposer") is not None
        return state

    return make


def test_each_policy_is_leased_its_own_nodes_and_trains_its_own_samples(
    two_policies: Callable[..., RunState], make_rollout: Any,
) -> None:
    state = two_policies()
    assert state.grant_leases(BOB, 4, "solver") == [], "a solver worker is never leased a new unit"
    unit_id = _unit(state, make_rollout)
    [group] = state.ready
    assert group.rewards == [0.5, 1.0, 0.0, 1.0, 0.0], "rewards of the whole unit: the proposer's from its solvers"
    solver = state.take_batch(0, policy="solver")
    assert solver is not None and len(solver.samples) == 4 and {s.group_id for s in solver.samples} == {unit_id}
    assert state.ready and state.leases == {}, "the unit waits for the proposer's trainer"
    assert state.take_batch(0, policy="solver") is None, "a policy's trainer takes a unit once"
    proposer = state.take_batch(0, policy="proposer")
    assert proposer is not None and len(proposer.samples) == 1 and proposer.samples[0].reward == 0.5
    assert not state.ready and state.counters.groups_served == 1
    assert state.lease_book.closed[unit_id].status == "served"


def test_each_sample_is_fresh_against_its_own_policys_stream(
    two_policies: Callable[..., RunState], make_rollout: Any,
) -> None:
    state = two_policies()
    for version in (1, 2, 3):
        state.announce(version, "solver")
    assert (state.stream("solver").published, state.stream("proposer").published) == (3, 0)
    assert state.lease_capacity() == 2 * 1 - 0, "the stream behind bounds the leases: (0 + 1 + 1) x 1 unit a step"
    # Version 0 of the proposer is fresh (its stream is at 0); version 0 of the solver is not (it is at 3).
    [unit] = state.grant_leases(ALICE, 1, "proposer")
    assert state.ingest([make_rollout(unit, "9027", node=unit.node, policy_version=0)], ALICE).accepted == 1
    subs = state.grant_leases(BOB, 1, "solver")
    rejected = state.ingest([make_rollout(subs[0], "0279", node=subs[0].node, policy_version=0)], BOB).rejected
    assert [r.reason for r in rejected] == ["stale"]
    state.announce(1, "proposer")
    assert state.stream("proposer").published == 1 and state.stream("solver").published == 3


def test_a_unit_one_trainer_took_goes_stale_for_the_other(taken_by_the_proposer: Callable[..., RunState]) -> None:
    state = taken_by_the_proposer()
    state.announce(2, "solver")  # the solver's trainer moved past its samples' version (max_staleness 1)
    assert not state.ready and state.stale_dropped >= 4
    assert state.take_batch(2, policy="solver") is None


def test_a_restart_keeps_both_streams(two_policies: Callable[..., RunState], tmp_path: Path) -> None:
    journal = str(tmp_path / "journal.sqlite")
    state = two_policies(journal)
    state.announce(2, "proposer")
    state.announce(1, "solver")
    state.journal.flush()
    state.journal.close()
    again = two_policies(journal)
    assert (again.stream("proposer").published, again.stream("solver").published) == (2, 1)
    assert (again.stream("proposer").trainer, again.stream("solver").trainer) == (2, 1)


def test_a_restart_remembers_which_trainer_took_a_unit(
    taken_by_the_proposer: Callable[..., RunState], two_policies: Callable[..., RunState], tmp_path: Path,
) -> None:
    # Which policy took a ready unit is journaled (the meta row's `taken`): after a restart the
    # proposer's trainer does not get the unit again, the solver's does, and it is then served.
    journal = str(tmp_path / "journal.sqlite")
    state = taken_by_the_proposer(journal)
    [unit_id] = [group.lease_id for group in state.ready]
    state.journal.flush()
    state.journal.close()
    again = two_policies(journal)
    assert [group.lease_id for group in again.ready] == [unit_id]
    assert again.lease_policy.taken == {unit_id: {"proposer"}}
    assert again.take_batch(0, policy="proposer") is None, "the proposer's trainer took it before the restart"
    batch = again.take_batch(0, policy="solver")
    assert batch is not None and len(batch.samples) == 4 and {s.group_id for s in batch.samples} == {unit_id}
    assert not again.ready and again.lease_book.closed[unit_id].status == "served"
    again.journal.flush()
    again.journal.close()
    third = two_policies(journal)
    assert not third.ready and third.lease_policy.taken == {}, "a served unit is forgotten by both"


def test_the_policies_config_errors_say_what_to_fix() -> None:
    good = _merge(BASE_CONFIG, roles_config(**TWO))
    assert parse_config({**good, "num_workers": 2}).policies == ("proposer", "solver")
    assert parse_config(_merge(BASE_CONFIG, roles_config())).policies == ()
    for change, message in (
        ({"orchestrator": {"roles": {"policies": "two"}}}, "policies"),
        ({"trainer": {"policy": "critic"}}, "set it to one of"),
        ({"worker": {"policy": "Proposer"}}, "pattern"),
        ({"num_workers": 1}, "a worker per policy"),
    ):
        with pytest.raises(ConfigError, match=message):
            parse_config(_merge({**good, "num_workers": 2}, change))
    with pytest.raises(ConfigError, match="policies = 'per_role'"):
        parse_config(_merge(_merge(BASE_CONFIG, roles_config()), {"trainer": {"policy": "solver"}}))


def test_the_routes_refuse_a_policy_the_run_does_not_have(
    two_policies: Callable[..., RunState], serve_orchestrator: ServeOrchestrator, run_state: Callable[..., RunState],
) -> None:
    worker, trainer = "w-token", "t-token"
    tokens = TokenRegistry([{"name": "alice", "role": "worker", "token": worker}, {"name": "t", "role": "trainer", "token": trainer}])

    async def scenario() -> None:
        async with serve_orchestrator(two_policies(), tokens) as server:
            for method, path, body, message in (
                ("POST", "/v1/leases", {"worker_id": "w0", "max_groups": 1}, "two policies"),
                ("POST", "/v1/leases", {"worker_id": "w0", "max_groups": 1, "policy": "critic"}, "not one of this run's"),
                ("POST", "/v1/leases", {"worker_id": "w0", "max_groups": 1, "policy": "Bad Name"}, "policy"),
                ("GET", "/v1/batch?trainer_version=0", None, "two policies"),
                ("GET", "/v1/batch?trainer_version=0&policy=critic", None, "not one of"),
                ("POST", "/v1/version", {"version": 1}, "two policies"),
                ("POST", "/v1/version", {"version": 1, "policy": 7}, "policy"),
                ("GET", "/v1/info?policy=" + "x" * 200, None, "not one of"),
                ("GET", "/v1/version?policy=critic", None, "not one of"),
            ):
                token = trainer if "batch" in path or (path == "/v1/version" and method == "POST") else worker
                status, answer, _ = await server.call(method, path, token, json=body)
                assert status == 400 and message in answer["error"], (path, body, answer)
            status, info, _ = await server.call("GET", "/v1/info?policy=proposer", worker)
            assert status == 200 and info["policies"] == ["proposer", "solver"]
            assert info["store_url"] == "memory://test/proposer" and info["policy_version"] == 0
            status, answer, _ = await server.call("POST", "/v1/version", trainer, json={"version": 1, "policy": "proposer"})
            assert status == 200 and server.state.stream("proposer").published == 1 and server.state.published_version == 0
            status, news, _ = await server.call("GET", "/v1/version?policy=proposer&after=0", worker)
            assert status == 200 and news["policy_version"] == 1
        async with serve_orchestrator(run_state(), tokens) as server:  # a run of one policy names none
            body = {"worker_id": "w0", "max_groups": 1, "policy": "solver"}
            status, answer, _ = await server.call("POST", "/v1/leases", worker, json=body)
            assert status == 400 and "name none" in answer["error"]

    asyncio.run(scenario())


def test_an_invalid_proposal_trains_the_proposer_alone(two_policies: Callable[..., RunState], make_rollout: Any) -> None:
    state = two_policies()
    [unit] = state.grant_leases(ALICE, 1, "proposer")
    assert state.ingest([make_rollout(unit, "9", node=unit.node)], ALICE).accepted == 1  # too short: invalid
    assert state.grant_leases(BOB, 1, "solver") == [], "no solver node; the request judged the proposal"
    [group] = state.ready
    assert group.rewards == [-1.0]
    assert state.take_batch(0, policy="solver") is None, "nothing of it for the solver's trainer"
    batch = state.take_batch(0, policy="proposer")
    assert batch is not None and [s.reward for s in batch.samples] == [-1.0]
    assert not state.ready and state.lease_book.closed[unit.lease_id].status == "served"


def test_each_trainer_asking_again_gets_its_own_batch(two_policies: Callable[..., RunState], make_rollout: Any) -> None:
    state = two_policies()
    _unit(state, make_rollout)
    solver = state.take_batch(0, "step-1", policy="solver")
    proposer = state.take_batch(0, "step-1", policy="proposer")  # the same step's name, the other trainer
    assert solver is not None and proposer is not None and len(solver.samples) == 4 and len(proposer.samples) == 1
    assert state.take_batch(0, "step-1", policy="proposer") == proposer, "a re-ask: the same batch again"


def test_invalid_proposals_do_not_use_the_solvers_budget_and_a_finished_trainer_holds_nothing(
    two_policies: Callable[..., RunState], make_rollout: Any,
) -> None:
    state = two_policies()  # 1 unit a step, max_staleness 1: 2 units a stream at version 0
    for _ in range(2):
        [unit] = state.grant_leases(ALICE, 1, "proposer")
        state.ingest([make_rollout(unit, "9", node=unit.node)], ALICE)  # invalid
        state.grant_leases(BOB, 1, "solver")  # judges it
        assert state.take_batch(0, policy="proposer") is not None
    assert (state.stream("proposer").consumed, state.stream("solver").consumed) == (2, 0)
    assert state.lease_capacity() == 0, "the proposer's stream is at version 0: its 2 units are used"
    state.announce(1, "proposer")
    state.announce(2, "proposer")
    assert state.lease_capacity() == 2, "the solver's budget: none of its units used by invalid proposals"
    unit_id = _unit(state, make_rollout, proposer_version=2)
    assert state.take_batch(0, policy="solver") is not None
    assert state.ready, "the proposer's trainer still owes it"
    state.announce(3, "proposer")  # its last step (trainer.steps = 3): it takes no more
    assert not state.ready and state.lease_book.closed[unit_id].status == "served"
    assert state.lease_capacity() == 2 - 1, "the solver's stream alone bounds the leases now"


def test_after_the_proposers_last_step_its_invalid_proposals_are_served_at_once_not_queued(
    two_policies: Callable[..., RunState], make_rollout: Any,
) -> None:
    """An invalid proposal's unit holds the proposer's one sample: once that trainer ran its last
    step no trainer takes it, so queued it would stay, and enough of them would fill the buffer
    (rollout posts answered 503 until the workers gave up: a frozen proposer's run of two models,
    2026-11-29)."""
    state = two_policies()
    for version in (1, 2, 3):  # trainer.steps = 3: the proposer's trainer is done
        state.announce(version, "proposer")
    for _ in range(2):
        [unit] = state.grant_leases(ALICE, 1, "proposer")
        assert state.ingest([make_rollout(unit, "9", node=unit.node, policy_version=3)], ALICE).accepted == 1  # invalid
        state.grant_leases(BOB, 1, "solver")  # judges it: the unit ends with its one sample
        assert state.lease_book.closed[unit.lease_id].status == "served"
    assert not state.ready and not state.buffer_full()
    unit_id = _unit(state, make_rollout, proposer_version=3)  # a valid one still trains the solver
    assert [g.lease_id for g in state.ready] == [unit_id]
    batch = state.take_batch(0, policy="solver")
    assert batch is not None and len(batch.samples) == 4 and not state.ready


def test_a_unit_a_trainer_took_is_not_dropped_when_that_trainer_moves_on(taken_by_the_proposer: Callable[..., RunState]) -> None:
    state = taken_by_the_proposer()
    state.announce(1, "proposer")
    state.announce(2, "proposer")  # its proposer sample (v0) is stale for the proposer's stream, which trained it already
    assert state.ready and state.stale_dropped == 0
    batch = state.take_batch(0, policy="solver")
    assert batch is not None and len(batch.samples) == 4 and not state.ready
