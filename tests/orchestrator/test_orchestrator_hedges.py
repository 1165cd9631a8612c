"""Hedging in deterministic runs (orchestrator/lease_policy.py `Deterministic`): a lagging
place of the next batch gets a second lease on another worker; the first copy to complete fills
it, the other is closed and its posts answered as duplicates, never a strike; a place is never
served twice nor skipped, across expiries and a restart on the journal."""

from __future__ import annotations

import asyncio
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from transformers import PreTrainedTokenizerBase

from decentrl.api.wire import Lease, LeaseRequest, LeaseResponse, Rollout, RolloutBatch
from decentrl.config import ConfigError
from decentrl.tasks import build_task
from orchestrator import handlers
from orchestrator.auth import TokenRegistry
from orchestrator.journal import Journal
from orchestrator.lease_policy import MIN_RECENT, Deterministic, hedge_wait
from orchestrator.state import RunState

ALICE, BOB, CAROL = "alice/w0", "bob/w1", "carol/w2"


@pytest.fixture
def open_state(
    make_config: Any, tokenizer: PreTrainedTokenizerBase, clock: Any, tmp_path: Path
) -> Callable[..., RunState]:
    """`open_state(**config)`: a deterministic RunState (groups_per_step 2, max_staleness 1,
    group_size 3) on the test's journal, recovering what it holds; version 0 announced."""

    def make(**overrides: Any) -> RunState:
        config = make_config(deterministic=True, **overrides)
        journal = Journal(str(tmp_path / "journal.sqlite"), run_name=config.run_name)
        state = RunState(config=config, task=build_task(config.task), tokenizer=tokenizer, clock=clock, journal=journal)
        state.announce(0)
        return state

    return make


@pytest.fixture
def group(make_rollout: Any, sorted_answer: Callable[[str], str]) -> Callable[..., list[Rollout]]:
    """The deterministic group of a lease as its holder posts it (`logprob` stands for the content:
    two honest copies of a place post the same)."""

    def make(state: RunState, lease: Lease, worker_id: str, *, logprob: float = -1.0) -> list[Rollout]:
        answer = sorted_answer(state.task.prompt(lease.prompt_id).text)
        return [
            make_rollout(lease, answer, worker_id=worker_id, policy_version=lease.policy_version, sample_index=j,
                         logprob=logprob)
            for j in range(lease.group_size)
        ]

    return make


TAILED = [1.0] * (MIN_RECENT // 2) + [3.0] * (MIN_RECENT // 2)  # recent lease times with a tail: wait 1 s


def lagging(state: RunState, clock: Any) -> list[Lease]:
    """Places 0-3 leased to alice; recent lease times of 1 s and 3 s, so a place is due a copy
    after 1 s out (those out 1 s went on for 2 s more on average, over `after` 0.5 x the 2 s median)."""
    leases = state.grant_leases(ALICE, 8)
    assert [lease.index for lease in leases] == [0, 1, 2, 3]  # the budget: 4 places under version 0
    for lease_s in TAILED:
        state.lease_policy.hedges.completed(lease_s)  # type: ignore[union-attr]
    return leases


def copies_of(state: RunState) -> dict[int, list[str]]:
    """Each open place's open leases (copies), oldest first."""
    assert isinstance(state.lease_policy, Deterministic)
    return {index: list(copies) for index, copies in state.lease_policy.places.items()}


def hedged(state: RunState, clock: Any) -> tuple[list[Lease], Lease]:
    """`lagging`, then 2 s on (past the 1 s due time): bob takes a copy of place 0."""
    leases = lagging(state, clock)
    clock.advance(2.0)
    return leases, state.grant_leases(BOB, 1)[0]


def test_a_lagging_place_of_the_next_batch_gets_a_second_lease_on_another_worker(
    open_state: Callable[..., RunState], clock: Any
) -> None:
    state = open_state()
    leases = lagging(state, clock)
    assert state.grant_leases(BOB, 4) == []  # not yet: out 0 s, due after 1 s (`lagging`)
    assert state.hedge_due_in(BOB) == pytest.approx(1.0)
    clock.advance(0.9)
    assert state.grant_leases(BOB, 4) == []
    clock.advance(0.2)
    assert state.grant_leases(ALICE, 4) == []  # never a second copy to the worker holding the first
    copies = state.grant_leases(BOB, 4)
    # Only places 0 and 1 (the next batch), lowest first; places 2 and 3 are not hedged yet.
    assert [(c.index, c.prompt_id, c.policy_version) for c in copies] == [
        (lease.index, lease.prompt_id, lease.policy_version) for lease in leases[:2]
    ]
    assert {c.lease_id for c in copies}.isdisjoint(lease.lease_id for lease in leases)
    assert state.grant_leases(CAROL, 4) == []  # max_copies 2: both places have two copies out
    assert state.counters.hedged_leases == 2 and state.status().hedged_leases == 2
    assert state.lease_capacity() == 0  # copies take no room in the lease budget


def test_hedging_more_batches_reaches_past_the_next_one(open_state: Callable[..., RunState], clock: Any) -> None:
    state = open_state(orchestrator={"hedging": {"batches": 2, "max_copies": 3}})
    lagging(state, clock)
    clock.advance(1.1)
    assert [c.index for c in state.grant_leases(BOB, 8)] == [0, 1, 2, 3]
    assert state.grant_leases(CAROL, 8) == []  # the copies are new: their own 1 s out first
    clock.advance(1.1)
    assert [c.index for c in state.grant_leases(CAROL, 8)] == [0, 1, 2, 3]  # third copies, max_copies 3


def test_the_wait_is_the_time_out_after_which_leases_still_had_far_to_go() -> None:
    assert hedge_wait(TAILED, 0.5) == 1.0  # out 1 s: 2 s more on average, over 0.5 x the 2 s median
    assert hedge_wait(TAILED, 1.5) is None  # 2 s more is under 1.5 x 2 s: no copy would gain
    assert hedge_wait([1.0] * 8, 0.5) is None  # no tail: the rest of the batch is as near as a copy
    spread = sorted(0.1 + 0.2 * 1.5**k for k in range(12))  # a long tail: waiting longer predicts more to go
    wait = hedge_wait(spread, 0.5)
    assert wait is not None and spread[0] <= wait < statistics.median(spread)


def test_lease_times_without_a_tail_hedge_only_the_batch_straggler(
    open_state: Callable[..., RunState], group: Any, clock: Any
) -> None:
    state = open_state()
    leases = state.grant_leases(ALICE, 8)
    for _ in range(MIN_RECENT):
        state.lease_policy.hedges.completed(1.0)  # type: ignore[union-attr]
    clock.advance(10.0)
    assert state.grant_leases(BOB, 4) == [] and state.hedge_due_in(BOB) is None  # however long they are out
    state.ingest(group(state, leases[1], "w0"), ALICE)
    assert [copy.index for copy in state.grant_leases(BOB, 4)] == [0]  # the last of the next batch


def test_the_last_open_place_of_the_next_batch_is_hedged_at_once(
    open_state: Callable[..., RunState], group: Any, clock: Any
) -> None:
    state = open_state()
    leases = state.grant_leases(ALICE, 8)
    assert state.grant_leases(BOB, 1) == []  # no median yet, two places of the batch out
    state.ingest(group(state, leases[1], "w0"), ALICE)
    assert state.hedge_due_in(None) == 0.0  # place 0 is the batch's straggler
    (copy,) = state.grant_leases(BOB, 2)
    assert copy.index == 0


def test_the_first_copy_fills_the_place_and_the_other_is_a_duplicate_never_a_strike(
    open_state: Callable[..., RunState], group: Any, clock: Any
) -> None:
    state = open_state(orchestrator={"verification": {"enabled": True, "spot_check_fraction": 0.0, "new_worker_checks": 0}})
    leases, copy = hedged(state, clock)
    slow = group(state, leases[0], "w0")
    assert state.ingest(slow[:1], ALICE).accepted == 1  # alice's copy is under way
    assert state.ingest(group(state, copy, "w1"), BOB).accepted == 3  # bob's copy completes first
    later = state.ingest(slow[1:], ALICE)
    assert (later.accepted, later.duplicates, later.rejected) == (0, 2, [])
    assert state.ingest(slow[1:], ALICE).duplicates == 2  # a resend: still duplicates
    assert state.counters.hedge_duplicates == 4 and state.counters.hedge_mismatches == 0
    assert state.counters.dropped == {"hedge_lost": 1}  # the sample alice's copy held when it lost
    assert state.lease_state(leases[0].lease_id, ALICE).state == "superseded"
    record = state.integrity.workers["alice"]
    assert record.strikes == 0 and not record.rejections
    assert 0 not in copies_of(state) and list(state.lease_book.prompts.requeued) == []

    state.ingest(group(state, leases[1], "w0"), ALICE)
    batch = state.take_batch(0)
    assert batch is not None and len(batch.samples) == 6
    assert [s.group_id for s in batch.samples[::3]] == [copy.lease_id, leases[1].lease_id]
    state.ingest(group(state, leases[2], "w0"), ALICE)
    state.ingest(group(state, leases[3], "w0"), ALICE)
    second = state.take_batch(0)
    assert second is not None and [s.group_id for s in second.samples[::3]] == [leases[2].lease_id, leases[3].lease_id]
    assert state.counters.groups_served == 4  # place 0 served once


def test_a_losing_copy_that_differs_is_counted_not_struck(
    open_state: Callable[..., RunState], group: Any, clock: Any
) -> None:
    state = open_state()
    leases, copy = hedged(state, clock)
    state.ingest(group(state, copy, "w1"), BOB)
    result = state.ingest(group(state, leases[0], "w0", logprob=-2.0), ALICE)  # not bit for bit bob's
    assert (result.duplicates, result.rejected) == (3, [])
    assert state.counters.hedge_mismatches == 3 and state.status().hedge_mismatches == 3


def test_a_copy_that_expires_leaves_the_place_to_the_other(
    open_state: Callable[..., RunState], group: Any, clock: Any
) -> None:
    state = open_state()
    leases, copy = hedged(state, clock)
    clock.advance(state.config.orchestrator.lease_timeout_s - 1.0)  # alice's leases expire, bob's copy not
    state.expire_leases()
    assert copies_of(state) == {0: [copy.lease_id]}
    assert list(state.lease_book.prompts.requeued) == [1, 2, 3]  # place 0 is still out: not leased again
    state.ingest(group(state, copy, "w1"), BOB)
    assert [r.reason for r in state.ingest(group(state, leases[0], "w0"), ALICE).rejected] == ["lease_expired"] * 3
    clock.advance(state.config.orchestrator.lease_timeout_s)
    state.expire_leases()
    assert list(state.lease_book.prompts.requeued) == [1, 2, 3]  # place 0 complete, never requeued


def test_both_copies_expiring_put_the_place_back_once(open_state: Callable[..., RunState], clock: Any) -> None:
    state = open_state()
    lagging(state, clock)
    clock.advance(2.0)
    state.grant_leases(BOB, 1)
    clock.advance(state.config.orchestrator.lease_timeout_s + 1.0)
    state.expire_leases()
    assert list(state.lease_book.prompts.requeued) == [0, 1, 2, 3] and copies_of(state) == {}


def test_recovery_with_two_open_leases_of_one_place(
    open_state: Callable[..., RunState], group: Any, clock: Any
) -> None:
    state = open_state()
    leases = lagging(state, clock)
    clock.advance(2.0)
    copy_0, copy_1 = state.grant_leases(BOB, 2)
    state.ingest(group(state, copy_1, "w1"), BOB)  # place 1 filled by bob: alice's lease superseded
    state.ingest(group(state, leases[0], "w0")[:2], ALICE)  # both copies of place 0 part-way
    state.ingest(group(state, copy_0, "w1")[:1], BOB)
    state.journal.flush()
    state.journal.close()  # kill -9 after the last commit

    again = open_state()
    book = again.lease_book
    assert sorted(copies_of(again)[0]) == sorted([leases[0].lease_id, copy_0.lease_id])
    for lease_id in copies_of(again)[0]:
        lease = book.open[lease_id].lease
        assert (lease.index, lease.prompt_id, lease.policy_version) == (0, leases[0].prompt_id, 0)
    assert [len(book.open[i].samples) for i in (leases[0].lease_id, copy_0.lease_id)] == [2, 1]
    assert again.counters.hedged_leases == 2
    # Alice's superseded copy of place 1, known only to the journal now: still a duplicate.
    late = again.ingest(group(again, leases[1], "w0"), ALICE)
    assert (late.duplicates, late.rejected) == (3, [])
    assert again.lease_capacity() == 0  # places 0, 2, 3 open, 1 complete: the budget of 4

    remaining = group(again, leases[0], "w0")[2:]
    assert again.ingest(remaining, ALICE).accepted == 1  # alice completes place 0
    assert 0 not in copies_of(again) and book.closed[copy_0.lease_id].status == "superseded"
    batch = again.take_batch(0)
    assert batch is not None and [s.group_id for s in batch.samples[::3]] == [leases[0].lease_id, copy_1.lease_id]
    assert list(book.prompts.requeued) == []
    late = again.ingest(group(again, copy_0, "w1")[1:], BOB)
    assert (late.duplicates, late.rejected) == (2, [])


def test_free_running_runs_are_never_hedged(make_config: Any, tokenizer: PreTrainedTokenizerBase, clock: Any) -> None:
    config = make_config()
    state = RunState(config=config, task=build_task(config.task), tokenizer=tokenizer, clock=clock)
    state.announce(0)
    state.grant_leases(ALICE, 4)
    clock.advance(5.0)
    assert state.lease_policy.hedges is None and state.hedge_due_in(BOB) is None
    assert state.grant_leases(BOB, 4) == [] and state.counters.hedged_leases == 0


def test_hedging_can_be_turned_off(open_state: Callable[..., RunState], group: Any) -> None:
    state = open_state(orchestrator={"hedging": {"enabled": False}})
    leases = state.grant_leases(ALICE, 8)
    state.ingest(group(state, leases[1], "w0"), ALICE)
    assert state.lease_policy.hedges is None and state.grant_leases(BOB, 1) == []


@pytest.mark.parametrize(
    "hedging",
    [
        {"after": 0},
        {"after": -1.0},
        {"after": "soon"},
        {"after": 1e9},
        {"after": float("nan")},
        {"max_copies": 1},
        {"max_copies": 100},
        {"max_copies": 2.5},
        {"batches": 0},
        {"batches": 17},
        {"batches": "all"},
        {"enabled": "yes"},
        {"enabled": 1},
        {"median": 1.0},
    ],
)
def test_bad_hedging_settings_are_refused(make_config: Any, hedging: dict[str, Any]) -> None:
    with pytest.raises(ConfigError, match="orchestrator.hedging"):
        make_config(deterministic=True, orchestrator={"hedging": hedging})


def two_workers(tmp_path: Path) -> TokenRegistry:
    """Worker tokens for alice ("alice-secret") and bob ("bob-secret")."""
    tokens = tmp_path / "tokens.json"
    tokens.write_text('{"tokens": []}')
    return TokenRegistry(path=str(tokens), env_entries=[
        {"name": "alice", "role": "worker", "token": "alice-secret"}, {"name": "bob", "role": "worker", "token": "bob-secret"},
    ])


def test_a_waiting_worker_gets_the_straggler_the_moment_it_is_the_last(
    make_config: Any, tokenizer: PreTrainedTokenizerBase, tmp_path: Path, serve_orchestrator: Any, group: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Over HTTP: bob's lease long-poll (nothing to grant) is woken by alice's post that leaves
    place 0 the last open place of the next batch, and answered with a copy of it. The periodic
    re-check is pushed past the long-poll's end, so only the post's wake-up can answer it."""
    monkeypatch.setattr(handlers, "LEASE_RECHECK_S", 60.0)
    config = make_config(deterministic=True, orchestrator={"lease_wait_s": 10.0})
    state = RunState(config=config, task=build_task(config.task), tokenizer=tokenizer)
    state.announce(0)
    registry = two_workers(tmp_path)

    async def scenario() -> None:
        async with serve_orchestrator(state, registry) as server:
            alice, bob = server.client("alice-secret"), server.client("bob-secret")
            leases = (await asyncio.to_thread(alice.lease, LeaseRequest(worker_id="w0", max_groups=4))).leases
            waiting = asyncio.create_task(asyncio.to_thread(bob.lease, LeaseRequest(worker_id="w1", max_groups=1)))
            await asyncio.sleep(0.3)
            assert not waiting.done()
            loop = asyncio.get_running_loop()
            posted = loop.time()
            await asyncio.to_thread(alice.post_rollouts, RolloutBatch(rollouts=group(state, leases[1], "w0")))
            (copy,) = (await waiting).leases
            assert copy.index == 0 and copy.prompt_id == leases[0].prompt_id
            assert loop.time() - posted < 5.0  # woken by the post: no re-check before the 10 s long-poll ends

    asyncio.run(asyncio.wait_for(scenario(), timeout=30))


def test_the_losing_copys_holder_is_told_once_in_its_next_lease_answer(
    make_config: Any, tokenizer: PreTrainedTokenizerBase, tmp_path: Path, serve_orchestrator: Any, group: Any
) -> None:
    """Over HTTP: bob's copy of place 0 fills it first. Alice's worker w0, long-polling with
    nothing to grant, is answered at once with its losing lease in `superseded`; never again
    after, and never to bob nor to alice's other worker id."""
    config = make_config(deterministic=True, orchestrator={"lease_wait_s": 10.0})
    state = RunState(config=config, task=build_task(config.task), tokenizer=tokenizer)
    state.announce(0)

    async def scenario() -> None:
        async with serve_orchestrator(state, two_workers(tmp_path)) as server:
            alice, bob = server.client("alice-secret"), server.client("bob-secret")

            async def lease(client: Any, worker_id: str, groups: int = 4) -> LeaseResponse:
                return await asyncio.to_thread(client.lease, LeaseRequest(worker_id=worker_id, max_groups=groups))

            first = await lease(alice, "w0")
            leases = first.leases
            assert first.superseded == []
            await asyncio.to_thread(alice.post_rollouts, RolloutBatch(rollouts=group(state, leases[1], "w0")))
            copy = (await lease(bob, "w1", 1)).leases[0]  # place 0, the last of its batch
            waiting = asyncio.create_task(lease(alice, "w0"))  # nothing to grant: a long-poll
            await asyncio.sleep(0.6)  # its re-checks: 0.5 s and 1.0 s after it began
            assert not waiting.done()
            loop = asyncio.get_running_loop()
            posted = loop.time()
            await asyncio.to_thread(bob.post_rollouts, RolloutBatch(rollouts=group(state, copy, "w1")))
            told = await waiting
            assert loop.time() - posted < 0.3  # woken by the post, not by the next re-check
            assert (told.leases, told.superseded) == ([], [leases[0].lease_id])
            assert state.status().hedge_copies_told == 1

            state.announce(2)  # room for 4 new places: the next 4 answers come at once
            again = await lease(alice, "w0", 1)
            assert again.leases and again.superseded == []  # told once
            for client, worker_id in ((alice, "w2"), (bob, "w1")):
                assert (await lease(client, worker_id, 1)).superseded == []
            status, raw, _ = await server.call(
                "POST", "/v1/leases", "alice-secret", json={"worker_id": "w0", "max_groups": 1}
            )
            assert status == 200 and raw["superseded"] == []
            assert state.counters.hedge_copies_told == 1 and state.lease_policy.untold == {}

    asyncio.run(asyncio.wait_for(scenario(), timeout=30))


def test_a_holder_is_not_told_of_a_copy_it_posted(
    open_state: Callable[..., RunState], group: Any, clock: Any
) -> None:
    state = open_state()
    leases, copy = hedged(state, clock)
    state.ingest(group(state, copy, "w1"), BOB)
    assert state.lease_policy.untold == {ALICE: {leases[0].lease_id: None}}
    assert state.ingest(group(state, leases[0], "w0"), ALICE).duplicates == 3  # it finished the copy anyway
    assert state.tell(ALICE) == [] and state.counters.hedge_copies_told == 0


def test_untold_copies_are_bounded_a_holder_and_forgotten_with_their_leases(
    open_state: Callable[..., RunState], group: Any, clock: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A holder that never asks again: past MAX_SUPERSEDED its oldest news goes, and the rest
    goes when the closed leases themselves are forgotten (dedupe_window_s)."""
    monkeypatch.setattr("orchestrator.lease_policy.MAX_SUPERSEDED", 1)
    state = open_state()
    leases = lagging(state, clock)
    clock.advance(2.0)
    copies = state.grant_leases(BOB, 2)  # places 0 and 1
    for copy in copies:
        state.ingest(group(state, copy, "w1"), BOB)
    assert state.lease_policy.untold == {ALICE: {leases[1].lease_id: None}}  # the newer of two
    clock.advance(state.config.orchestrator.dedupe_window_s + 1.0)
    state.forget_closed()
    assert state.lease_policy.untold == {} and state.tell(ALICE) == []


def test_free_running_runs_never_tell_of_superseded_copies(
    make_config: Any, tokenizer: PreTrainedTokenizerBase, tmp_path: Path, serve_orchestrator: Any,
    make_rollout: Any, sorted_answer: Callable[[str], str],
) -> None:
    """Over HTTP: leases granted, answered and released in a free-running run, by two workers:
    every lease answer's `superseded` is empty."""
    config = make_config(orchestrator={"lease_wait_s": 0.0})
    state = RunState(config=config, task=build_task(config.task), tokenizer=tokenizer)
    state.announce(0)

    async def scenario() -> None:
        async with serve_orchestrator(state, two_workers(tmp_path)) as server:
            alice, bob = server.client("alice-secret"), server.client("bob-secret")
            answers = [await asyncio.to_thread(alice.lease, LeaseRequest(worker_id="w0", max_groups=2))]
            done, given_back = answers[0].leases
            rollouts = [
                make_rollout(done, sorted_answer(state.task.prompt(done.prompt_id).text), sample_index=j)
                for j in range(done.group_size)
            ]
            await asyncio.to_thread(alice.post_rollouts, RolloutBatch(rollouts=rollouts))
            await asyncio.to_thread(alice.release_lease, given_back.lease_id, "w0")
            for client, worker_id in ((alice, "w0"), (bob, "w1"), (alice, "w0")):
                answers.append(await asyncio.to_thread(client.lease, LeaseRequest(worker_id=worker_id, max_groups=2)))
            assert all(answer.superseded == [] for answer in answers)
            assert state.counters.hedge_copies_told == 0 and state.lease_policy.untold == {}

    asyncio.run(asyncio.wait_for(scenario(), timeout=30))
