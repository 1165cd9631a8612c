"""RunState: the orchestrator's run, as its parts, with the one pipeline a rollout goes through.

Plain synchronous code with no HTTP in it; the handlers (orchestrator/handlers.py) call it from
the event loop (one thread, so no locks), as do orchestrator/service.py (which builds it),
orchestrator/verification.py, orchestrator/metrics.py and benchmarks/; what they read under the
parts' names, and the /v1/status answer, is its base RunView (orchestrator/view.py). The parts,
each in a file named for what it holds:

  lease_book  orchestrator/leases.py    prompt order, open leases and deadlines, the lease budget,
                                        the one lease-close path, closed leases remembered
  hedges      orchestrator/hedges.py    deterministic runs: which lagging places of the next batch
                                        get a second lease (None when off or free-running)
  copies      orchestrator/copies.py    deterministic runs: a place filled, its losing copies'
                                        samples compared with the winner's
  checks      orchestrator/checks.py    why a posted rollout is refused
  scorer      orchestrator/scoring.py   rewards recomputed with the task's verifier, combined with
                                        model scores
  score_queue orchestrator/score_queue.py  samples waiting for model scores, leased to scorers
  score_stage orchestrator/score_stage.py  a model reward's stage: a group queued, scorers' posts
                                        taken, rewards combined, the group let into line
  buffer      orchestrator/buffer.py    complete groups in line, groups held back for their check
  batches     orchestrator/batches.py   the trainer's side: its version moving on (stale groups
                                        evicted), batches with advantages, batches kept for re-asks
  integrity   orchestrator/integrity.py strikes, bans, spot-check sampling, replays
  verdicts    orchestrator/verdicts.py  what follows a logprob check or a ban
  journal     orchestrator/journal.py   every change, committed before the HTTP answer (a
                                        NullJournal when journaling is off); recovery.py rebuilds
                                        the parts from it at startup
  versions, counters  orchestrator/counters.py

The pipeline of one POST /v1/rollouts (`ingest`), per rollout, in order:
  1. dedupe   a rollout id already acknowledged is a duplicate, counted once; so is a sample of
              a hedge's losing copy (its place filled by another copy, bit for bit the same:
              copies.py compares them)
  2. check    checks.py gives a rejection reason (counted; a stale one drops its whole group)
  3. record   the sample joins its open lease; integrity keeps its content hash and may pick it
              for a logprob check; the journal records it
  4. score    when the group is full (and still fresh): scoring.py rewards each sample with the
              task's verifier; with a model reward its samples go to the score queue
              (score_stage.py, score_queue.py) for scorers to lease and score (`post_scores`)
  5. line up  the group is held back, keeping its place, until its check is done (buffer.hold_back;
              orchestrator/verification.py reports through `verification_done`) and its model
              scores are in (`post_scores`: score_stage.py combines the rewards with scoring.py),
              or joins the line for the trainer at once (buffer.to_ready)
then `take_batch` serves the front of the line as a batch (batches.py).

Invariants:
- a rollout is scored with the task's verifier and/or by scorers (scoring.py, score_queue.py), never
  with the worker's claimed reward; a group waiting for scores counts toward the staleness budget
  and is dropped (`stale_waiting_scores`) if it goes stale waiting;
- a group is served to the trainer at most once, and only if every sample is fresh for the
  trainer's version;
- no more groups are leased than can be consumed without going stale (`lease_budget`), nor
  than the buffer bound allows (`orchestrator.max_buffer_groups`, ready groups + open leases);
- every lease closes through `LeaseBook.close` (journaled; drops counted; content forgotten).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from decentrl.api.wire import (
    IngestResponse,
    Lease,
    LeaseState,
    Rejection,
    Rollout,
    SamplingParams,
    ScoreAck,
    ScorePost,
    ScoreRenewal,
    ScoreResult,
    TrainBatch,
)
from decentrl.config import RunConfig
from decentrl.model.build import end_of_sequence_ids
from decentrl.rl.staleness import is_fresh
from decentrl.tasks import Task
from decentrl.tasks.episodes import EpisodeTask
from decentrl.tasks.prompts import make_prompt_encoder
from orchestrator.batches import Batches, pack_sample
from orchestrator.buffer import Buffer, Group, VerifyJob
from orchestrator.checks import IngestChecks
from orchestrator.codec import Packed
from orchestrator.copies import Copies
from orchestrator.counters import Counters, Versions
from orchestrator.hedges import Hedges, Places
from orchestrator.integrity import Integrity
from orchestrator.journal import Journal, NullJournal, RunJournal
from orchestrator.leases import LeaseBook, LeaseError, OpenLease, PromptQueue
from orchestrator.recovery import meta_row, recover
from orchestrator.score_queue import ScoreLeaseEntry, ScoreQueue
from orchestrator.score_stage import ScoreStage
from orchestrator.scoring import Scorer
from orchestrator.tokens import make_decoder, make_encoder
from orchestrator.verdicts import Verdicts
from orchestrator.view import RunView

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from decentrl.model.tokenizer import RustTokenizer

# Re-exported: orchestrator/handlers.py answers lease errors, orchestrator/verification.py runs jobs.
__all__ = ["LeaseError", "RunState", "VerifyJob"]

log = logging.getLogger("decentrl.orchestrator.state")


class RunState(RunView):
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
        if options.max_buffer_groups < config.trainer.groups_per_step:
            raise ValueError(
                f"orchestrator.max_buffer_groups ({options.max_buffer_groups}) must be at least "
                f"trainer.groups_per_step ({config.trainer.groups_per_step}), or no batch could ever form"
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
        # What ends a generation for the finish-reason and turn-end checks: the ids the worker
        # backends stop at (tokenizer and generation config) and, leniently, any special token.
        end_ids = end_of_sequence_ids(config.model, tokenizer) | set(tokenizer.all_special_ids)

        self.versions = Versions()
        self.counters = Counters()
        self.integrity = Integrity(
            options.verification, eos_ids=end_ids, decode=lambda ids: decode([ids])[0], journaled=self.journal.durable
        )
        self.lease_book = LeaseBook(
            config=config,
            prompts=PromptQueue(
                task=task, render=render_prompt, seed=config.task.seed, deterministic=config.deterministic
            ),
            versions=self.versions, counters=self.counters, integrity=self.integrity, journal=self.journal, clock=clock,
        )
        self.hedges = (
            Hedges(config=options.hedging, groups_per_step=config.trainer.groups_per_step, clock=clock)
            if config.deterministic and options.hedging.enabled else None
        )
        self.copies = Copies(lease_book=self.lease_book, hedges=self.hedges, counters=self.counters, clock=clock)
        self.scorer = Scorer(
            task=task, tokenizer=tokenizer, decode=decode, end_ids=end_ids, rewards=options.rewards, prompt=config.prompt,
            steps=options.advantages.steps,
        )
        self.checks = IngestChecks(
            config=config, task=task, sampling=SamplingParams(**config.sampling.model_dump()),
            vocab_size=self.vocab_size, versions=self.versions, lease_book=self.lease_book,
            integrity=self.integrity, scorer=self.scorer,
        )
        self.buffer = Buffer(journal=self.journal, clock=clock)
        self.score_queue = ScoreQueue(
            config=options.rewards, journal=self.journal, clock=clock,
            alive=lambda group_id: self.buffer.waits_for(group_id, "scores"),
        )
        self.score_stage = ScoreStage(
            config=config, versions=self.versions, scorer=self.scorer, score_queue=self.score_queue,
            buffer=self.buffer, lease_book=self.lease_book, integrity=self.integrity,
        )
        self.batches = Batches(
            config=config, versions=self.versions, counters=self.counters, lease_book=self.lease_book,
            buffer=self.buffer, integrity=self.integrity, journal=self.journal, clock=clock,
        )
        self.verdicts = Verdicts(
            config=config, versions=self.versions, counters=self.counters, lease_book=self.lease_book,
            buffer=self.buffer, integrity=self.integrity,
        )

        self.journal.set_meta_source(
            lambda: meta_row(versions=self.versions, counters=self.counters, lease_book=self.lease_book, buffer=self.buffer)
        )
        self.journal.set_integrity_source(self.integrity.journal_changes)
        snapshot = self.journal.load()
        if snapshot.meta:
            self.score_stage.taken = {rid: ScoreResult.model_validate_json(data) for rid, data in snapshot.scores.items()}
            recover(
                snapshot, journal=self.journal, run_name=config.run_name, versions=self.versions, counters=self.counters,
                lease_book=self.lease_book, buffer=self.buffer, batches=self.batches, integrity=self.integrity,
                restore_steps=self.score_stage.recover_steps,
            )
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
        full (a group held back for its check or its model scores when the orchestrator stopped)
        completes now: checked whole, and its samples queued for scoring again, less the scores
        already journaled. A banned token's groups were dropped with the ban."""
        for name, record in self.integrity.workers.items():
            if record.banned:
                self.drop_banned(name)  # nothing, normally
        verifying = self.config.orchestrator.verification.enabled
        if not verifying and not self.config.orchestrator.rewards.uses_model:
            return
        for open_lease in list(self.lease_book.open.values()):
            if verifying:
                open_lease.check = list(range(len(open_lease.samples)))
            if len(open_lease.samples) >= open_lease.lease.group_size:
                self._complete(open_lease)
        if self.scorer.steps_config is None:  # kept for the kept batches' step scores, rebuilt when asked for
            self.score_stage.taken = {}

    # -- leases (orchestrator/leases.py) ------------------------------------------------------

    def lease_capacity(self) -> int:
        return self.lease_book.capacity(groups_served=self.counters.groups_served, waiting=self.buffer.waiting())

    def grant_leases(self, holder: str, max_groups: int) -> list[Lease]:
        """Copies of lagging places of the next batch first (hedging: the trainer waits for that
        batch), then new places as the budget allows."""
        self.expire_leases()
        copies = []
        if self.hedges is not None:
            copies = [self.lease_book.copy(index, holder) for index in self.hedges.pick(holder, max_groups, self._places())]
        return copies + self.lease_book.grant(holder, min(max_groups - len(copies), self.lease_capacity()))

    def hedge_due_in(self, holder: str | None) -> float | None:
        """Seconds until a place falls due for a copy `holder` (None: any worker) may take (None:
        none will, or no hedging): how long a lease long-poll may sleep before asking again."""
        return self.hedges.due_in(holder, self._places()) if self.hedges is not None else None

    def _places(self) -> Places:
        book = self.lease_book
        return Places(
            open=book.places, leases=book.open, head=self.counters.groups_served, cursor=book.prompts.cursor,
            requeued=book.prompts.requeued,
        )

    def expire_leases(self) -> int:
        """Close overdue leases and lease their prompts again; a late answer is rejected."""
        return self.lease_book.expire()

    def lease_state(self, lease_id: str, holder: str) -> LeaseState:
        return self.lease_book.state_of(lease_id, holder)

    def renew_lease(self, lease_id: str, holder: str) -> Lease:
        self.expire_leases()
        return self.lease_book.renew(lease_id, holder)

    def release_lease(self, lease_id: str, holder: str) -> LeaseState:
        self.expire_leases()
        return self.lease_book.release(lease_id, holder)

    # -- the pipeline of a posted rollout -------------------------------------------------------

    def ingest(
        self, rollouts: Sequence[Rollout], holder: str, packed: Sequence[Packed | None] | None = None
    ) -> IngestResponse:
        """Each rollout through the stages named in the module docstring.

        `packed` (optional, aligned with `rollouts`): completion ids and logprobs already packed
        as typed arrays (as a msgpack body carried them), kept instead of packing them again.
        """
        self.expire_leases()
        accepted, duplicates, rejected = 0, 0, []
        journaled = self.lease_book.journaled_ids([rollout.rollout_id for rollout in rollouts])
        for index, rollout in enumerate(rollouts):
            if rollout.rollout_id in self.lease_book.seen_rollout_ids or rollout.rollout_id in journaled:  # 1. dedupe
                duplicates += 1
                continue
            if self.config.deterministic and self.copies.lost(rollout, holder):  # a losing copy's (copies.py)
                duplicates += 1
                continue
            verdict = self.checks.check(rollout, holder)  # 2. check
            if verdict.reason is not None:
                self._reject(rollout, holder, verdict.reason)
                rejected.append(Rejection(rollout_id=rollout.rollout_id, reason=verdict.reason))
                continue
            arrays = (packed[index] if packed is not None else None) or pack_sample(rollout)
            open_lease = self._record(rollout, holder, arrays, verdict.digest)  # 3. record
            accepted += 1
            if len(open_lease.samples) == open_lease.lease.group_size:
                self._complete(open_lease)  # 4. score, 5. line up
        self.counters.rollouts_accepted += accepted
        self.counters.duplicates += duplicates
        return IngestResponse(accepted=accepted, duplicates=duplicates, rejected=rejected)

    def _reject(self, rollout: Rollout, holder: str, reason: str) -> None:
        self.counters.rejected[reason] += 1
        self.integrity.rejected(holder, reason)
        if reason == "stale":
            # The group can no longer train as a whole: free its slot at once rather than hold
            # it until the lease expires.
            self.lease_book.close(rollout.lease_id, "dropped", reason="stale_at_ingest", requeue="back")
            self.counters.stale_dropped += 1  # this sample; the close counted those it held

    def _record(self, rollout: Rollout, holder: str, packed: Packed, digest: bytes | None) -> OpenLease:
        open_lease = self.lease_book.add_sample(rollout, packed)
        if digest is not None:  # verification enabled
            self.integrity.kept(rollout.lease_id, digest, rollout.policy_version)
            if self.integrity.wants_check(holder):
                open_lease.check.append(len(open_lease.samples) - 1)
        self.counters.tokens_accepted += len(rollout.prompt_token_ids) + len(rollout.completion_token_ids)
        self.journal.rollout_accepted(rollout, packed)
        return open_lease

    def _complete(self, open_lease: OpenLease) -> None:
        """The group is full: score it, then hold it back for its check or put it in line."""
        lease = open_lease.lease
        if not self._fresh(min(r.policy_version for r in open_lease.samples)):
            # Its first samples were fresh when they came, but the trainer moved on since.
            self.lease_book.close(lease.lease_id, "dropped", reason="stale_in_buffer")
            return
        samples = open_lease.samples
        verifier = self.scorer.verifier_rewards(samples)  # None for a model-only reward
        model = self.config.orchestrator.rewards.uses_model
        # A deterministic run's groups take their place in line from the consumption order.
        seq = lease.index + 1 if lease.index is not None else 0
        rewards = verifier if verifier is not None else [0.0] * len(samples)  # final once scored (score_stage.py)
        group = Group.of(lease.lease_id, lease.prompt_id, samples, rewards, open_lease.packed, seq)
        self.lease_book.close(lease.lease_id, "complete")
        if lease.index is not None:
            self.copies.filled(lease.index, open_lease)
        check = VerifyJob(lease.lease_id, [samples[i] for i in open_lease.check], open_lease.holder) if open_lease.check else None
        if not model:
            self.integrity.rewards_claimed(open_lease.holder, group.samples)
        if check is None and not model:
            self.buffer.to_ready(group)
            return
        group.verifier_rewards = verifier
        self.buffer.hold_back(group, check=check, scores=model)
        if model:
            self.score_stage.wait(group, samples)

    def _fresh(self, version: int) -> bool:
        return is_fresh(self.versions.trainer, version, self.config.max_staleness)

    # -- scorers (orchestrator/score_queue.py, score_stage.py: a model reward) -------------------

    def lease_scores(self, holder: str, max_items: int) -> ScoreLeaseEntry | None:
        return self.score_queue.lease(holder, max_items)

    def renew_scores(self, lease_id: str, holder: str) -> ScoreRenewal:
        return self.score_queue.renew(lease_id, holder)

    def post_scores(self, holder: str, body: ScorePost) -> ScoreAck:
        """A scorer's post, taken by the scoring stage (score_stage.py)."""
        return self.score_stage.post(holder, body)

    # -- verdicts on workers (orchestrator/verdicts.py; the app runs the verification loop) -----

    def verification_done(self, lease_id: str, failed: dict[str, str]) -> None:
        """The check of a held-back group is done (`failed`: rollout id -> rejection reason)."""
        self.verdicts.checked(lease_id, failed)

    def held_back_ahead(self, count: int) -> bool:
        """Whether the next `count` groups in line wait for a held-back group (buffer.py)."""
        return self.buffer.held_back_ahead(count)

    def drop_banned(self, token: str) -> int:
        """Drop what a banned token has waiting; returns the samples dropped."""
        return self.verdicts.banned(token)

    # -- trainer side --------------------------------------------------------------------------

    def advance(self, trainer_version: int) -> None:
        """The trainer now holds `trainer_version`: evict groups that can no longer train."""
        self.batches.advance(trainer_version)

    def announce(self, version: int) -> None:
        """Version `version` is complete in the store; workers may pull it."""
        self.versions.published = max(version, self.versions.published or 0)
        self.batches.advance(version)

    def take_batch(self, trainer_version: int, request_id: str | None = None) -> TrainBatch | None:
        """The next `groups_per_step` fresh groups, oldest first, or None if not enough yet.

        With a `request_id` already answered (its answer was lost and the trainer asks again),
        the same batch again, as long as it is among the last `batches_kept`.
        """
        return self.batches.take(trainer_version, request_id)

    def served_batch(self, request_id: str) -> TrainBatch | None:
        """The batch already served for this request id, if it is still kept."""
        return self.batches.again(request_id)

    def batch_msgpack(self, batch: TrainBatch) -> bytes | None:
        """A kept batch as msgpack, from the arrays packed at ingest (None if no longer kept)."""
        return self.batches.msgpack(batch)

    # -- upkeep ----------------------------------------------------------------------------------

    def forget_closed(self, limit: int = 10_000) -> int:
        """Forget leases closed more than `dedupe_window_s` ago (and their rollout ids)."""
        return self.lease_book.forget_closed(in_batches=self.batches.leases, limit=limit)
