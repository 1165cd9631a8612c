"""The orchestrator's parts, each on its own: no RunState, no sibling part, a fake clock.

RunState (orchestrator/state.py) owns the parts and applies what they decide; these tests hold
each part to its own promises. The journal is the no-op one (what is journaled, and recovered,
is tests/orchestrator/test_orchestrator_journal.py's).
"""

from __future__ import annotations

import dataclasses
import uuid
from typing import Any

import pytest
from pydantic import ValidationError
from transformers import PreTrainedTokenizerBase

from decentrl.api.wire import MASK_IDS, Lease, Rollout, RolloutBatch, SamplingParams, ScoreItem, ScorePost, ScoreResult, problems
from decentrl.config import AdvantageConfig, HedgingConfig, RewardConfig, VerificationConfig
from decentrl.model.stopping import ends_generation
from decentrl.rl.determinism import required_version
from decentrl.tasks import build_task
from orchestrator.batches import KeptBatches, build_batch
from orchestrator.buffer import Buffer, Group, VerifyJob
from orchestrator.checks import IngestChecks
from orchestrator.events import ClosedStatus
from orchestrator.handlers import mask_bound
from orchestrator.integrity import Integrity, content_hash
from orchestrator.journal import NullJournal
from orchestrator.lease_policy import MIN_RECENT, Deterministic, FreeRunning, Hedges, Places
from orchestrator.lease_table import LeaseClosed, LeaseNotFound, LeaseTable, NotLeaseHolder
from orchestrator.leases import ClosedLease, LeaseBook, OpenLease, PromptQueue
from orchestrator.reward_stage import ModelRewards, VerifierRewards
from orchestrator.rewards import Rewards
from orchestrator.score_queue import ScoreError, ScoreQueue

HOLDER = "alice/w0"


def lease(lease_id: str, prompt_id: int = 0, group_size: int = 2) -> Lease:
    return Lease(lease_id=lease_id, prompt_id=prompt_id, prompt_token_ids=[1, 2], group_size=group_size, deadline=0.0)


def group(make_rollout: Any, lease_id: str, rewards: list[float], *, version: int = 0, seq: int = 0) -> Group:
    rollouts = [make_rollout(lease(lease_id), [5, 6], policy_version=version) for _ in rewards]
    return Group.of(lease_id, 0, rollouts, rewards, seq)


# -- the buffer -------------------------------------------------------------------------------


def test_a_pending_group_keeps_its_place_in_the_queue(make_rollout: Any, clock: Any) -> None:
    buffer = Buffer(journal=NullJournal(), clock=clock)
    first, second, third = (group(make_rollout, name, [1.0, 0.0]) for name in "abc")
    job = VerifyJob("a", first.rollouts, HOLDER)
    buffer.to_pending(first, check=job, scores=True)
    buffer.to_ready(second)
    buffer.to_ready(third)
    assert [g.lease_id for g in buffer.ready] == ["b", "c"] and list(buffer.verify_queue) == [job]
    assert buffer.pending_ahead(1)  # a batch of one would skip "a": it waits
    assert buffer.done_waiting("a", "check") is None  # still waits for its scores
    assert buffer.waits_for("a", "scores") and not buffer.waits_for("a", "check")
    released = buffer.done_waiting("a", "scores")
    assert released is first and buffer.pending == {}
    buffer.to_ready(first)
    assert [g.lease_id for g in buffer.ready] == ["a", "b", "c"]  # back in its place, ahead of later groups
    assert [g.lease_id for g in buffer.take_front(2)] == ["a", "b"] and buffer.waiting() == 1


def test_evicted_and_released_groups_leave_with_their_checks(make_rollout: Any, clock: Any) -> None:
    buffer = Buffer(journal=NullJournal(), clock=clock)
    old, new = group(make_rollout, "old", [1.0], version=0), group(make_rollout, "new", [1.0], version=3)
    waiting = group(make_rollout, "waiting", [1.0], version=0)
    buffer.to_ready(old)
    buffer.to_ready(new)
    buffer.to_pending(waiting, check=VerifyJob("waiting", waiting.rollouts, HOLDER))
    assert buffer.evict(lambda g: g.oldest_version < 2) == [old]
    assert buffer.release_pending(lambda g: g.oldest_version < 2) == [waiting]
    assert list(buffer.ready) == [new] and not buffer.verify_queue and not buffer.pending


def test_a_deterministic_group_joins_the_queue_at_its_place(make_rollout: Any, clock: Any) -> None:
    buffer = Buffer(journal=NullJournal(), clock=clock)
    for name, seq in [("p3", 3), ("p1", 1), ("p2", 2)]:
        buffer.to_ready(group(make_rollout, name, [0.5], seq=seq))
    assert [g.seq for g in buffer.ready] == [1, 2, 3]


# -- batches ----------------------------------------------------------------------------------


def test_a_batch_has_group_advantages_and_a_staleness_histogram(make_rollout: Any) -> None:
    groups = [group(make_rollout, "a", [1.0, 0.0], version=2), group(make_rollout, "b", [0.5, 0.5], version=1)]
    batch = build_batch(
        groups, trainer_version=2, batch_id="x", advantages=AdvantageConfig(), rollouts_accepted=4, stale_dropped=0
    )
    advantages = [sample.advantage for sample in batch.samples]
    assert advantages[0] > 0 > advantages[1] and advantages[2:] == [0.0, 0.0]  # a group without signal has none
    assert batch.staleness_histogram == {"0": 2, "1": 2}
    assert [sample.group_id for sample in batch.samples] == ["a", "a", "b", "b"]


def test_kept_batches_answer_a_re_ask_and_forget_the_oldest(make_rollout: Any, clock: Any) -> None:
    kept = KeptBatches(batches_kept=2, journal=NullJournal(), clock=clock)
    served = []
    for index in range(3):
        groups = [group(make_rollout, f"g{index}", [1.0, 0.0])]
        batch = build_batch(
            groups, trainer_version=0, batch_id=f"b{index}", advantages=AdvantageConfig(), rollouts_accepted=0, stale_dropped=0
        )
        kept.served_now(f"r{index}", batch, groups)
        served.append(batch)
    assert kept.retried("r0") is None  # beyond batches_kept
    assert kept.retried("r2") is served[2] and kept.leases == {"g1", "g2"}
    assert kept.msgpack(served[2]) is not None and kept.msgpack(served[0]) is None


# -- the lease table --------------------------------------------------------------------------


@pytest.fixture
def lease_table(make_config: Any, tokenizer: Any, clock: Any) -> tuple[LeaseBook, list[tuple[ClosedLease, str, int]]]:
    config = make_config(orchestrator={"lease_timeout_s": 10.0})
    task = build_task(config.task)
    dropped: list[tuple[ClosedLease, str, int]] = []
    prompts = PromptQueue(task=task, render=lambda prompt: tokenizer(prompt.text).input_ids, seed=0)
    book = LeaseBook(
        config=config, prompts=prompts, journal=NullJournal(), clock=clock, on_dropped=lambda *args: dropped.append(args),
        policy=FreeRunning(prompts=prompts),
    )
    return book, dropped


def test_no_lease_before_a_version_is_published_then_the_budget_bounds_them(lease_table: Any) -> None:
    book, _ = lease_table
    assert book.capacity(published=None, groups_consumed=0, waiting=0) == 0
    room = book.capacity(published=0, groups_consumed=0, waiting=0)
    assert room > 0
    book.grant(HOLDER, room)
    assert book.capacity(published=0, groups_consumed=0, waiting=0) == 0


def test_an_overdue_lease_expires_its_prompt_goes_out_first_and_its_drop_is_reported(
    lease_table: Any, clock: Any, make_rollout: Any
) -> None:
    book, dropped = lease_table
    (first,) = book.grant(HOLDER, 1)
    book.open[first.lease_id].samples.append(make_rollout(first, [5, 6]))
    clock.advance(5.0)
    book.renew(first.lease_id, HOLDER)
    clock.advance(9.0)
    assert book.expire() == 0  # renewed: its deadline moved
    clock.advance(2.0)
    assert book.expire() == 1
    (closed, reason, samples), = dropped
    assert closed.lease.lease_id == first.lease_id and reason == "lease_expired" and samples == 1
    (again,) = book.grant(HOLDER, 1)
    assert again.prompt_id == first.prompt_id  # its prompt goes out again first


def test_only_the_holder_may_act_on_a_lease(lease_table: Any) -> None:
    book, _ = lease_table
    (granted,) = book.grant(HOLDER, 1)
    with pytest.raises(NotLeaseHolder):
        book.renew(granted.lease_id, "bob/w1")
    with pytest.raises(LeaseNotFound):
        book.renew("no-such-lease", HOLDER)
    assert book.release(granted.lease_id, HOLDER).state == "released"


def test_the_table_gives_each_overdue_lease_once_and_skips_renewed_and_closed_ones(clock: Any) -> None:
    table: LeaseTable[OpenLease] = LeaseTable(timeout_s=5.0, clock=clock, what="lease", others="worker", missing="gone")
    for name in "abc":
        table.add(name, OpenLease(lease=lease(name).model_copy(update={"deadline": table.deadline()}), holder=HOLDER))
        clock.advance(1.0)
    table.add("a", table["a"])  # the same deadline again: two entries, one lease
    table.renew("b")
    del table["c"]  # closed
    clock.advance(5.0)
    assert table.overdue() == ["a"]
    clock.advance(5.0)
    assert table.overdue() == ["b"]


def test_the_owner_check_names_the_lease_and_who_else_holds_such_leases(clock: Any) -> None:
    table: LeaseTable[OpenLease] = LeaseTable(timeout_s=5.0, clock=clock, what="lease", others="worker", missing="gone")
    found = OpenLease(lease=lease("x"), holder=HOLDER)
    table.add("x", found)
    assert table.owned("x", HOLDER) is found
    with pytest.raises(NotLeaseHolder, match="lease 'x' is held by another worker"):
        table.owned("x", "bob/s1")
    closed = ClosedLease(lease("y"), HOLDER, "expired", 0.0, 0)
    assert table.owned("y", HOLDER, closed) is closed
    with pytest.raises(LeaseNotFound, match="no lease 'z': gone"):
        table.owned("z", HOLDER)


# -- hedging (the deterministic lease policy's timing rule) ------------------------------------


def test_a_lagging_place_of_the_next_batch_is_due_a_copy_for_another_worker(clock: Any) -> None:
    """Due after the wait its recent lease times give; the last open place of the batch at once."""
    hedges = Hedges(config=HedgingConfig(enabled=True), groups_per_step=2, clock=clock)
    for lease_s in [1.0] * (MIN_RECENT - 2) + [9.0, 9.0]:  # a tail: a lease out long is likely a straggler
        hedges.completed(lease_s)
    assert hedges.wait is not None
    leases = {name: OpenLease(lease=lease(name), holder=HOLDER, granted_at=clock()) for name in "xy"}
    places = Places(open={0: {"x": leases["x"]}, 1: {"y": leases["y"]}}, head=0, cursor=2, requeued=[])
    assert hedges.pick("bob/w1", 1, places) == [] and hedges.due_in("bob/w1", places) == pytest.approx(hedges.wait)
    clock.advance(hedges.wait + 0.1)
    assert hedges.pick("bob/w1", 1, places) == [0]
    assert hedges.pick(HOLDER, 2, places) == []  # never a second copy for the holder of the first
    last = Places(open={1: {"y": leases["y"]}}, head=0, cursor=2, requeued=[])
    assert Hedges(config=HedgingConfig(enabled=True), groups_per_step=2, clock=clock).pick("bob/w1", 1, last) == [1]


# -- the lease policies (the lease book's seam, and what RunState asks) -----------------------


@pytest.fixture
def prompts(make_config: Any, tokenizer: Any) -> PromptQueue:
    task = build_task(make_config().task)
    return PromptQueue(task=task, render=lambda prompt: tokenizer(prompt.text).input_ids, seed=0)


@pytest.fixture
def deterministic(make_config: Any, prompts: PromptQueue, clock: Any) -> Deterministic:
    """groups_per_step 2, max_staleness 1, hedging on (its defaults)."""
    return Deterministic(config=make_config(deterministic=True), prompts=prompts, clock=clock, digest=content_hash)


def held(policy: Deterministic, holder: str = HOLDER, *, copy_of: OpenLease | None = None) -> OpenLease:
    """An open lease of the policy's next place, or another copy of `copy_of`'s, as the book holds it."""
    if copy_of is None:
        prompt_id, index, version = policy.next()
        granted = Lease(lease_id="", prompt_id=prompt_id, prompt_token_ids=[1, 2], group_size=2, deadline=0.0,
                        index=index, policy_version=version)
    else:
        granted = copy_of.lease
    open_lease = OpenLease(lease=granted.model_copy(update={"lease_id": uuid.uuid4().hex}), holder=holder)
    policy.held(open_lease)
    return open_lease


def closed_as(policy: Deterministic, open_lease: OpenLease, status: ClosedStatus) -> ClosedLease:
    closed = ClosedLease(open_lease.lease, open_lease.holder, status, 0.0, len(open_lease.samples))
    policy.closed(closed, "front")  # a caller's wish, which a deterministic run does not follow
    return closed


def test_places_go_out_in_order_and_back_in_line_lowest_first_once_their_last_copy_closes(
    deterministic: Deterministic, prompts: PromptQueue
) -> None:
    policy = deterministic
    first, second, third = (held(policy) for _ in range(3))
    assert [(o.lease.index, o.lease.prompt_id, o.lease.policy_version) for o in (first, second, third)] == [
        (i, prompts.order[i], required_version(i, groups_per_step=2, max_staleness=1)) for i in range(3)
    ]
    copy = held(policy, "bob/w1", copy_of=first)
    assert policy.leased(4) == 3  # the budget counts places, not copies
    closed_as(policy, first, "expired")
    assert list(prompts.requeued) == []  # bob's copy of place 0 is still out
    closed_as(policy, third, "released")
    closed_as(policy, copy, "dropped")
    assert list(prompts.requeued) == [0, 2] and policy.leased(1) == 1
    complete = closed_as(policy, second, "complete")
    policy.closed(dataclasses.replace(complete, status="skipped"), None)  # consumed by a step: never again
    assert list(prompts.requeued) == [0, 2] and policy.places == {}
    assert [policy.next()[1] for _ in range(3)] == [0, 2, 3]


def test_the_first_copy_fills_its_place_and_the_losers_are_told_once_and_forgotten(
    deterministic: Deterministic, make_rollout: Any
) -> None:
    policy = deterministic
    slow = held(policy)
    fast = held(policy, "bob/w1", copy_of=slow)
    samples = [make_rollout(fast.lease, [5, 6], sample_index=j) for j in range(2)]
    fast.samples = samples
    slow.samples = [make_rollout(slow.lease, [5, 6], sample_index=0, logprob=-2.0)]  # not bit for bit bob's
    closed = {fast.lease.lease_id: closed_as(policy, fast, "complete")}
    assert policy.filled(fast) == ([slow.lease.lease_id], 1)  # to close as superseded; one sample differs
    closed[slow.lease.lease_id] = closed_as(policy, slow, "superseded")
    assert policy.places == {} and policy.untold == {HOLDER: {slow.lease.lease_id: None}}

    late = make_rollout(slow.lease, [5, 6], sample_index=1)
    assert policy.lost(late, "bob/w1", closed.get) is None  # not bob's copy
    assert policy.lost(make_rollout(fast.lease, [5, 6], sample_index=1), "bob/w1", closed.get) is None  # the winner
    assert policy.lost(late, HOLDER, closed.get) == 0  # a duplicate, the same as the winner's sample 1
    assert policy.untold == {} and policy.tell(HOLDER) == []  # posting it, alice finished it: nothing to tell

    other = held(policy)
    copy = held(policy, "bob/w1", copy_of=other)
    copy.samples = [make_rollout(copy.lease, [5, 6], sample_index=j) for j in range(2)]
    closed_as(policy, copy, "complete")
    assert policy.filled(copy) == ([other.lease.lease_id], 0)
    lost = closed_as(policy, other, "superseded")
    assert policy.tell(HOLDER) == [other.lease.lease_id] and policy.tell(HOLDER) == []  # told once
    policy.forgotten(lost)
    policy.forgotten(closed[slow.lease.lease_id])
    assert policy.winners == {} and policy.untold == {}


def test_a_free_running_run_leases_the_prompt_queue_in_order_and_requeues_as_asked(prompts: PromptQueue) -> None:
    policy = FreeRunning(prompts=prompts)
    first, second = (Lease(lease_id=name, prompt_id=policy.next()[0], prompt_token_ids=[1], group_size=2, deadline=0.0)
                     for name in "ab")
    assert [first.prompt_id, second.prompt_id] == prompts.order[:2] and policy.next()[1:] == (None, None)
    policy.closed(ClosedLease(first, HOLDER, "expired", 0.0, 0), "back")
    policy.closed(ClosedLease(second, HOLDER, "released", 0.0, 0), "front")
    policy.closed(ClosedLease(second, HOLDER, "dropped", 0.0, 0), None)  # not asked: not leased again
    assert [policy.next()[0] for _ in range(3)] == [second.prompt_id, first.prompt_id, prompts.order[3]]
    assert policy.leased(5) == 5 and policy.copies(HOLDER, 4, 0) == [] and policy.filled(OpenLease(first, HOLDER)) == ([], 0)


# -- integrity and the size bounds ------------------------------------------------------------


def test_strikes_ban_a_token_once_and_a_replay_under_another_version_is_caught(make_rollout: Any) -> None:
    integrity = Integrity(VerificationConfig(enabled=True, max_strikes=2))
    integrity.rejected(HOLDER, "replay")
    assert not integrity.is_banned(HOLDER)
    integrity.rejected("alice/w1", "future_version")  # the same token, another worker id
    assert integrity.is_banned(HOLDER) and integrity.newly_banned() == ["alice"] and integrity.newly_banned() == []
    sample: Rollout = make_rollout(lease("a"), [5, 6], policy_version=1)
    digest = integrity.replay_of(sample)
    assert digest is not None
    integrity.kept("a", digest, 1)
    assert integrity.replay_of(make_rollout(lease("b"), [5, 6], policy_version=2)) is None  # other lease, other version
    assert integrity.replay_of(make_rollout(lease("b"), [5, 6], policy_version=1)) is not None  # same version: honest
    integrity.forget_lease("a")
    assert integrity.replay_of(make_rollout(lease("b"), [5, 6], policy_version=2)) is not None


def test_a_mask_wider_than_top_k_is_named_with_the_limit(make_rollout: Any) -> None:
    sampling = SamplingParams(temperature=1.0, max_tokens=8, top_k=2)
    fine: Rollout = make_rollout(lease("a"), [5, 6], sampling=sampling, sampling_mask=[[1, 2], [3]])
    wide: Rollout = make_rollout(lease("a"), [5, 6], sampling=sampling, sampling_mask=[[1, 2, 3], [3]])
    context = {MASK_IDS: mask_bound(sampling, vocab_size=100)}
    RolloutBatch.model_validate({"rollouts": [fine.model_dump()]}, context=context)
    with pytest.raises(ValidationError) as raised:
        RolloutBatch.model_validate({"rollouts": [fine.model_dump(), wide.model_dump()]}, context=context)
    problem = problems(raised.value)
    assert problem.startswith("rollouts.1.sampling_mask: Value error, keeps 3 ids") and "top_k=2" in problem
    assert mask_bound(SamplingParams(temperature=1.0, max_tokens=8), vocab_size=100)[0] == 100  # no top-k: the vocabulary



# -- the ingest checks and verification's hook, each alone --------------------------------------


def test_the_checks_judge_a_rollout_from_what_the_owner_looked_up(
    make_config: Any, make_rollout: Any, tokenizer: PreTrainedTokenizerBase,
) -> None:
    config = make_config(orchestrator={"verification": {"enabled": True}})
    sampling = SamplingParams(**config.sampling.model_dump())
    checks = IngestChecks(
        config=config, task=build_task(config.task), sampling=sampling, vocab_size=len(tokenizer),
        ends=lambda ids: ends_generation(ids, eos_ids={tokenizer.eos_token_id}, stops=sampling.stop, text_of=tokenizer.decode),
        episode_codec=None, verdicts=lambda rollout: None,
    )
    granted = lease("a", group_size=3)
    held = OpenLease(lease=granted, holder=HOLDER)
    sample: Rollout = make_rollout(granted, "1234", sampling=sampling, policy_version=1)

    def reason(rollout: Rollout, *, lease: OpenLease | None = held, closed: str | None = None, published: int = 1,
               trainer: int = 1, holder: str = HOLDER) -> str | None:
        return checks.reason(rollout, holder, lease=lease, closed=closed, published=published, trainer=trainer)

    assert reason(sample) is None
    assert reason(sample, lease=None) == "unknown_or_expired_lease"
    assert reason(sample, lease=None, closed="superseded") == "hedge_lost"
    assert reason(sample, holder="bob/w0") == "not_lease_holder"
    assert reason(sample, published=0) == "future_version"
    assert reason(sample, trainer=3) == "stale"  # max_staleness 1
    assert reason(sample.model_copy(update={"completion_token_ids": [len(tokenizer)] * 2})) == "token_out_of_vocabulary"
    # "stop" needs the last token to end the generation (verification on): a cut completion does not.
    assert reason(sample.model_copy(update={"completion_token_ids": sample.completion_token_ids[:-1]})) == "bad_finish_reason"


def test_verification_admits_refuses_and_counts_at_one_hook(make_rollout: Any) -> None:
    integrity = Integrity(VerificationConfig(enabled=True, max_strikes=2, new_worker_checks=1, spot_check_fraction=0.0))
    first: Rollout = make_rollout(lease("a"), [5, 6], policy_version=1)
    assert integrity.admit(first, HOLDER, None) == (None, True)  # kept; a new token's first rollout is checked
    assert integrity.admit(make_rollout(lease("a"), [5, 7], policy_version=1), HOLDER, None) == (None, False)
    replay: Rollout = make_rollout(lease("b"), [5, 6], policy_version=2)
    assert integrity.admit(replay, HOLDER, None) == ("replay", False)  # a strike
    assert integrity.admit(first, HOLDER, "future_version") == ("future_version", False)  # the second: banned
    assert integrity.is_banned(HOLDER) and integrity.admit(first, "alice/w9", None) == ("banned", False)
    assert integrity.summary()["alice"]["rejections"] == {"replay": 1, "future_version": 1, "banned": 1}


# -- the score queue and the reward stage, each alone -----------------------------------------


def score_items(lease_id: str, n: int) -> list[ScoreItem]:
    return [ScoreItem(rollout_id=f"{lease_id}-{i}", prompt_id=0, prompt="p", completion=f"c{i}") for i in range(n)]


def test_the_score_queue_leases_reassigns_and_names_the_groups_a_post_completes(clock: Any) -> None:
    alive = {"g1", "g2"}
    queue = ScoreQueue(config=RewardConfig(type="model", lease_timeout_s=5.0), journal=NullJournal(), clock=clock,
                       alive=alive.__contains__)
    queue.add("g1", score_items("g1", 2), {})
    queue.add("g2", score_items("g2", 1), {"g2-0": ScoreResult(rollout_id="g2-0", score=0.5)})  # taken before a restart
    assert queue.complete("g2") and not queue.complete("g1")
    slow = queue.lease("bob/s0", max_items=8)
    assert slow is not None and slow.rollout_ids == ["g1-0", "g1-1"] and queue.lease("bob/s1", 8) is None
    clock.advance(6.0)  # the lease expires: its items go to another scorer
    fast = queue.lease("carol/s0", max_items=8)
    assert fast is not None and fast.rollout_ids == ["g1-0", "g1-1"] and queue.summary()["scores_reassigned"] == 2
    with pytest.raises(LeaseClosed):
        queue.post("bob/s0", ScorePost(lease_id=slow.lease_id, scorer_id="s0", scores=[ScoreResult(rollout_id="g1-0", score=1.0)]))
    with pytest.raises(ScoreError, match="outside score_range"):  # all or nothing: no score of it is taken
        queue.post("carol/s0", ScorePost(lease_id=fast.lease_id, scorer_id="s0", scores=[
            ScoreResult(rollout_id="g1-0", score=1.0), ScoreResult(rollout_id="g1-1", score=7.0)]))
    ack, done, _ = queue.post("carol/s0", ScorePost(lease_id=fast.lease_id, scorer_id="s0", scores=[
        ScoreResult(rollout_id="g1-0", score=1.0), ScoreResult(rollout_id="g1-1", score=0.0)]))
    assert (ack.accepted, ack.unscored, done) == (2, 0, ["g1"])
    assert [r.score for r in queue.take("g1")] == [1.0, 0.0] and "g1" not in queue.groups


def test_the_reward_stages_reward_at_once_or_wait_and_combine(
    make_rollout: Any, make_config: Any, clock: Any, tokenizer: PreTrainedTokenizerBase,
) -> None:
    config = make_config(orchestrator={"rewards": {"type": "sum", "verifier_weight": 1.0, "model_weight": 0.5}})
    task = build_task(config.task)
    rewards = Rewards(task=task, tokenizer=tokenizer, decode=lambda seqs: ["" for _ in seqs], ends=lambda ids: False,
                      rewards=config.orchestrator.rewards, prompt=config.prompt, steps=config.orchestrator.advantages.steps)
    at_once = group(make_rollout, "v", [0.3, 0.3])
    assert VerifierRewards(rewards).start(at_once) and at_once.rewards == [0.0, 0.0]  # empty answers are wrong
    queue = ScoreQueue(config=config.orchestrator.rewards, journal=NullJournal(), clock=clock, alive=lambda _: True)
    stage, waiting = ModelRewards(rewards, queue), group(make_rollout, "m", [0.0, 0.0])
    assert not stage.start(waiting) and waiting.verifier_rewards == [0.0, 0.0] and len(queue.queue) == 2
    entry = queue.lease("carol/s0", 8)
    assert entry is not None
    queue.post("carol/s0", ScorePost(lease_id=entry.lease_id, scorer_id="s0", scores=[
        ScoreResult(rollout_id=r, score=s) for r, s in zip(entry.rollout_ids, [1.0, 0.0], strict=True)]))
    assert stage.finish(waiting) and waiting.rewards == [0.5, 0.0]  # verifier + 0.5 x model
