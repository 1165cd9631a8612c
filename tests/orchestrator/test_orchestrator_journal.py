"""The journal (orchestrator/journal.py) and recovery (RunState with a journal).

State level, no HTTP: a RunState with a journal in a temp dir does things, `journal.flush()`
commits (what the HTTP layer awaits before answering), and a second RunState on the same file
must come back with the same versions, counters, leases (deadlines, partial samples), buffer
(order, rewards) and served batches - and must never serve a group twice.
"""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from transformers import PreTrainedTokenizerBase

from decentrl.api.wire import Lease, Rollout
from decentrl.tasks import build_task
from orchestrator.journal import Journal, JournalError, JournalMismatch
from orchestrator.state import RunState

HOLDER = "alice/w0"
GROUP = 3


@pytest.fixture
def journal_path(tmp_path: Path) -> str:
    return str(tmp_path / "journal.sqlite")


@pytest.fixture
def open_state(make_config: Any, tokenizer: PreTrainedTokenizerBase, clock: Any, journal_path: str) -> Callable[..., RunState]:
    """`open_state(**config_overrides)`: a RunState on the test's journal file (recovering what it holds)."""

    def make(**overrides: Any) -> RunState:
        config = make_config(**overrides)
        journal = Journal(journal_path, run_name=config.run_name)
        return RunState(config=config, task=build_task(config.task), tokenizer=tokenizer, clock=clock, journal=journal)

    return make


def restart(state: RunState, open_state: Callable[..., RunState], **overrides: Any) -> RunState:
    """Simulate a crash right after the last commit: drop the process state, reopen the file."""
    assert state.journal.durable
    state.journal.close()
    return open_state(**overrides)


@pytest.fixture
def group(make_rollout: Any, sorted_answer: Callable[[str], str]) -> Callable[..., list[Rollout]]:
    def make(state: RunState, lease: Lease, n: int = GROUP, *, policy_version: int = 0, wrong: int = 0) -> list[Rollout]:
        right = sorted_answer(state.task.prompt(lease.prompt_id).text)
        return [make_rollout(lease, "====" if i < wrong else right, policy_version=policy_version) for i in range(n)]

    return make


def test_recovery_rebuilds_versions_counters_leases_buffer_and_batches(
    open_state: Callable[..., RunState], group: Any, clock: Any, make_rollout: Any
) -> None:
    state = open_state(max_staleness=2)
    state.announce(0)
    leases = state.grant_leases(HOLDER, 5)
    full = [group(state, lease, wrong=i % 2) for i, lease in enumerate(leases[:4])]
    for rollouts in full:
        assert state.ingest(rollouts, HOLDER).accepted == GROUP
    partial = group(state, leases[4], 2)
    state.ingest(partial, HOLDER)
    state.ingest([make_rollout(leases[0], "12", run_name="other")], HOLDER)  # a rejection, counted
    state.ingest(partial[:1], HOLDER)  # a duplicate, counted
    first = state.take_batch(0, request_id="req-1")
    assert first is not None
    state.announce(1)
    clock.advance(1.0)
    assert state.journal.durable
    state.journal.flush()
    before = state.status()
    ready_before = [(g.lease_id, [r for _, r in g.samples]) for g in state.ready]

    state = restart(state, open_state, max_staleness=2)

    after = state.status()
    assert after.recoveries == 1
    for field in ("policy_version", "trainer_version", "rollouts_accepted", "rollouts_rejected", "stale_dropped",
                  "groups_ready", "groups_served", "leases_active", "leases_expired", "rollouts_duplicate"):
        assert getattr(after, field) == getattr(before, field), field
    # The buffer, in order, with the verifier's rewards.
    assert [(g.lease_id, [r for _, r in g.samples]) for g in state.ready] == ready_before
    # The open lease, with its deadline, holder and partial samples.
    (open_lease,) = state.leases.values()
    assert open_lease.lease == leases[4] and open_lease.holder == HOLDER
    assert [r.rollout_id for r in open_lease.samples] == [r.rollout_id for r in partial]
    assert open_lease.samples[0] == partial[0]
    # Resends of anything acknowledged are still duplicates.
    resend = state.ingest(full[0] + partial, HOLDER)
    assert (resend.accepted, resend.duplicates, resend.rejected) == (0, GROUP + 2, [])
    # The batch served before the crash comes again for the same request, never a second time.
    again = state.take_batch(1, request_id="req-1")
    assert again is not None and again.batch_id == first.batch_id
    assert again.samples == first.samples
    second = state.take_batch(1, request_id="req-2")
    assert second is not None
    served_first = {s.rollout_id for s in first.samples}
    assert served_first.isdisjoint(s.rollout_id for s in second.samples)
    assert state.take_batch(1) is None  # 4 groups, 2 per batch: all served exactly once
    # The partial group completes after the restart, by its holder.
    finish = state.ingest(group(state, leases[4], 1), HOLDER)
    assert finish.accepted == 1 and len(state.ready) == 1


def test_prompts_continue_where_they_were(open_state: Callable[..., RunState], group: Any) -> None:
    state = open_state()
    state.announce(0)
    first = state.grant_leases(HOLDER, 2)
    assert state.journal.durable
    state.journal.flush()
    state = restart(state, open_state)
    (third,) = state.grant_leases(HOLDER, 1)
    # As without a crash: the third prompt of the (seeded) shuffled pool, not the first again.
    assert [lease.prompt_id for lease in first] == state.lease_book.prompts.order[:2]
    assert third.prompt_id == state.lease_book.prompts.order[2]


def test_a_counter_changed_alone_is_committed_and_an_unchanged_meta_row_is_not_rewritten(
    open_state: Callable[..., RunState], journal_path: str
) -> None:
    """No part marks the meta row dirty: the journal compares it at each commit."""
    state = open_state()
    state.announce(0)
    state.journal.flush()
    statements: list[str] = []
    state.journal._conn.set_trace_callback(statements.append)
    state.journal.flush()  # nothing changed: nothing written
    assert not [s for s in statements if "INTO meta" in s]
    state.counters.hedge_copies_told += 1  # a change no recording method is called for
    state.journal.flush()
    assert [s for s in statements if "INTO meta" in s]
    state = restart(state, open_state)
    assert state.counters.hedge_copies_told == 1


def test_only_committed_changes_survive(open_state: Callable[..., RunState], group: Any) -> None:
    state = open_state()
    state.announce(0)
    (lease,) = state.grant_leases(HOLDER, 1)
    assert state.journal.durable
    state.journal.flush()
    state.ingest(group(state, lease, 2), HOLDER)  # recorded, never committed: never acknowledged
    state = restart(state, open_state)
    assert state.rollouts_accepted == 0
    assert state.leases[lease.lease_id].samples == []


def test_a_lease_that_expired_while_down_is_leased_again_first(
    open_state: Callable[..., RunState], group: Any, clock: Any
) -> None:
    state = open_state()  # lease_timeout_s 10
    state.announce(0)
    (lease,) = state.grant_leases(HOLDER, 1)
    state.ingest(group(state, lease, 1), HOLDER)
    assert state.journal.durable
    state.journal.flush()
    clock.advance(60)  # the orchestrator was down for a minute
    state = restart(state, open_state)
    (again,) = state.grant_leases("bob/w1", 1)
    assert again.prompt_id == lease.prompt_id
    assert state.leases_expired == 1 and state.dropped == {"lease_expired": 1}
    late = state.ingest(group(state, lease, 1), HOLDER)
    assert [r.reason for r in late.rejected] == ["lease_expired"]


def test_evicted_and_released_groups_do_not_come_back(
    open_state: Callable[..., RunState], group: Any
) -> None:
    state = open_state(max_staleness=1)
    state.announce(0)
    old, kept, released = state.grant_leases(HOLDER, 3)
    state.ingest(group(state, old), HOLDER)
    state.announce(1)
    state.ingest(group(state, kept, policy_version=1), HOLDER)
    state.release_lease(released.lease_id, HOLDER)
    state.announce(2)  # version-0 samples are now too old: the first group is evicted
    assert [g.lease_id for g in state.ready] == [kept.lease_id]
    assert state.journal.durable
    state.journal.flush()
    state = restart(state, open_state, max_staleness=1)
    assert [g.lease_id for g in state.ready] == [kept.lease_id]
    assert state.leases == {}
    assert state.stale_dropped == GROUP and state.dropped == {"stale_in_buffer": GROUP}
    assert state.lease_state(old.lease_id, HOLDER).state == "dropped"
    assert state.lease_state(released.lease_id, HOLDER).state == "released"
    assert state.lease_book.prompts.requeued[0] == released.prompt_id  # a released prompt goes out first


def test_forgetting_closed_leases_bounds_memory_and_disk(
    open_state: Callable[..., RunState], group: Any, clock: Any, journal_path: str
) -> None:
    state = open_state(orchestrator={"dedupe_window_s": 30.0, "batches_kept": 1})
    state.announce(0)
    leases = state.grant_leases(HOLDER, 4)
    posted = [group(state, lease) for lease in leases]
    for rollouts in posted:
        state.ingest(rollouts, HOLDER)
    assert state.take_batch(0, "a") is not None and state.take_batch(0, "b") is not None
    clock.advance(31)
    forgotten = state.forget_closed()
    # Batch "a" fell out of the kept batches; batch "b" may still be asked for again.
    assert forgotten == 2
    assert state.served_batch("b") is not None and state.served_batch("a") is None
    assert state.journal.durable
    state.journal.flush()
    with sqlite3.connect(journal_path) as db:
        rows = db.execute("SELECT COUNT(*) FROM rollouts").fetchone()[0]
        bodies = db.execute("SELECT COUNT(*) FROM rollouts WHERE data IS NOT NULL").fetchone()[0]
    assert rows == 2 * GROUP and bodies == 2 * GROUP
    # A resend after the window: its lease is forgotten, so it is refused, not counted again.
    late = state.ingest(posted[0], HOLDER)
    assert late.accepted == 0 and {r.reason for r in late.rejected} == {"unknown_or_expired_lease"}
    assert state.rollouts_accepted == 4 * GROUP


def test_a_journal_belongs_to_one_run(open_state: Callable[..., RunState], journal_path: str) -> None:
    state = open_state()
    assert state.journal.durable
    state.journal.close()
    with pytest.raises(JournalMismatch, match="holds the journal of run 'unit'"):
        Journal(journal_path, run_name="another")


def test_the_journal_is_in_wal_mode(open_state: Callable[..., RunState], journal_path: str) -> None:
    open_state()
    with sqlite3.connect(journal_path) as db:
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_writer_thread_group_commits_in_order(open_state: Callable[..., RunState], group: Any) -> None:
    state = open_state(max_staleness=100)  # room for 40 leases
    state.announce(0)
    journal = state.journal
    assert journal.durable
    commits: list[tuple[float, int]] = []
    journal.on_commit = lambda seconds, statements: commits.append((seconds, statements))

    async def scenario() -> list[int]:
        journal.start(asyncio.get_running_loop())
        order: list[int] = []

        async def one(i: int) -> None:
            (lease,) = state.grant_leases(HOLDER, 1)
            await journal.commit()
            order.append(i)

        await asyncio.gather(*(one(i) for i in range(40)))
        await journal.stop()
        return order

    order = asyncio.run(scenario())
    assert order == list(range(40))  # answered in the order the changes were made
    assert 1 <= len(commits) < 40  # many commits shared one transaction
    assert len(state.leases) == 40


def test_a_failed_write_fails_every_waiter_and_every_later_commit(
    open_state: Callable[..., RunState], monkeypatch: pytest.MonkeyPatch
) -> None:
    state = open_state()
    journal = state.journal
    assert journal.durable

    def broken(ops: Any) -> None:
        raise sqlite3.OperationalError("disk I/O error")

    async def scenario() -> None:
        journal.start(asyncio.get_running_loop())
        monkeypatch.setattr(journal, "_execute", broken)
        state.announce(0)
        with pytest.raises(JournalError, match="disk I/O error"):
            await journal.commit()
        state.announce(1)
        with pytest.raises(JournalError, match="failed earlier"):
            await journal.commit()
        await journal.stop()

    asyncio.run(scenario())
    assert journal.failed is not None


def test_acknowledged_only_after_the_commit_returns(
    open_state: Callable[..., RunState], group: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`commit()` resolves only once the transaction holding the caller's changes is committed."""
    state = open_state()
    journal = state.journal
    assert journal.durable
    committed = threading.Event()
    original = journal._execute

    def slow(ops: Any) -> None:
        threading.Event().wait(0.2)
        original(ops)
        committed.set()

    async def scenario() -> bool:
        journal.start(asyncio.get_running_loop())
        monkeypatch.setattr(journal, "_execute", slow)
        state.announce(0)
        (lease,) = state.grant_leases(HOLDER, 1)
        state.ingest(group(state, lease, 1), HOLDER)
        await journal.commit()
        seen = committed.is_set()
        await journal.stop()
        return seen

    assert asyncio.run(scenario()) is True


def test_every_rollout_field_survives_recovery(open_state: Callable[..., RunState], make_rollout: Any) -> None:
    state = open_state(model={"num_layers": 2, "moe": {"num_experts": 8, "top_k": 2}})  # two sparse layers
    state.announce(0)
    (lease,) = state.grant_leases(HOLDER, 1)
    rows = len(lease.prompt_token_ids) + 3 - 1  # every token fed: the prompt and all but the last completion token
    routes = {"layers": 2, "top_k": 2, "experts": [(i * 3 + i // 2) % 8 for i in range(rows * 2 * 2)]}
    full = make_rollout(
        lease, [4, 5, 2], token_versions=[0, 0, 0], sampling_mask=[[4, 5], [5], [2, 3]],
        expert_routing=routes, claimed_reward=0.25, finish_reason="length", logprob=-1 / 3,
    )
    assert state.ingest([full], HOLDER).accepted == 1
    assert state.journal.durable
    state.journal.flush()
    state = restart(state, open_state)
    assert state.leases[lease.lease_id].samples == [full]


VERIFY = {"orchestrator": {"verification": {"enabled": True, "new_worker_checks": 0, "spot_check_fraction": 0.0, "max_strikes": 2}}}


def test_strikes_bans_and_replay_hashes_survive_a_restart(
    open_state: Callable[..., RunState], group: Any, make_rollout: Any
) -> None:
    """Issue 8: a banned token stays banned, a struck one keeps its strikes, and content kept
    before the restart is still a replay after it; content of a lease that closed without
    training is forgotten on disk as in memory."""
    state = open_state(**VERIFY)
    state.announce(0)
    lease = state.grant_leases(HOLDER, 1)[0]
    kept = group(state, lease)
    assert state.ingest(kept, HOLDER).accepted == GROUP
    dropped = state.grant_leases(HOLDER, 1)[0]
    assert state.ingest(group(state, dropped, 1), HOLDER).accepted == 1
    state.release_lease(dropped.lease_id, HOLDER)  # closed without training: its hash goes
    cheat, struck = "mallory/w0", "eve/w0"
    future = state.grant_leases(cheat, 1)[0]
    for _ in range(2):  # a version not yet published: a strike each
        assert state.ingest([make_rollout(future, "1234", policy_version=5)], cheat).rejected[0].reason == "future_version"
    lying = state.grant_leases(struck, 1)[0]
    assert state.ingest([make_rollout(lying, [4, 5, 6])], struck).rejected[0].reason == "bad_finish_reason"  # "stop", no eos
    assert state.new_bans == ["mallory"]  # its leftovers dropped, its token to revoke
    state.journal.flush()
    with sqlite3.connect(state.journal.path) as conn:
        assert conn.execute("SELECT COUNT(*) FROM content").fetchone()[0] == 1  # identical samples: one hash

    state = restart(state, open_state, **VERIFY)
    workers = state.integrity.workers
    assert workers["mallory"].banned and workers["mallory"].strikes == 2
    assert workers["eve"].strikes == 1 and not workers["eve"].banned
    assert workers["alice"].rollouts == GROUP + 1 and workers["alice"].rejections == {}
    assert state.integrity.is_banned(cheat) and not state.new_bans  # revoked already, not again
    lease = state.grant_leases(cheat, 1)[0]
    assert state.ingest([make_rollout(lease, "1234")], cheat).rejected[0].reason == "banned"
    # The kept content again, under another lease and another version: a replay, after the restart too.
    state.announce(1)
    again = state.grant_leases(struck, 1)[0]
    state.leases[again.lease_id].lease = again = again.model_copy(
        update={"prompt_id": kept[0].prompt_id, "prompt_token_ids": kept[0].prompt_token_ids}
    )
    replay = [
        r.model_copy(update={"rollout_id": f"replay-{i}", "lease_id": again.lease_id, "policy_version": 1}) for i, r in enumerate(kept)
    ]
    assert {r.reason for r in state.ingest(replay[:1], struck).rejected} == {"replay"}
    assert state.integrity.workers["eve"].strikes == 2 and state.new_bans == ["eve"]


def test_samples_recovered_into_open_leases_are_all_checked(
    open_state: Callable[..., RunState], group: Any
) -> None:
    """Which samples were picked for a logprob check is not journaled: after a restart every
    recovered sample of an open lease is checked, and a group that was held back for its check
    when the orchestrator stopped is checked whole instead of never completing."""
    options = {"orchestrator": {"verification": {"enabled": True, "new_worker_checks": 1, "spot_check_fraction": 0.0}}}
    state = open_state(**options)
    state.announce(0)
    held, partial = state.grant_leases(HOLDER, 2)
    assert state.ingest(group(state, held), HOLDER).accepted == GROUP
    assert [len(job.rollouts) for job in state.verify_queue] == [1] and held.lease_id in state.pending
    assert state.ingest(group(state, partial, 2), HOLDER).accepted == 2
    state.journal.flush()

    state = restart(state, open_state, **options)
    assert held.lease_id in state.pending and not state.ready
    assert [(job.lease_id, len(job.rollouts)) for job in state.verify_queue] == [(held.lease_id, GROUP)]
    assert state.leases[partial.lease_id].check == [0, 1]
    state.verification_done({held.lease_id: {}})
    assert [g.lease_id for g in state.ready] == [held.lease_id]


def test_content_of_a_group_evicted_as_stale_is_forgotten_on_disk(
    open_state: Callable[..., RunState], group: Any
) -> None:
    """A group evicted from the buffer as stale closed without training: its content hashes go
    from the journal as from memory (they went with a release already, not with a stale drop)."""
    options = {"orchestrator": {"verification": {"enabled": True, "new_worker_checks": 0, "spot_check_fraction": 0.0}}}
    state = open_state(max_staleness=1, **options)
    state.announce(0)
    lease = state.grant_leases(HOLDER, 1)[0]
    assert state.ingest(group(state, lease), HOLDER).accepted == GROUP
    state.journal.flush()
    with sqlite3.connect(state.journal.path) as conn:
        assert conn.execute("SELECT COUNT(*) FROM content").fetchone()[0] == 1
    state.announce(2)  # evicted
    state.journal.flush()
    with sqlite3.connect(state.journal.path) as conn:
        assert conn.execute("SELECT COUNT(*) FROM content").fetchone()[0] == 0
    state = restart(state, open_state, max_staleness=1, **options)
    assert state.lease_state(lease.lease_id, HOLDER).state == "dropped" and not state.ready


# Recovery leaves what grows with the journal on disk (orchestrator/recovery.py): the rollout ids
# of closed leases, the closed leases outside the buffer and the kept batches, and the bodies of
# buffered groups until they are served. These tests hold it to answering as if it were in memory.
ON_DISK = {"max_staleness": 8, "trainer": {"groups_per_step": 1}, "orchestrator": {"batches_kept": 1}}


def test_resends_after_a_restart_are_duplicates_with_their_ids_on_disk_only(
    open_state: Callable[..., RunState], group: Any, make_rollout: Any
) -> None:
    state = open_state(**ON_DISK)
    state.announce(0)
    forgotten_batch, kept_batch, buffered, released, still_open = state.grant_leases(HOLDER, 5)
    posted = {lease.lease_id: group(state, lease) for lease in (forgotten_batch, kept_batch, buffered)}
    for rollouts in posted.values():
        assert state.ingest(rollouts, HOLDER).accepted == GROUP
    partial = group(state, released, 2)
    assert state.ingest(partial, HOLDER).accepted == 2
    state.release_lease(released.lease_id, HOLDER)
    assert state.take_batch(0) is not None and state.take_batch(0) is not None  # the first batch is no longer kept
    state.journal.flush()

    state = restart(state, open_state, **ON_DISK)
    on_disk = posted[forgotten_batch.lease_id] + posted[buffered.lease_id] + partial
    assert not any(r.rollout_id in state.lease_book.seen_rollout_ids for r in on_disk)  # not read back into memory
    resend = state.ingest(on_disk + posted[kept_batch.lease_id], HOLDER)
    assert (resend.accepted, resend.duplicates, resend.rejected) == (0, 3 * GROUP + 2, [])
    # A rollout id is acknowledged once, whatever lease a resend names.
    reused = make_rollout(still_open, "1234", rollout_id=posted[forgotten_batch.lease_id][0].rollout_id)
    assert state.ingest([reused], HOLDER).duplicates == 1
    assert state.ingest(group(state, still_open, 1), HOLDER).accepted == 1
    assert state.rollouts_accepted == 3 * GROUP + 2 + 1 and state.counters.duplicates == 3 * GROUP + 2 + 1
    # A restart after those: the new sample's id, now only on disk too, is a duplicate as well.
    state.journal.flush()
    state = restart(state, open_state, **ON_DISK)
    assert state.ingest(state.leases[still_open.lease_id].samples[:1], HOLDER).duplicates == 1


def test_closed_leases_left_on_disk_answer_and_are_forgotten_in_time(
    open_state: Callable[..., RunState], group: Any, clock: Any, journal_path: str
) -> None:
    options = {**ON_DISK, "orchestrator": {"batches_kept": 1, "dedupe_window_s": 30.0}}
    state = open_state(**options)
    state.announce(0)
    old, kept = state.grant_leases(HOLDER, 2)
    posted = group(state, old)
    assert state.ingest(posted, HOLDER).accepted == GROUP and state.ingest(group(state, kept), HOLDER).accepted == GROUP
    assert state.take_batch(0) is not None and state.take_batch(0) is not None
    state.journal.flush()

    state = restart(state, open_state, **options)
    assert old.lease_id not in state.lease_book.closed
    found = state.lease_state(old.lease_id, HOLDER)
    assert (found.state, found.samples, found.prompt_id) == ("served", GROUP, old.prompt_id)
    late = state.ingest(group(state, old, 1), HOLDER)  # a new sample for it: the lease is full
    assert [r.reason for r in late.rejected] == ["group_full"]
    clock.advance(31)
    assert state.forget_closed() == 1  # the old lease; the other is in the batch kept
    state.journal.flush()
    with sqlite3.connect(journal_path) as db:
        assert db.execute("SELECT COUNT(*) FROM rollouts").fetchone()[0] == GROUP
        assert db.execute("SELECT COUNT(*) FROM leases WHERE lease_id = ?", (old.lease_id,)).fetchone()[0] == 0
    resend = state.ingest(posted, HOLDER)  # after the window: refused, never counted again
    assert resend.accepted == 0 and {r.reason for r in resend.rejected} == {"unknown_or_expired_lease"}
    assert state.rollouts_accepted == 2 * GROUP


def test_buffered_groups_are_read_from_the_journal_when_served(
    open_state: Callable[..., RunState], group: Any
) -> None:
    state = open_state(**ON_DISK)
    state.announce(0)
    leases = state.grant_leases(HOLDER, 2)
    for i, lease in enumerate(leases):
        assert state.ingest(group(state, lease, wrong=i), HOLDER).accepted == GROUP
    expected = [
        (r.rollout_id, r.completion_token_ids, r.logprobs, reward, g.lease_id) for g in state.ready for r, reward in g.samples
    ]
    state.journal.flush()

    state = restart(state, open_state, **ON_DISK)
    assert [g.held for g in state.ready] == [None, None]  # not decoded at recovery
    served = []
    for _ in leases:
        batch = state.take_batch(0)
        assert batch is not None
        served += [(s.rollout_id, s.completion_token_ids, s.logprobs, s.reward, s.group_id) for s in batch.samples]
        assert state.batch_msgpack(batch) is not None
    assert served == expected
    assert state.take_batch(0) is None


def test_a_journal_from_before_the_oldest_version_column_is_upgraded(
    open_state: Callable[..., RunState], group: Any, journal_path: str
) -> None:
    state = open_state(max_staleness=1)
    state.announce(0)
    old = state.grant_leases(HOLDER, 1)[0]
    assert state.ingest(group(state, old), HOLDER).accepted == GROUP
    state.announce(1)
    new = state.grant_leases(HOLDER, 1)[0]
    assert state.ingest(group(state, new, policy_version=1), HOLDER).accepted == GROUP
    state.journal.flush()
    state.journal.close()
    with sqlite3.connect(journal_path) as db:
        db.execute("ALTER TABLE leases DROP COLUMN oldest_version")

    state = open_state(max_staleness=1)  # adds the column, filled in for the groups in the buffer
    assert [(g.lease_id, g.oldest_version, g.held) for g in state.ready] == [(old.lease_id, 0, None), (new.lease_id, 1, None)]
    state.announce(2)  # version-0 samples are now too old
    assert [g.lease_id for g in state.ready] == [new.lease_id]
