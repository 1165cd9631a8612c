"""RunState: the one owner of the orchestrator's run: it holds the run's state, drives the stages
and applies what they decide. Plain synchronous code without HTTP, called from the event loop (one
thread, no locks) by the handlers, the verification scheduler, metrics and benchmarks, which read
the parts under the names declared at its top; it builds the /v1/status answer. Its parts
(docs/architecture.md) hold none of the others, except the lease book (the lease policy, its one
seam). `ingest` is the pipeline of one POST /v1/rollouts; a group leaves the buffer untrained only
through `_drop`, a pending one through `_release`.

Invariants:
- rewards come from the task's verifier and/or scorers, never the worker's claim; a group waiting
  for scores counts toward the staleness budget and is dropped (`stale_waiting_scores`) if it goes stale;
- a group is served at most once, and only if every sample is fresh for the trainer's version;
- a deterministic run's batch s is the groups at places s*places_per_step onwards of the
  consumption order (`pick_signal` with dynamic sampling), in that order, whatever order they completed in;
- no more groups are leased than can train before going stale (`lease_budget`), nor than
  `orchestrator.max_buffer_groups` allows (ready groups + open leases);
- every lease closes through `LeaseBook.close` (journaled; drops counted; content forgotten).
"""

from __future__ import annotations

import functools
import logging
import time
import uuid
from collections import Counter, deque
from collections.abc import Callable, Sequence
from operator import attrgetter
from typing import TYPE_CHECKING, Any

from decentrl.api.encoding import MEDIA_MSGPACK, encode_model, unpack_msgpack
from decentrl.api.wire import (
    IngestResponse,
    Lease,
    LeaseState,
    PartialStep,
    Rejection,
    RolesUnit,
    Rollout,
    SamplingParams,
    ScoreAck,
    ScorePost,
    ScoreRenewal,
    StaleReport,
    StatusResponse,
    StepAck,
    StepPost,
    TrainBatch,
    TreeUnit,
    VerdictList,
)
from decentrl.config import RunConfig
from decentrl.model.build import end_of_sequence_ids
from decentrl.model.stopping import ends_generation
from decentrl.rl.staleness import is_fresh
from decentrl.tasks import Task
from decentrl.tasks.episodes import EpisodeTask, tokenizer_codec
from decentrl.tasks.guard import reward_failures
from decentrl.tasks.prompts import make_prompt_encoder
from decentrl.tasks.propose import ProposeTask
from orchestrator.batches import KeptBatches, build_batch, pick_signal, roles_outcome, shaped_rewards
from orchestrator.buffer import Buffer, Group, VerifyJob, Wait
from orchestrator.checks import IngestChecks
from orchestrator.counters import Counters, Tally, Versions
from orchestrator.events import RolloutAccepted, StepTaken, VerdictTaken
from orchestrator.integrity import Integrity, content_hash, token_of
from orchestrator.journal import Journal, NullJournal, RunJournal
from orchestrator.lease_policy import Deterministic, FreeRunning
from orchestrator.lease_table import LeaseClosed
from orchestrator.leases import SOLVER, ClosedLease, LeaseBook, OpenLease, PromptQueue, Requeue
from orchestrator.recovery import meta_row, recover
from orchestrator.reward_stage import ModelRewards, RolesRewards, VerifierRewards
from orchestrator.rewards import Rewards
from orchestrator.roles import Roles, oldest_by_policy, part
from orchestrator.score_queue import ScoreLeaseEntry, ScoreQueue, StepBook, StepError, StepVerdictTaken
from orchestrator.tokenizer import make_decoder, make_encoder

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from decentrl.model.tokenizer import RustTokenizer

# Re-exported: orchestrator/verification.py runs the jobs.
__all__ = ["RunState", "VerifyJob"]

log = logging.getLogger("decentrl.orchestrator.state")

# Drop reasons that are staleness (also counted in `stale_dropped`).
STALE_REASONS = frozenset({"stale_in_buffer", "stale_at_ingest", "stale_waiting_scores"})


def _alias(path: str, *, settable: bool = False) -> Any:
    """A property reading `self.<path>`; `settable`: one that replaces the field whole."""
    owner, name = path.rsplit(".", 1)

    def replace(self: RunState, value: object) -> None:
        setattr(attrgetter(owner)(self), name, value)

    return property(attrgetter(path), replace if settable else None)


def journaled_verdicts(
    steps: dict[str, list[tuple[str, int, bytes, float | None, int | None]]],
) -> Callable[[Rollout], list[float | None] | None]:
    """After a restart: the verdicts on every journaled step, as a finished sample's steps
    (StepBook.verdicts_of), for the groups recovered complete or in a kept batch."""
    book = StepBook()
    for lease_id, rows in steps.items():
        for rollout_id, _, data, score, seq in rows:
            step = book.add(lease_id, "", PartialStep.model_validate(unpack_msgpack(data))).steps[-1]
            if score is not None:
                book.judged(StepVerdictTaken(lease_id, rollout_id, step.step, score), seq)
    return book.verdicts_of

class RunState:
    # Parts' fields under the names handlers, metrics and tests use.
    buffer_limit: int = _alias("config.orchestrator.max_buffer_groups")
    sampling: SamplingParams = _alias("checks.sampling", settable=True)
    published_version: int | None = _alias("versions.published")
    trainer_version: int = _alias("versions.trainer")
    leases: dict[str, OpenLease] = _alias("lease_book.open")
    ready: deque[Group] = _alias("buffer.ready")
    pending: dict[str, Group] = _alias("buffer.pending")
    verify_queue: deque[VerifyJob] = _alias("buffer.verify_queue")
    rollouts_accepted: int = _alias("counters.rollouts_accepted")
    rejected: Counter[str] = _alias("counters.rejected")
    dropped: Counter[str] = _alias("counters.dropped")
    stale_dropped: int = _alias("counters.stale_dropped")
    groups_served: int = _alias("counters.groups_served")
    leases_expired: int = _alias("counters.leases_expired")

    def __init__(
        self,
        *,
        config: RunConfig,
        task: Task | EpisodeTask,
        tokenizer: PreTrainedTokenizerBase | RustTokenizer,
        clock: Callable[[], float] = time.time,
        journal: Journal | None = None,
    ) -> None:
        """With a `journal` that holds this run, the state is recovered from it at once."""
        options = config.orchestrator
        if options.max_buffer_groups < config.places_per_step:
            raise ValueError(
                f"orchestrator.max_buffer_groups ({options.max_buffer_groups}) must be at least the groups a step "
                f"consumes ({config.places_per_step}: trainer.groups_per_step, times "
                "orchestrator.dynamic_sampling.oversample when it is on), or no batch could ever form"
            )
        if config.deterministic and isinstance(task, EpisodeTask):
            raise ValueError(
                "deterministic = true supports single-turn tasks only (docs/reproducibility.md): "
                "set deterministic = false for a multi-turn task"
            )
        self.config = config
        self.task = task
        self.tokenizer = tokenizer
        self.clock = clock
        self.journal: RunJournal = journal if journal is not None else NullJournal()
        self.started_at = clock()
        self.vocab_size = len(tokenizer)
        decode = self._decode = make_decoder(tokenizer)
        render_prompt = make_prompt_encoder(config.prompt, tokenizer, task, raw=make_encoder(tokenizer))
        sampling = SamplingParams(**config.sampling.model_dump())
        # What ends a generation, for the finish-reason and turn-end checks: the ids the worker
        # backends stop at (tokenizer and generation config), leniently any special token, and
        # the run's stop strings.
        ends = functools.partial(
            ends_generation, eos_ids=end_of_sequence_ids(config.model, tokenizer) | set(tokenizer.all_special_ids),
            stops=sampling.stop, text_of=lambda ids: decode([ids])[0],
        )

        self.versions = Versions()
        # A run of two policies: a stream of versions each (the solver's is `versions`, which status and
        # metrics show); a sample is judged fresh against its own policy's (`stream`).
        self.streams: dict[str, Versions] = {name: self.versions if name == SOLVER else Versions() for name in config.policies}
        self.counters = Counters()
        # Changes a waiting lease request may be waiting for, since the start: a lease closed
        # without training (its prompt or place free again; a losing copy to tell its holder), or a
        # place due for a copy right away. The rollouts handler wakes the lease long-polls on more.
        self.leases_changed = 0
        self.integrity = Integrity(options.verification, journaled=self.journal.durable)
        self.rewards = Rewards(
            task=task, tokenizer=tokenizer, decode=decode, ends=ends, rewards=options.rewards, prompt=config.prompt,
            steps=options.advantages.steps, token_ids=options.advantages.distill is not None,
        )
        # Units of roles ([orchestrator.roles]): the reward stage derives solver nodes, the lease policy leases them.
        roles = (
            RolesRewards(self.rewards, task, render_prompt, solver_policy=SOLVER if config.policies else None)
            if isinstance(task, ProposeTask) else None
        )
        prompts = PromptQueue(task=task, render=render_prompt, seed=config.task.seed)
        self.lease_policy: FreeRunning | Deterministic | Roles = (
            Deterministic(config=config, prompts=prompts, clock=clock, digest=content_hash) if config.deterministic
            else Roles(prompts=prompts, config=options.roles, clock=clock, derive=roles.derive)
            if roles is not None and options.roles is not None
            else FreeRunning(prompts=prompts)
        )
        self.steps = StepBook()  # a tree unit's partial steps and their verdicts (POST /v1/steps)
        self.lease_book = LeaseBook(
            config=config, prompts=prompts, journal=self.journal, clock=clock, on_dropped=self._dropped,
            policy=self.lease_policy, on_closed=self._forget_steps, verdicts=self.steps.verdicts_of,
        )
        self.checks = IngestChecks(
            config=config, task=task, sampling=sampling, vocab_size=self.vocab_size, ends=ends,
            episode_codec=tokenizer_codec(tokenizer) if isinstance(task, EpisodeTask) else None,
            verdicts=self.steps.verdicts_of,
        )
        self.buffer = Buffer(journal=self.journal, clock=clock)
        self.score_queue = ScoreQueue(
            config=options.rewards, journal=self.journal, clock=clock,
            alive=lambda group_id: self.buffer.waits_for(group_id, "scores"),
        )  # stays empty unless the reward uses a model, or a tree's steps are posted
        verdicts = self.steps.verdicts_of
        self.reward_stage: VerifierRewards | ModelRewards | RolesRewards = (
            ModelRewards(self.rewards, self.score_queue, verdicts=verdicts) if options.rewards.uses_model
            else roles or VerifierRewards(self.rewards, verdicts=verdicts)
        )
        self.kept = KeptBatches(batches_kept=options.batches_kept, journal=self.journal, clock=clock)

        self.new_bans: list[str] = []  # banned, their leftovers dropped, not yet revoked (`_apply_bans`)

        self.journal.meta_source = lambda: meta_row(
            versions=self.versions, counters=self.counters, lease_book=self.lease_book, buffer=self.buffer, streams=self.streams,
            taken=self.lease_policy.taken if isinstance(self.lease_policy, Roles) else None,
        )
        self.journal.integrity_source = self.integrity.journal_changes
        snapshot = self.journal.load()
        if snapshot.meta:
            self.reward_stage.recovered(snapshot.scores, journaled_verdicts(snapshot.steps) if snapshot.steps else None)
            recover(
                snapshot, journal=self.journal, run_name=config.run_name, versions=self.versions, counters=self.counters,
                lease_book=self.lease_book, buffer=self.buffer, batches=self.kept, advantages=options.advantages,
                integrity=self.integrity, restore_steps=self.reward_stage.restore_steps, streams=self.streams,
            )
            self._recover_steps(snapshot.steps)
            if isinstance(self.lease_policy, Roles):  # two policies: a trainer that ran its last step takes no more,
                self.lease_policy.finished.update(n for n, v in self.streams.items() if v.trainer >= config.trainer.steps)
                ready = {group.lease_id for group in self.buffer.ready}  # nor a ready unit its trainer took already
                self.lease_policy.taken = {k: set(v) for k, v in snapshot.meta.get("taken", {}).items() if k in ready}
            self._redo_checks()
            log.info(
                "recovered from %s: version %s, trainer version %d, %d open leases, %d ready groups, "
                "%d rollouts acknowledged so far",
                self.journal.path, self.published_version, self.trainer_version,
                len(self.leases), len(self.ready), self.rollouts_accepted,
            )
        self.journal.flush()

    def _redo_checks(self) -> None:
        """After recovery: which samples were chosen for a logprob check is not journaled, so
        with verification on every recovered sample of an open lease is checked. A lease already
        full (a group pending for its check or its model scores when the orchestrator stopped, or
        a tree unit whose journaled verdicts leave it no branch to wait for) completes now: checked
        whole, and its samples queued for scoring again, less the scores already journaled. A
        banned token's groups were dropped with the ban."""
        for name, record in self.integrity.workers.items():
            if record.banned:
                self.drop_banned(name)  # nothing, normally
        verifying = self.config.orchestrator.verification.enabled
        for open_lease in list(self.lease_book.open.values()):
            if verifying:
                open_lease.check = list(range(len(open_lease.samples)))
            lease_id = open_lease.lease.lease_id
            # Full: pending when the orchestrator stopped, or a tree unit whose verdicts in the
            # journal know a root right (its branches are no longer waited for).
            if self._complete_if_full(lease_id) and self.buffer.waits_for(lease_id, "scores") and self.score_queue.complete(lease_id):
                self._scored(lease_id)  # every score of it was journaled before the stop
        if isinstance(self.reward_stage, ModelRewards) and self.rewards.steps_config is None and not self.rewards.token_ids:
            self.reward_stage.taken = {}  # kept only for the kept batches' per-token scores, rebuilt when asked for

    # -- leases (orchestrator/leases.py, orchestrator/lease_policy.py) ----------------------------

    def stream(self, policy: str | None) -> Versions:
        """`policy`'s stream of versions (a run of one policy: the run's, whatever is named)."""
        return self.streams.get(policy or "", self.versions)

    def lease_capacity(self) -> int:
        if isinstance(self.lease_policy, Roles) and self.streams:
            # Two policies: each stream's budget over the units its trainer takes; the tighter one bounds
            # (a stream whose trainer finished, none). Pending units count for both.
            policy, ready = self.lease_policy, list(self.buffer.ready)
            return min([
                self.lease_book.capacity(
                    published=stream.published, groups_consumed=stream.consumed,
                    waiting=policy.waiting(ready, name) + len(self.buffer.pending),
                )
                for name, stream in self.streams.items() if name not in policy.finished
            ] or [0])
        return self.lease_book.capacity(
            published=self.versions.published, groups_consumed=self.counters.groups_consumed, waiting=self.buffer.waiting()
        )

    def grant_leases(self, holder: str, max_groups: int, policy: str | None = None) -> list[Lease]:
        """Copies of lagging places of the next batch first (a deterministic run's hedges: the
        trainer waits for that batch), then new places as the budget allows. In a run of two
        policies a worker of `policy` gets that policy's leases only (orchestrator/roles.py `serves`)."""
        self.expire_leases()
        for unit_id in self.lease_policy.make_nodes(self.lease_book.open):  # units of roles: an invalid proposal ends its unit
            self._complete(self.lease_book.open[unit_id])
        # Units' nodes first (sub-leases), then copies of lagging places (hedges), then new units or groups.
        units, nodes = self.lease_policy.serves(policy) if isinstance(self.lease_policy, Roles) else (True, True)
        subs = self.lease_book.grant_subs(holder, self.lease_policy.sub_leases(holder, max_groups if nodes else 0, self.lease_book.open))
        copies = self.lease_book.grant_copies(holder, self.lease_policy.copies(holder, max_groups, self.counters.groups_consumed))
        self.counters.hedged_leases += len(copies)
        new = min(max_groups - len(subs) - len(copies), self.lease_capacity()) if units else 0
        return subs + copies + self.lease_book.grant(holder, new)

    def hedge_due_in(self, holder: str | None) -> float | None:
        """Seconds until a place falls due for a copy `holder` (None: any worker) may take (None:
        none will, or no hedging): how long a lease long-poll may sleep before asking again."""
        return self.lease_policy.due_in(holder, self.counters.groups_consumed)

    def expire_leases(self) -> int:
        """Close overdue leases and lease their prompts again; a late answer is rejected. Nodes of
        units of roles past their straggler bound close short first (orchestrator/roles.py)."""
        for unit_id in self.lease_policy.short(self.lease_book.open):
            self._complete(self.lease_book.open[unit_id])
        expired = self.lease_book.expire()
        self.counters.leases_expired += expired
        return expired

    def tell(self, holder: str) -> list[str]:
        """The copies of `holder` that lost their places, not told yet (told once, in its lease answer)."""
        lost = self.lease_policy.tell(holder)
        self.counters.hedge_copies_told += len(lost)
        return lost

    def lease_state(self, lease_id: str, holder: str) -> LeaseState:
        return self.lease_book.state_of(lease_id, holder)

    def renew_lease(self, lease_id: str, holder: str) -> Lease:
        self.expire_leases()
        lease = self.lease_book.renew(lease_id, holder)
        self.lease_book.keep(lease.unit_id or "")  # a sub-lease keeps its unit open
        return lease

    def release_lease(self, lease_id: str, holder: str) -> LeaseState:
        self.expire_leases()
        return self.lease_book.release(lease_id, holder)

    # -- the pipeline of a posted rollout -------------------------------------------------------

    def ingest(self, rollouts: Sequence[Rollout], holder: str) -> IngestResponse:
        """Each rollout through the stages, in order; the answer counts what each decided."""
        self.expire_leases()
        accepted, duplicates, rejected = 0, 0, []
        seen = self.lease_book.seen_rollout_ids
        journaled = (  # after a recovery: ids acknowledged before it, which memory does not hold
            self.journal.acknowledged([r.rollout_id for r in rollouts if r.rollout_id not in seen])
            if self.lease_book.journaled else set()
        )
        for rollout in rollouts:
            rollout_id, lease_id = rollout.rollout_id, rollout.lease_id
            # 1. dedupe: an id already acknowledged, or a sample of a copy that lost its place
            if rollout_id in seen or rollout_id in journaled or self._lost(rollout, holder):
                duplicates += 1
                continue
            # 2. check, then verification's one hook (a ban, a replay; whether to recompute its logprobs)
            open_lease = self.lease_book.open.get(lease_id)
            closed = self.lease_book.closed_lease(lease_id) if open_lease is None else None
            stream = self.stream(rollout.node.policy if rollout.node is not None else None)
            reason = self.checks.reason(
                rollout, holder, lease=open_lease, closed=closed.status if closed is not None else None,
                published=stream.published, trainer=stream.trainer,
            )
            reason, check = self.integrity.admit(rollout, holder, reason)
            if reason is not None:
                rejected.append(Rejection(rollout_id=rollout_id, reason=reason))
                self.counters.rejected[reason] += 1
                if reason == "stale":  # the group (a sub-lease's unit) can no longer train as a whole: free its place at once
                    self._drop(open_lease.lease.unit_id or lease_id if open_lease else lease_id, "stale_at_ingest", requeue="back")
                    self.counters.stale_dropped += 1  # this sample; the close counted those it held
                    self.counters.stale_since_batch.add([len(rollout.completion_token_ids)], None)
                continue
            # 3. record: the sample joins its open lease, and the journal records it
            assert open_lease is not None  # the checks refuse a sample without one
            seen[rollout_id] = lease_id
            if rollout.node is None or rollout.node.parent is None:  # a branch's prompt holds its prefix
                rollout.__dict__["prompt_token_ids"] = open_lease.lease.prompt_token_ids  # equal (checked): shared
            unit = self.lease_book.open.get(open_lease.lease.unit_id or "", open_lease)  # a sub-lease's sample joins its unit
            open_lease.posted += 1
            rollout.__dict__["lease_id"] = unit.lease.lease_id
            unit.samples.append(rollout)
            if check:
                unit.check.append(len(unit.samples) - 1)
            self.journal.record(RolloutAccepted(rollout))
            self.counters.tokens_accepted += len(rollout.prompt_token_ids) + len(rollout.completion_token_ids)
            accepted += 1
            if len(unit.samples) == unit.size:
                self._complete(unit)  # 4. complete: rewarded, then ready or pending
            elif isinstance(unit.lease.unit, RolesUnit) and open_lease is unit:
                self.leases_changed += 1  # a proposer's sample: its solver node is to lease (orchestrator/roles.py)
            elif open_lease is not unit:  # a sub-lease of a unit of roles: it keeps its unit open, and closes when full
                self.lease_book.keep(unit.lease.lease_id)
                if open_lease.posted == open_lease.lease.group_size:
                    self.lease_book.close(open_lease.lease.lease_id, "filled")
        self.counters.rollouts_accepted += accepted
        self.counters.duplicates += duplicates
        self._apply_bans()
        return IngestResponse(accepted=accepted, duplicates=duplicates, rejected=rejected)

    def _lost(self, rollout: Rollout, holder: str) -> bool:
        """Whether `rollout` is of `holder`'s copy that lost its place: a duplicate, compared with the winner's."""
        mismatches = self.lease_policy.lost(rollout, holder, self.lease_book.closed_lease)
        if mismatches is not None:
            self.counters.hedge_duplicates += 1
            self.counters.hedge_mismatches += mismatches
        return mismatches is not None

    def _complete_if_full(self, lease_id: str) -> bool:
        """Complete open lease `lease_id` if it holds its samples already (a unit's size may fall:
        orchestrator/leases.py `tree_pivots`); whether it did."""
        open_lease = self.lease_book.open.get(lease_id)
        if open_lease is None or not open_lease.samples or len(open_lease.samples) < open_lease.size:
            return False
        self._complete(open_lease)
        return True

    def _complete(self, open_lease: OpenLease) -> None:
        """The group is full: reward it, fill its place, then queue it or make it pending."""
        lease, samples = open_lease.lease, open_lease.samples
        if not self._all_fresh(samples):
            # Its first samples were fresh when they came, but the trainer moved on since.
            self._drop(lease.lease_id, "stale_in_buffer")
            return
        # A deterministic run's groups take their position in the ready queue from the consumption order.
        seq = lease.index + 1 if lease.index is not None else 0
        group = Group.of(lease.lease_id, lease.prompt_id, samples, [0.0] * len(samples), seq)
        scored = self.reward_stage.start(group)  # rewarded now, or queued for scorers (its steps' verdicts read)
        self.lease_book.close(lease.lease_id, "complete")  # its steps go (`_forget_steps`)
        losers, mismatches = self.lease_policy.filled(open_lease)
        for lease_id in losers:
            self.lease_book.close(lease_id, "superseded", reason="hedge_lost")
        self.counters.hedge_mismatches += mismatches
        if self.hedge_due_in(None) == 0.0:  # it left the next batch one last place: hedge that now
            self.leases_changed += 1
        check = VerifyJob(lease.lease_id, [samples[i] for i in open_lease.check], open_lease.holder) if open_lease.check else None
        if scored:
            self.integrity.rewards_claimed(open_lease.holder, group.samples)
        if check is None and scored:
            self._ready(group)
        else:
            self.buffer.to_pending(group, check=check, scores=not scored)

    def _ready(self, group: Group) -> None:
        """A group done waiting joins the ready queue; in a run of two policies, a unit no trainer
        still owes (an invalid proposal's one sample, once the proposer's trainer ran its last step)
        is served at once: nothing would ever take it out of the queue it would fill."""
        if isinstance(self.lease_policy, Roles) and self.streams and self.lease_policy.served(group):
            self._served_unclaimed(group)
        else:
            self.buffer.to_ready(group)

    def _fresh(self, version: int, policy: str | None = None) -> bool:
        return is_fresh(self.stream(policy).trainer, version, self.config.train_staleness)

    def _all_fresh(self, rollouts: list[Rollout], owing: set[str | None] | None = None) -> bool:
        """Whether each policy's samples among `rollouts` are fresh for its own stream (one policy: the
        oldest sample); with `owing`, those of the policies whose trainers still owe them only."""
        if not self.streams:
            return self._fresh(min(r.policy_version for r in rollouts))
        return all(
            self._fresh(version, policy) for policy, version in oldest_by_policy(rollouts).items() if owing is None or policy in owing
        )

    # -- what leaves the buffer: the one path of a dropped group, and of a pending one -----------

    def _dropped(self, closed: ClosedLease, reason: str, samples: int) -> None:
        """Every lease closed without training, as LeaseBook.close reports it: `samples` of its
        samples counted as dropped for `reason`, and its content forgotten (it may honestly come again)."""
        self.integrity.forget_lease(closed.lease.lease_id)
        self.leases_changed += 1
        if samples:
            self.counters.dropped[reason] += samples
            if reason in STALE_REASONS:
                self.counters.stale_dropped += samples

    def _drop(
        self, lease_id: str, reason: str, *, counted: int | None = None, requeue: Requeue | None = None,
        group: Group | None = None,
    ) -> ClosedLease:
        """An open lease, or a group out of the buffer (`group`), closed without training for
        `reason`. What goes stale is tallied for the next batch's `stale_report`: its completion
        lengths, and its rewards if they were final."""
        if reason in STALE_REASONS:
            open_lease = self.lease_book.open.get(lease_id)
            rollouts = group.rollouts if group is not None else open_lease.samples if open_lease is not None else []
            rewards = group.rewards if group is not None and not group.awaiting else None
            self.counters.stale_since_batch.add([len(r.completion_token_ids) for r in rollouts], rewards)
        return self.lease_book.close(lease_id, "dropped", reason=reason, counted=counted, requeue=requeue)

    def _release(self, group: Group, what: Wait, *, stale_reason: str) -> None:
        """`what` is done for a pending group: once nothing else keeps it pending it joins the ready queue
        in its place, or is dropped if the trainer moved on meanwhile."""
        if self.buffer.done_waiting(group.lease_id, what) is None:
            return  # it still waits for the other
        if self._all_fresh(group.rollouts) if self.streams else self._fresh(group.oldest_version):
            self._ready(group)
        else:
            self._drop(group.lease_id, stale_reason, counted=group.size, group=group)

    def _holder(self, group: Group) -> str:
        return self.lease_book.closed[group.lease_id].holder

    # -- model scores (orchestrator/score_queue.py; rewards combined by rewards.py) ---------------

    def lease_scores(self, holder: str, max_items: int) -> ScoreLeaseEntry | None:
        self.expire_leases()  # an overdue lease's steps go before a scorer could be leased them
        return self.score_queue.lease(holder, max_items)

    def renew_scores(self, lease_id: str, holder: str) -> ScoreRenewal:
        return self.score_queue.renew(lease_id, holder)

    def post_scores(self, holder: str, body: ScorePost) -> ScoreAck:
        """Take a scorer's post (all or nothing: ScoreError, or a LeaseError for a lease it cannot
        use); the groups it completes combine their rewards and join the ready queue (or are dropped:
        stale, or a judge reply that did not parse); its verdicts on partial steps are journaled and
        wait for their workers (`verdicts_for`)."""
        ack, done, verdicts = self.score_queue.post(holder, body)
        for verdict in verdicts:
            if (told := self.steps.judged(verdict)) is not None:
                self.journal.record(VerdictTaken(told.rollout_id, told.step, told.score, told.seq))
                self._complete_if_full(told.lease_id)  # a tree unit's root known right: its branches are not waited for
        for group_id in done:
            self._scored(group_id)
        self._apply_bans()
        return ack

    # -- partial steps (tree units: orchestrator/score_queue.py StepBook) ---------------------------

    def post_steps(self, holder: str, body: StepPost) -> StepAck:
        """Take a worker's finished steps of samples it is still generating (all or none: a
        StepError, or a LeaseError for a lease it does not hold open), journal them and queue each
        for scorers."""
        self.expire_leases()
        found = self.lease_book.open.owned(body.lease_id, holder, self.lease_book.closed_lease(body.lease_id))
        if not isinstance(found, OpenLease):
            raise LeaseClosed(f"lease {body.lease_id!r} is {found.status}; its steps are no longer scored")
        lease = found.lease
        if not isinstance(lease.unit, TreeUnit):
            raise StepError(f"lease {lease.lease_id!r} is not a tree unit ([orchestrator.tree]): its samples post no steps")
        fresh, duplicates = self.steps.take(
            lease, holder, body, max_tokens=self.sampling.max_tokens, vocab_size=self.vocab_size, max_samples=found.size
        )
        for step in fresh:
            self.journal.record(StepTaken(lease.lease_id, step.rollout_id, step.step, encode_model(step, MEDIA_MSGPACK)))
            self._queue_step(lease, step)
        return StepAck(accepted=len(fresh), duplicates=duplicates)

    def _queue_step(self, lease: Lease, step: PartialStep) -> None:
        chain = self.steps.chains[step.rollout_id]
        prefix = chain.prompt_token_ids[len(lease.prompt_token_ids):]  # a branch's: its parent's first tokens
        so_far = chain.steps[: step.step + 1]
        self.score_queue.add_step(lease.lease_id, self.rewards.step_item(lease.prompt_id, step.rollout_id, prefix, so_far))

    def _forget_steps(self, lease_id: str) -> None:
        """A lease closed (complete, expired, released, dropped; LeaseBook.close): its chains, their
        verdicts and its unjudged steps go, so that no scorer is leased a step nobody waits for."""
        if self.steps.chains:
            self.score_queue.forget_steps(self.steps.drop(lease_id))

    def verdicts_for(self, holder: str, after: int) -> VerdictList:
        """The verdicts on steps of `holder`'s open leases numbered after `after`."""
        verdicts = self.steps.for_holder(holder, after)
        return VerdictList(verdicts=verdicts, last=verdicts[-1].seq if verdicts else after)

    def _recover_steps(self, steps: dict[str, list[tuple[str, int, bytes, float | None, int | None]]]) -> None:
        """The partial steps of open leases, and their verdicts, as journaled; unjudged ones queued again."""
        for lease_id, rows in steps.items():
            open_lease = self.lease_book.open.get(lease_id)
            if open_lease is None:
                continue  # complete: its verdicts are read by the reward stage (`journaled_verdicts`)
            for rollout_id, _, data, score, seq in rows:
                step = PartialStep.model_validate(unpack_msgpack(data))
                self.steps.add(lease_id, open_lease.holder, step)
                if score is None:
                    self._queue_step(open_lease.lease, step)
                else:
                    self.steps.judged(StepVerdictTaken(lease_id, rollout_id, step.step, score), seq)

    def _scored(self, group_id: str) -> None:
        assert isinstance(self.reward_stage, ModelRewards), "only a model reward has scores"
        group = self.buffer.pending.get(group_id)
        if group is None:
            self.score_queue.forget(group_id)  # dropped while its scores came in
            return
        if not self.reward_stage.finish(group):  # a judge reply that did not parse, on_parse_failure = drop
            self.buffer.release_pending(lambda g: g.lease_id == group_id)
            self._drop(group_id, "judge_parse_failure", counted=group.size)
            return
        self.integrity.rewards_claimed(self._holder(group), group.samples)
        self._release(group, "scores", stale_reason="stale_waiting_scores")

    # -- verification (the app runs its scheduler, orchestrator/verification.py: which checks, then their verdicts) --

    def checks_due(self) -> bool:
        """Whether the trainer's next batch waits for a pending group (`pending_ahead`) and a
        batch's worth of groups is complete: then check at once. Until then a check may wait for
        others to share its forward at no cost to the trainer, which could not take a batch sooner."""
        wanted = self.config.places_per_step
        return len(self.buffer.ready) + len(self.buffer.pending) >= wanted and self.buffer.pending_ahead(wanted)

    def take_checks(self, limit: int) -> list[VerifyJob]:
        """The pending groups to check together, taken off the verify queue (which holds no
        dropped group's: Buffer.release_pending): whole groups, oldest first, up to `limit`
        rollouts (at least one group). A token none of whose checks has passed yet (a new worker,
        or a cheater) gets one group in per batch: its first verdict bans a cheater before the rest
        of what it posted costs a forward (drop_banned then drops it unchecked)."""
        taken: list[VerifyJob] = []
        left: deque[VerifyJob] = deque()
        rollouts, unproven = 0, set()
        for job in self.buffer.verify_queue:
            token = token_of(job.holder)
            first = not self.integrity.has_passed_check(job.holder)
            if (taken and rollouts + len(job.rollouts) > limit) or (first and token in unproven):
                left.append(job)
                continue
            if first:
                unproven.add(token)
            taken.append(job)
            rollouts += len(job.rollouts)
        self.buffer.verify_queue = left
        return taken

    def verification_done(self, verdicts: dict[str, dict[str, str]]) -> None:
        """The checks of pending groups are done: lease id -> its failed samples (rollout id ->
        rejection reason; `logprob_mismatch` strikes its worker, `unverifiable` does not). A group
        with any failed sample is dropped whole; a clean one joins the ready queue if it is still fresh.
        The bans they cause apply once all are judged."""
        for lease_id, failed in verdicts.items():
            group = self.buffer.pending.get(lease_id)
            if group is None:
                continue  # dropped meanwhile (its worker was banned, or it went stale waiting for its scores)
            holder = self._holder(group)
            if not failed:
                self.integrity.record(holder).passed += 1
                self._release(group, "check", stale_reason="stale_in_buffer")
                continue
            self.buffer.release_pending(lambda g: g.lease_id == lease_id)
            for reason in failed.values():
                self.counters.rejected[reason] += 1
                self.integrity.rejected(holder, reason)
            self._drop(lease_id, "failed_verification", counted=group.size - len(failed))
        self._apply_bans()

    def _apply_bans(self) -> None:
        """The tokens integrity banned since the last call (where a strike can happen: ingest, a
        check, a score): what each left waiting is dropped now, and it waits in `new_bans` for the
        app to revoke it (orchestrator/appstate.py `commit`)."""
        for name in self.integrity.newly_banned():
            dropped = self.drop_banned(name)
            self.new_bans.append(name)
            log.warning("worker token %r banned after %d strikes; %d of its samples dropped", name,
                        self.integrity.workers[name].strikes, dropped)

    def drop_banned(self, token: str) -> int:
        """A banned token's open leases, pending and ready groups are dropped (its prompts are
        leased again): what it sent unchecked is no longer trusted. Returns the samples dropped."""
        dropped = 0
        for lease_id in [lease_id for lease_id, lease in self.lease_book.open.items() if token_of(lease.holder) == token]:
            dropped += self._drop(lease_id, "banned_worker", requeue="back").samples

        def of_token(group: Group) -> bool:
            return token_of(self._holder(group)) == token

        for group in self.buffer.release_pending(of_token) + self.buffer.evict(of_token):
            self._drop(group.lease_id, "banned_worker", counted=group.size)
            dropped += group.size
        return dropped

    # -- trainer side --------------------------------------------------------------------------

    def advance(self, trainer_version: int, policy: str | None = None) -> None:
        """The trainer (of `policy`, in a run of two) now holds `trainer_version`: evict groups that can no longer train."""
        stream = self.stream(policy)
        if trainer_version <= stream.trainer:
            return  # groups in the buffer were fresh for this version when they arrived
        stream.trainer = trainer_version
        if policy is not None and trainer_version >= self.config.trainer.steps and isinstance(self.lease_policy, Roles):
            self._finished(policy)

        def stale(group: Group) -> bool:
            if isinstance(self.lease_policy, Roles) and self.streams:  # judged for the trainers that still owe it
                return not self._all_fresh(group.rollouts, self.lease_policy.owing(group))
            return not self._fresh(group.oldest_version)

        for group in self.buffer.evict(stale):
            self._drop(group.lease_id, "stale_in_buffer", counted=group.size, group=group)
        # A group still waiting for model scores that can no longer train goes now (a group held
        # back for its logprob check alone is judged when the check is done: `verification_done`).
        for group in self.buffer.release_pending(lambda group: "scores" in group.awaiting and stale(group)):
            self._drop(group.lease_id, "stale_waiting_scores", counted=group.size, group=group)

    def announce(self, version: int, policy: str | None = None) -> None:
        """Version `version` (of `policy`'s stream, in a run of two) is complete in the store; workers may pull it."""
        stream = self.stream(policy)
        stream.published = max(version, stream.published or 0)
        self.advance(version, policy)

    def take_batch(self, trainer_version: int, request_id: str | None = None, policy: str | None = None) -> TrainBatch | None:
        """The next `groups_per_step` fresh groups, oldest first, or None if not enough yet. With
        dynamic sampling a step consumes `places_per_step` groups and trains those with a reward
        signal (batches.py `pick_signal`); the others close as `skipped`, counted as dropped.

        With a `request_id` already answered (its answer was lost and the trainer asks again),
        the same batch again, as long as it is among the last `batches_kept`.
        """
        if policy is not None and request_id is not None:  # two trainers name their steps alike: each its own
            request_id = f"{policy}:{request_id}"
        if request_id is not None and (again := self.kept.retried(request_id)) is not None:
            return again
        self.advance(trainer_version, policy)
        if self.streams and isinstance(self.lease_policy, Roles) and policy is not None:
            return self._take_part(policy, request_id)
        places = self.config.places_per_step  # groups_per_step, unless dynamic sampling consumes more
        if len(self.buffer.ready) < places or self.buffer.pending_ahead(places):
            return None
        first = self.counters.groups_consumed + 1  # a deterministic run serves places in order (`seq`)
        if self.config.deterministic and any(self.buffer.ready[i].seq != first + i for i in range(places)):
            return None
        groups, skipped = pick_signal(self.buffer.take_front(places), self.config.trainer.groups_per_step)
        for group, reason in skipped:
            self.lease_book.close(group.lease_id, "skipped", reason=reason, counted=group.size)
        self.counters.groups_skipped += len(skipped)
        self.counters.groups_served += len(groups)
        batch_id = uuid.uuid4().hex
        advantages = self.config.orchestrator.advantages
        batch = build_batch(
            groups, trainer_version=self.versions.trainer, batch_id=batch_id, advantages=advantages,
            rollouts_accepted=self.counters.rollouts_accepted, stale_dropped=self.counters.stale_dropped,
            stale_report=self._stale_report(), baselines=self.kept.baselines,
        )
        after = (
            roles_outcome(groups, [shaped_rewards(g, advantages) for g in groups], advantages, self.kept.baselines)[1]
            if advantages.type == "roles" else None
        )
        for group in groups:
            self.counters.recent_rewards.extend(group.rewards)
            closed = self.lease_book.close(group.lease_id, "served")
            self.integrity.record(closed.holder).served += group.size
        self.kept.served_now(request_id or batch_id, batch, groups, after)
        return batch

    def _take_part(self, policy: str, request_id: str | None) -> TrainBatch | None:
        """A run of two policies: `policy`'s samples of the next `groups_per_step` ready units its
        trainer has not taken (orchestrator/roles.py `untaken`); a unit is served once every policy took it."""
        assert isinstance(self.lease_policy, Roles)
        count = self.config.trainer.groups_per_step
        units = self.lease_policy.untaken(list(self.buffer.ready), policy, count)
        if not units or self.buffer.pending_ahead(count):
            return None
        groups = [part(group, policy) for group in units]
        done = {group.lease_id for group in self.lease_policy.take(units, policy)}
        self.stream(policy).consumed += len(units)
        self.buffer.evict(lambda group: group.lease_id in done)
        batch_id = uuid.uuid4().hex
        advantages = self.config.orchestrator.advantages
        batch = build_batch(
            groups, trainer_version=self.stream(policy).trainer, batch_id=batch_id, advantages=advantages,
            rollouts_accepted=self.counters.rollouts_accepted, stale_dropped=self.counters.stale_dropped,
            stale_report=self._stale_report(), baselines=self.kept.baselines,
        )
        after = roles_outcome(groups, [shaped_rewards(g, advantages) for g in groups], advantages, self.kept.baselines)[1]
        self.counters.groups_served += len(done)
        for group in groups:
            self.counters.recent_rewards.extend(group.rewards)
        for unit in units:
            if unit.lease_id in done:
                closed = self.lease_book.close(unit.lease_id, "served")
                self.integrity.record(closed.holder).served += unit.size
        self.kept.served_now(request_id or batch_id, batch, groups, after)
        return batch

    def _finished(self, policy: str) -> None:
        """`policy`'s trainer ran its last step: it takes no more units, and those only it still
        owed are served (the other policy's trainer trained them; the run goes on for it)."""
        assert isinstance(self.lease_policy, Roles)
        self.lease_policy.finished.add(policy)
        for group in self.buffer.evict(self.lease_policy.served):
            self._served_unclaimed(group)

    def _served_unclaimed(self, group: Group) -> None:
        """A unit whose every trainer took it or ran its last step: closed as served."""
        self.counters.groups_served += 1
        closed = self.lease_book.close(group.lease_id, "served")
        self.integrity.record(closed.holder).served += group.size

    def _stale_report(self) -> StaleReport:
        """What went stale since the previous batch (the tally starts again)."""
        tally, self.counters.stale_since_batch = self.counters.stale_since_batch, Tally()
        return StaleReport(
            samples=tally.samples,
            mean_length=tally.tokens / tally.samples if tally.samples else None,
            mean_reward=tally.reward / tally.rewarded if tally.rewarded else None,
        )

    def served_batch(self, request_id: str) -> TrainBatch | None:
        """The batch already served for this request id, if it is still kept."""
        return self.kept.retried(request_id)

    def batch_msgpack(self, batch: TrainBatch) -> bytes | None:
        """A kept batch as msgpack (None if no longer kept)."""
        return self.kept.msgpack(batch)

    # -- upkeep ----------------------------------------------------------------------------------

    def forget_closed(self, limit: int = 10_000) -> int:
        """Forget leases closed more than `dedupe_window_s` ago (and their rollout ids)."""
        return self.lease_book.forget_closed(in_batches=self.kept.leases, limit=limit)

    # -- what handlers and metrics read ---------------------------------------------------------

    def scores(self) -> bool:
        """Whether scorers score anything in this run: samples (a model reward) or a tree's steps."""
        return self.config.orchestrator.rewards.uses_model or isinstance(self.lease_book.unit, TreeUnit)

    def buffer_full(self) -> bool:
        return len(self.buffer.ready) >= self.buffer_limit

    def status(self) -> StatusResponse:
        counters, rewards = self.counters, list(self.counters.recent_rewards)
        return StatusResponse(
            run_name=self.config.run_name,
            policy_version=self.versions.published,
            trainer_version=self.versions.trainer,
            rollouts_accepted=counters.rollouts_accepted,
            rollouts_rejected=dict(counters.rejected),
            stale_dropped=counters.stale_dropped,
            groups_ready=len(self.buffer.ready),
            groups_served=counters.groups_served,
            groups_skipped=counters.groups_skipped,
            leases_active=len(self.lease_book.open),
            leases_expired=counters.leases_expired,
            hedged_leases=counters.hedged_leases,
            hedge_duplicates=counters.hedge_duplicates,
            hedge_mismatches=counters.hedge_mismatches,
            hedge_copies_told=counters.hedge_copies_told,
            reward_mean_recent=sum(rewards) / len(rewards) if rewards else None,
            uptime_s=self.clock() - self.started_at,
            rollouts_duplicate=counters.duplicates,
            dropped=dict(counters.dropped),
            buffer_limit=self.buffer_limit,
            journal=self.journal.durable,
            recoveries=counters.recoveries,
            groups_verifying=self.buffer.pending_for("check"),
            groups_scoring=self.buffer.pending_for("scores"),
            scoring=self.score_queue.summary() if self.scores() else None,
            workers=self.integrity.summary(),
            reward_failures=reward_failures(self.task),
        )
