"""The orchestrator's core: prompt leases, rollout ingest, scoring, group assembly, batches.

Plain synchronous code with no HTTP in it; `orchestrator.app` calls it from the event loop
(one thread, so no locks). Invariants:
- a group is one lease: `group_size` samples of one prompt, all answered by the lease holder;
- a rollout is scored here with the task's verifier, never with the worker's claimed reward;
- a group is served to the trainer at most once, and only if every sample is fresh for the
  trainer's version;
- no more groups are leased than can be consumed without going stale (`lease_budget`), nor
  than the buffer bound allows (`orchestrator.max_buffer_groups`, ready groups + open leases).

Leases. A lease has a deadline (`lease_timeout_s` after it was granted or last renewed). An
overdue lease expires: its prompt is leased again first, its partial samples are dropped
(counted under `dropped["lease_expired"]`), and a late sample for it is rejected with reason
`lease_expired`. Its holder may renew it before the deadline, or release it early.

Durability. With a journal (orchestrator/journal.py) every change is recorded as it is made;
the HTTP layer awaits the journal's commit before it answers, and a restarted orchestrator
rebuilds this state from the journal (`RunState(..., journal=...)` recovers at once).
Remembered for `dedupe_window_s` after a lease closes: the lease (so a late sample gets a
precise reason) and its rollout ids (so a resend is answered as a duplicate, counted once).
"""

from __future__ import annotations

import heapq
import logging
import random
import time
import uuid
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from transformers import PreTrainedTokenizerBase

from decentrl.advantages import group_advantages
from decentrl.config import RunConfig
from decentrl.model import end_of_sequence_ids
from decentrl.prompts import make_prompt_encoder
from decentrl.staleness import is_fresh, lease_budget, staleness
from decentrl.tasks import Task
from decentrl.tasks.episodes import EpisodeMismatch, EpisodeTask, replay_episode, tokenizer_codec
from decentrl.wire import (
    IngestResponse,
    Lease,
    LeaseState,
    Rejection,
    Rollout,
    SamplingParams,
    StatusResponse,
    TrainBatch,
    TrainSample,
    unpack_msgpack,
    value_range,
)
from orchestrator.codec import Packed, pack_floats, pack_ints, train_batch_msgpack
from orchestrator.detokenize import piece_table, table_decoder
from orchestrator.integrity import Integrity, token_of
from orchestrator.journal import Journal, Snapshot, decode_rollout

log = logging.getLogger("decentrl.orchestrator.state")

# Why a closed lease no longer takes samples -> the rejection reason of a late sample.
CLOSED_REASON = {
    "complete": "group_full",
    "served": "group_full",
    "expired": "lease_expired",
    "released": "lease_released",
    "dropped": "group_dropped",
}


class LeaseError(Exception):
    """A lease operation that cannot be done; `status` is the HTTP status to answer with."""

    status = 409


class LeaseNotFound(LeaseError):
    status = 404


class NotLeaseHolder(LeaseError):
    status = 403


class LeaseClosed(LeaseError):
    status = 409


@dataclass
class OpenLease:
    lease: Lease
    holder: str  # token name + worker id: only the holder may answer
    samples: list[Rollout] = field(default_factory=list)
    packed: list[Packed] = field(default_factory=list)  # per sample: completion ids and logprobs, packed
    check: list[int] = field(default_factory=list)  # samples whose logprobs are to be recomputed


@dataclass
class VerifyJob:
    """A complete group held back until the logprobs of `rollouts` are recomputed (orchestrator/verify.py)."""

    lease_id: str
    rollouts: list[Rollout]
    holder: str


@dataclass
class Group:
    lease_id: str
    prompt_id: int
    samples: list[tuple[Rollout, float]]  # (rollout, reward)
    packed: list[Packed]
    seq: int = 0  # place in line (completion order; ready_seq in the journal), set by _to_ready or when held back

    def oldest_version(self) -> int:
        return min(rollout.policy_version for rollout, _ in self.samples)


@dataclass
class ClosedLease:
    lease: Lease
    holder: str
    status: str  # complete (in the buffer), served, expired, released, dropped
    closed_at: float
    rollout_ids: list[str]


@dataclass
class ServedBatch:
    batch: TrainBatch
    lease_ids: list[str]
    packed: list[Packed]  # per sample of the batch
    prompts: dict[str, Any]  # lease id -> packed prompt ids

    def msgpack(self) -> bytes:
        return train_batch_msgpack(self.batch, self.packed, self.prompts)


def _plain_fast_tokenizer(tokenizer: PreTrainedTokenizerBase, *methods: str) -> Any:
    """The Rust tokenizer behind `tokenizer` if calling it directly gives what the HF methods
    would (the methods are not overridden by a subclass), else None."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase as Base
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:
        return None
    for name in methods:
        defined = getattr(TokenizersBackend, name, None) or getattr(Base, name, None)
        if defined is None or getattr(type(tokenizer), name, None) is not defined:
            return None
    return backend


def make_decoder(tokenizer: PreTrainedTokenizerBase) -> Callable[[list[list[int]]], list[str]]:
    """`tokenizer.batch_decode(ids, skip_special_tokens=True)`, calling the Rust tokenizer directly
    when that gives the same text (a plain fast tokenizer without clean-up): half the cost; and
    where its decode is a join of per-token pieces, joining them (orchestrator/detokenize.py): a
    quarter of that again."""
    backend = _plain_fast_tokenizer(tokenizer, "_decode", "decode", "batch_decode")
    if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        table = piece_table(backend)
        if table is not None:
            return table_decoder(table)
        return lambda sequences: backend.decode_batch(sequences, skip_special_tokens=True)
    return lambda sequences: tokenizer.batch_decode(sequences, skip_special_tokens=True)


def make_encoder(tokenizer: PreTrainedTokenizerBase) -> Callable[[str], list[int]]:
    """`tokenizer(text).input_ids`, calling the Rust tokenizer directly when that gives the same ids
    (a plain fast tokenizer with no truncation or padding of its own): half the cost."""
    backend = _plain_fast_tokenizer(tokenizer, "__call__", "_encode_plus")
    if backend is not None and backend.truncation is None and backend.padding is None:
        return lambda text: backend.encode(text).ids
    return lambda text: tokenizer(text).input_ids


class RunState:
    def __init__(
        self,
        *,
        config: RunConfig,
        task: Task | EpisodeTask,
        tokenizer: PreTrainedTokenizerBase,
        clock: Callable[[], float] = time.time,
        journal: Journal | None = None,
    ) -> None:
        self.config = config
        self.task = task
        self.tokenizer = tokenizer
        self.clock = clock
        self.journal = journal
        self.started_at = clock()
        options = config.orchestrator
        if options.max_buffer_groups < config.trainer.groups_per_step:
            raise ValueError(
                f"orchestrator.max_buffer_groups ({options.max_buffer_groups}) must be at least "
                f"trainer.groups_per_step ({config.trainer.groups_per_step}), or no batch could ever form"
            )
        self.sampling = SamplingParams(**config.sampling.model_dump())
        self.vocab_size = len(tokenizer)
        self._decode = make_decoder(tokenizer)
        self._encode = make_encoder(tokenizer)
        self._render_prompt = make_prompt_encoder(config.prompt, tokenizer, task, raw=self._encode)
        self._episode_codec = tokenizer_codec(tokenizer) if isinstance(task, EpisodeTask) else None
        self.published_version: int | None = None
        self.trainer_version = 0
        self.leases: dict[str, OpenLease] = {}
        self._deadlines: list[tuple[float, str]] = []  # heap; stale entries skipped lazily
        self.ready: deque[Group] = deque()
        self.closed: dict[str, ClosedLease] = {}
        self._closed_order: deque[tuple[float, str]] = deque()  # (closed_at, lease_id), for forgetting
        self.seen_rollout_ids: dict[str, str] = {}  # rollout id -> lease id, while its lease is remembered
        self.served: OrderedDict[str, ServedBatch] = OrderedDict()  # request id -> batch, newest last
        self._served_leases: set[str] = set()  # leases of the batches in `served`
        self._served_by_batch_id: dict[str, ServedBatch] = {}
        self._prompt_order = list(range(task.num_prompts))
        random.Random(config.task.seed).shuffle(self._prompt_order)
        self._prompt_cursor = 0
        self._prompt_cache: OrderedDict[int, list[int]] = OrderedDict()
        self._requeued: deque[int] = deque()  # prompts of expired leases go out first
        self._ready_seq = 0
        self.rollouts_accepted = 0
        self.tokens_accepted = 0  # prompt + completion tokens of the rollouts accepted
        self.duplicates = 0
        self.rejected: Counter[str] = Counter()
        self.dropped: Counter[str] = Counter()  # accepted samples dropped later, per reason
        self.stale_dropped = 0
        self.groups_served = 0
        self.leases_expired = 0
        self.recoveries = 0
        self.recent_rewards: deque[float] = deque(maxlen=512)
        # What ends a generation for the finish-reason and turn-end checks: the ids the worker
        # backends stop at (tokenizer and generation config) and, leniently, any special token.
        self._end_ids = end_of_sequence_ids(config.model, tokenizer) | set(tokenizer.all_special_ids)
        self.integrity = Integrity(
            options.verification, eos_ids=self._end_ids, decode=lambda ids: self._decode([ids])[0],
            journaled=journal is not None,
        )
        self.pending: dict[str, Group] = {}  # lease id -> complete group waiting for its logprob check
        self.verify_queue: deque[VerifyJob] = deque()
        if journal is not None:
            journal.set_meta_source(self._meta)
            journal.set_integrity_source(self.integrity.journal_changes)
            snapshot = journal.load()
            if snapshot.meta:
                self._recover(snapshot)
            journal.meta_dirty = True
            journal.flush()

    # -- journal --------------------------------------------------------------------------

    def _dirty(self) -> None:
        if self.journal is not None:
            self.journal.meta_dirty = True

    def _meta(self) -> dict[str, Any]:
        return {
            "published_version": self.published_version,
            "trainer_version": self.trainer_version,
            "prompt_cursor": self._prompt_cursor,
            "requeued": list(self._requeued),
            "ready_seq": self._ready_seq,
            "rollouts_accepted": self.rollouts_accepted,
            "tokens_accepted": self.tokens_accepted,
            "duplicates": self.duplicates,
            "rejected": dict(self.rejected),
            "dropped": dict(self.dropped),
            "stale_dropped": self.stale_dropped,
            "groups_served": self.groups_served,
            "leases_expired": self.leases_expired,
            "recoveries": self.recoveries,
        }

    def _recover(self, snapshot: Snapshot) -> None:
        """Rebuild the state the journal committed: versions, counters, leases, buffer, batches."""
        meta = snapshot.meta
        self.published_version = meta["published_version"]
        self.trainer_version = meta["trainer_version"]
        self._prompt_cursor = meta["prompt_cursor"]
        self._requeued = deque(meta["requeued"])
        self._ready_seq = meta["ready_seq"]
        self.rollouts_accepted = meta["rollouts_accepted"]
        self.tokens_accepted = meta.get("tokens_accepted", 0)
        self.duplicates = meta["duplicates"]
        self.rejected = Counter(meta["rejected"])
        self.dropped = Counter(meta["dropped"])
        self.stale_dropped = meta["stale_dropped"]
        self.groups_served = meta["groups_served"]
        self.leases_expired = meta["leases_expired"]
        self.recoveries = meta["recoveries"] + 1
        run_name = self.config.run_name
        ready: list[tuple[int, Group]] = []
        rebuilt: dict[str, list[Rollout]] = {}
        for row in sorted(snapshot.leases, key=lambda r: (r["closed_at"] or 0.0, r["lease_id"])):
            lease = Lease(
                lease_id=row["lease_id"],
                prompt_id=row["prompt_id"],
                prompt_token_ids=unpack_msgpack(row["prompt_token_ids"]),
                group_size=row["group_size"],
                deadline=row["deadline"],
            )
            entries = snapshot.rollouts.get(lease.lease_id, [])
            ids = [rollout_id for rollout_id, _ in entries]
            for rollout_id in ids:
                self.seen_rollout_ids[rollout_id] = lease.lease_id
            samples = [
                decode_rollout(
                    data, rollout_id=rollout_id, lease_id=lease.lease_id, run_name=run_name,
                    prompt_token_ids=lease.prompt_token_ids,
                )
                for rollout_id, data in entries
                if data is not None
            ]
            rebuilt[lease.lease_id] = samples
            packed = [_pack(sample) for sample in samples]
            status = row["status"]
            if status == "open":
                self.leases[lease.lease_id] = OpenLease(lease=lease, holder=row["holder"], samples=samples, packed=packed)
                heapq.heappush(self._deadlines, (lease.deadline, lease.lease_id))
                continue
            self.closed[lease.lease_id] = ClosedLease(lease, row["holder"], status, row["closed_at"], ids)
            self._closed_order.append((row["closed_at"], lease.lease_id))
            if status == "complete":
                rewards = _json_list(row["rewards"])
                samples_rewards = list(zip(samples, rewards))
                ready.append((row["ready_seq"], Group(lease.lease_id, lease.prompt_id, samples_rewards, packed, row["ready_seq"])))
        self.ready = deque(group for _, group in sorted(ready, key=lambda item: item[0]))
        for request_id, body in snapshot.batches:
            lease_ids = body["lease_ids"]
            if not all(lease_id in self.closed and lease_id in rebuilt for lease_id in lease_ids):
                log.warning("journal: batch %s refers to forgotten leases; it cannot be served again", body["batch_id"])
                continue
            groups = [
                Group(
                    lease_id, self.closed[lease_id].lease.prompt_id, list(zip(rebuilt[lease_id], body["rewards"][i])),
                    [_pack(sample) for sample in rebuilt[lease_id]],
                )
                for i, lease_id in enumerate(lease_ids)
            ]
            batch = self._build_batch(groups, body["trainer_version"], body["batch_id"])
            batch = batch.model_copy(
                update={"rollouts_accepted": body["rollouts_accepted"], "stale_dropped": body["stale_dropped"]}
            )
            self.served[request_id] = self._served_batch(batch, groups)
        self._recover_integrity(snapshot)
        log.info(
            "recovered from %s: version %s, trainer version %d, %d open leases, %d ready groups, "
            "%d rollouts acknowledged so far",
            self.journal.path if self.journal else "?", self.published_version, self.trainer_version,
            len(self.leases), len(self.ready), self.rollouts_accepted,
        )

    def _recover_integrity(self, snapshot: Snapshot) -> None:
        """Strikes, bans, trust and replay hashes as committed. Which samples were chosen for a
        logprob check is not journaled: with verification on, every recovered sample of an open
        lease is checked, and a lease already full (a group held back for its check when the
        orchestrator stopped) completes now and is checked whole."""
        self.integrity.restore(snapshot.workers, snapshot.content)
        for name, record in self.integrity.workers.items():
            if record.banned:
                self.drop_banned(name)  # nothing, normally: its groups were dropped with the ban
        if not self.config.orchestrator.verification.enabled:
            return
        for open_lease in list(self.leases.values()):
            open_lease.check = list(range(len(open_lease.samples)))
            if len(open_lease.samples) >= open_lease.lease.group_size:
                self._complete(open_lease)

    # -- leases ---------------------------------------------------------------------------

    def _next_prompt_id(self) -> int:
        self._dirty()
        if self._requeued:
            return self._requeued.popleft()
        prompt_id = self._prompt_order[self._prompt_cursor % len(self._prompt_order)]
        self._prompt_cursor += 1
        return prompt_id

    def _prompt_ids(self, prompt_id: int) -> list[int]:
        """The prompt's token ids; the last few thousand are cached (prompts come back each epoch)."""
        ids = self._prompt_cache.pop(prompt_id, None)
        if ids is None:
            ids = self._render_prompt(self.task.prompt(prompt_id))
        self._prompt_cache[prompt_id] = ids
        if len(self._prompt_cache) > 4096:
            self._prompt_cache.popitem(last=False)
        return ids

    @property
    def buffer_limit(self) -> int:
        return self.config.orchestrator.max_buffer_groups

    def buffer_full(self) -> bool:
        return len(self.ready) >= self.buffer_limit

    def lease_capacity(self) -> int:
        if self.published_version is None:
            return 0
        committed = self.groups_served + len(self.ready) + len(self.pending) + len(self.leases)
        budget = lease_budget(
            self.published_version,
            self.config.max_staleness,
            self.config.trainer.groups_per_step,
            committed,
        )
        return max(0, min(budget, self.buffer_limit - len(self.ready) - len(self.pending) - len(self.leases)))

    def grant_leases(self, holder: str, max_groups: int) -> list[Lease]:
        self.expire_leases()
        granted = []
        for _ in range(min(max_groups, self.lease_capacity())):
            prompt_id = self._next_prompt_id()
            lease = Lease(
                lease_id=uuid.uuid4().hex,
                prompt_id=prompt_id,
                prompt_token_ids=self._prompt_ids(prompt_id),
                group_size=self.config.group_size,
                deadline=self.clock() + self.config.orchestrator.lease_timeout_s,
            )
            self.leases[lease.lease_id] = OpenLease(lease=lease, holder=holder)
            heapq.heappush(self._deadlines, (lease.deadline, lease.lease_id))
            if self.journal is not None:
                self.journal.lease_granted(lease, holder)
            granted.append(lease)
        return granted

    def expire_leases(self) -> int:
        """Close overdue leases and lease their prompts again; a late answer is rejected."""
        now, expired = self.clock(), 0
        while self._deadlines and self._deadlines[0][0] < now:
            deadline, lease_id = heapq.heappop(self._deadlines)
            open_lease = self.leases.get(lease_id)
            if open_lease is None or open_lease.lease.deadline != deadline:
                continue  # closed already, or renewed (a later heap entry stands for it)
            self._close_open(lease_id, "expired", requeue=True)
            self.leases_expired += 1
            expired += 1
        return expired

    def _close_open(
        self, lease_id: str, status: str, *, requeue: bool, front: bool = False, reason: str | None = None
    ) -> OpenLease:
        """Close an open lease that will not complete; its samples are dropped."""
        open_lease = self.leases.pop(lease_id)
        self.integrity.forget_lease(lease_id)
        if requeue:
            if front:
                self._requeued.appendleft(open_lease.lease.prompt_id)
            else:
                self._requeued.append(open_lease.lease.prompt_id)
        if open_lease.samples:
            default = f"lease_{status}" if status != "dropped" else "stale_at_ingest"
            self.dropped[reason or default] += len(open_lease.samples)
        self._remember_closed(open_lease.lease, open_lease.holder, status, [r.rollout_id for r in open_lease.samples])
        if self.journal is not None:
            self.journal.lease_closed(lease_id, status, self.clock(), drop_samples=bool(open_lease.samples))
        self._dirty()
        return open_lease

    def _remember_closed(self, lease: Lease, holder: str, status: str, rollout_ids: list[str]) -> None:
        now = self.clock()
        self.closed[lease.lease_id] = ClosedLease(lease, holder, status, now, rollout_ids)
        self._closed_order.append((now, lease.lease_id))

    def _owned(self, lease_id: str, holder: str) -> OpenLease | ClosedLease:
        found: OpenLease | ClosedLease | None = self.leases.get(lease_id) or self.closed.get(lease_id)
        if found is None:
            raise LeaseNotFound(
                f"no lease {lease_id!r}: never granted, or closed more than "
                f"{self.config.orchestrator.dedupe_window_s:.0f}s ago"
            )
        if found.holder != holder:
            raise NotLeaseHolder(f"lease {lease_id!r} is held by another worker")
        return found

    def lease_state(self, lease_id: str, holder: str) -> LeaseState:
        found = self._owned(lease_id, holder)
        if isinstance(found, OpenLease):
            state, samples = "open", len(found.samples)
        else:
            state, samples = found.status, len(found.rollout_ids)
        lease = found.lease
        return LeaseState(
            lease_id=lease_id, prompt_id=lease.prompt_id, state=state, samples=samples,  # type: ignore[arg-type]
            group_size=lease.group_size, deadline=lease.deadline,
        )

    def renew_lease(self, lease_id: str, holder: str) -> Lease:
        """Push an open lease's deadline to `lease_timeout_s` from now (a slow worker's heartbeat)."""
        self.expire_leases()
        found = self._owned(lease_id, holder)
        if not isinstance(found, OpenLease):
            raise LeaseClosed(f"lease {lease_id!r} is {found.status}; it can no longer be renewed")
        deadline = self.clock() + self.config.orchestrator.lease_timeout_s
        found.lease = found.lease.model_copy(update={"deadline": deadline})
        heapq.heappush(self._deadlines, (deadline, lease_id))
        if self.journal is not None:
            self.journal.lease_renewed(lease_id, deadline)
        return found.lease

    def release_lease(self, lease_id: str, holder: str) -> LeaseState:
        """The holder gives an open lease back: its prompt goes out again next, its samples are dropped."""
        self.expire_leases()
        found = self._owned(lease_id, holder)
        if not isinstance(found, OpenLease):
            raise LeaseClosed(f"lease {lease_id!r} is {found.status}; there is nothing to release")
        self._close_open(lease_id, "released", requeue=True, front=True)
        return self.lease_state(lease_id, holder)

    # -- ingest ---------------------------------------------------------------------------

    def _check(self, rollout: Rollout, holder: str) -> str | None:
        """The reason to reject a rollout, or None to accept it."""
        if rollout.run_name != self.config.run_name:
            return "wrong_run"
        open_lease = self.leases.get(rollout.lease_id)
        if open_lease is None:
            closed = self.closed.get(rollout.lease_id)
            return CLOSED_REASON[closed.status] if closed is not None else "unknown_or_expired_lease"
        lease = open_lease.lease
        if open_lease.holder != holder:
            return "not_lease_holder"
        if rollout.prompt_id != lease.prompt_id or rollout.prompt_token_ids != lease.prompt_token_ids:
            return "prompt_mismatch"
        if rollout.sampling != self.sampling:
            return "sampling_mismatch"
        if self.published_version is None or rollout.policy_version > self.published_version:
            return "future_version"
        if not is_fresh(self.trainer_version, rollout.policy_version, self.config.max_staleness):
            return "stale"
        ids = rollout.completion_token_ids
        low, high = value_range(ids)  # numpy over the packed bytes when they came packed
        if low < 0 or high >= self.vocab_size:
            return "token_out_of_vocabulary"
        if len(ids) > self.sampling.max_tokens:
            return "too_many_tokens"
        if rollout.token_versions is not None:
            low, high = value_range(rollout.token_versions)
            if low < rollout.policy_version or high > self.published_version:
                return "bad_token_versions"
        if rollout.sampling_mask is not None and any(
            mask and (min(mask) < 0 or max(mask) >= self.vocab_size) for mask in rollout.sampling_mask
        ):
            return "token_out_of_vocabulary"
        if rollout.expert_routing is not None and any(
            route and (min(route) < 0 or max(route) > 2**31) for route in rollout.expert_routing
        ):
            return "bad_expert_routing"
        if isinstance(self.task, EpisodeTask):  # the replay checks the ending too
            try:
                self._episode_reward(rollout)
            except EpisodeMismatch as exc:
                log.info("rollout %s: %s", rollout.rollout_id, exc)
                return "episode_mismatch"
        elif rollout.loss_mask is not None:
            return "loss_mask_without_episodes"  # a single-turn task has no environment tokens
        elif self.config.orchestrator.verification.enabled and self.integrity.finish_reason_problem(rollout):
            return "bad_finish_reason"
        return None

    def ingest(
        self, rollouts: Sequence[Rollout], holder: str, packed: Sequence[Packed | None] | None = None
    ) -> IngestResponse:
        """Check, count and keep each rollout; complete groups are scored and join the buffer.

        `packed` (optional, aligned with `rollouts`): completion ids and logprobs already packed
        as typed arrays (as a msgpack body carried them), kept instead of packing them again.
        """
        self.expire_leases()
        accepted, duplicates, rejected = 0, 0, []
        for index, rollout in enumerate(rollouts):
            if rollout.rollout_id in self.seen_rollout_ids:
                duplicates += 1
                continue
            reason = "banned" if self.integrity.is_banned(holder) else self._check(rollout, holder)
            digest = None
            if reason is None and self.config.orchestrator.verification.enabled:
                digest = self.integrity.replay_of(rollout)
                reason = "replay" if digest is None else None
            if reason is not None:
                self.rejected[reason] += 1
                self.integrity.rejected(holder, reason)
                if reason == "stale":
                    # The group can no longer train as a whole: free its slot at once
                    # rather than hold it until the lease expires.
                    dropped = self._close_open(rollout.lease_id, "dropped", requeue=True)
                    self.stale_dropped += 1 + len(dropped.samples)
                rejected.append(Rejection(rollout_id=rollout.rollout_id, reason=reason))
                continue
            self.seen_rollout_ids[rollout.rollout_id] = rollout.lease_id
            open_lease = self.leases[rollout.lease_id]
            # Equal to the lease's prompt (checked): share that list instead of keeping a copy.
            rollout.__dict__["prompt_token_ids"] = open_lease.lease.prompt_token_ids
            open_lease.samples.append(rollout)
            arrays = (packed[index] if packed is not None else None) or _pack(rollout)
            open_lease.packed.append(arrays)
            if digest is not None:  # verification enabled
                self.integrity.kept(rollout.lease_id, digest, rollout.policy_version)
                if self.integrity.wants_check(holder):
                    open_lease.check.append(len(open_lease.samples) - 1)
            self.tokens_accepted += len(rollout.prompt_token_ids) + len(rollout.completion_token_ids)
            if self.journal is not None:
                self.journal.rollout_accepted(rollout, arrays)
            accepted += 1
            if len(open_lease.samples) == open_lease.lease.group_size:
                self._complete(open_lease)
        if accepted or duplicates or rejected:
            self._dirty()
        self.rollouts_accepted += accepted
        self.duplicates += duplicates
        return IngestResponse(accepted=accepted, duplicates=duplicates, rejected=rejected)

    def _episode_reward(self, rollout: Rollout) -> float:
        """Replay the episode's environment over the transcript (decentrl/tasks/episodes.py)."""
        assert isinstance(self.task, EpisodeTask) and self._episode_codec is not None
        return replay_episode(
            self.task, self.task.prompt(rollout.prompt_id), rollout.completion_token_ids, rollout.loss_mask,
            rollout.finish_reason, rollout.sampling, self._episode_codec, eos_ids=self._end_ids,
        )

    def _score(self, rollouts: list[Rollout]) -> list[float]:
        if isinstance(self.task, EpisodeTask):
            return [self._episode_reward(rollout) for rollout in rollouts]
        texts = self._decode([rollout.completion_token_ids for rollout in rollouts])
        return [self.task.reward(self.task.prompt(r.prompt_id), text) for r, text in zip(rollouts, texts, strict=True)]

    def _complete(self, open_lease: OpenLease) -> None:
        lease = open_lease.lease
        del self.leases[lease.lease_id]
        rollout_ids = [r.rollout_id for r in open_lease.samples]
        oldest = min(r.policy_version for r in open_lease.samples)
        if not is_fresh(self.trainer_version, oldest, self.config.max_staleness):
            # Its first samples were fresh when they came, but the trainer moved on since.
            self.stale_dropped += len(open_lease.samples)
            self.dropped["stale_in_buffer"] += len(open_lease.samples)
            self._remember_closed(lease, open_lease.holder, "dropped", rollout_ids)
            if self.journal is not None:
                self.journal.lease_closed(lease.lease_id, "dropped", self.clock(), drop_samples=True)
            return
        rewards = self._score(open_lease.samples)
        for rollout, reward in zip(open_lease.samples, rewards, strict=True):
            self.integrity.reward_claimed(open_lease.holder, rollout.claimed_reward, reward)
        group = Group(lease.lease_id, lease.prompt_id, list(zip(open_lease.samples, rewards)), open_lease.packed)
        self._remember_closed(lease, open_lease.holder, "complete", rollout_ids)
        if open_lease.check:
            # Held back: the trainer sees the group only once its sampled logprobs check out; it
            # keeps its place in line meanwhile (no later group overtakes it towards staleness).
            self._ready_seq += 1
            group.seq = self._ready_seq
            self.pending[lease.lease_id] = group
            self.verify_queue.append(
                VerifyJob(lease.lease_id, [open_lease.samples[i] for i in open_lease.check], open_lease.holder)
            )
            return
        self._to_ready(group)

    def _to_ready(self, group: Group) -> None:
        if not group.seq:
            self._ready_seq += 1
            group.seq = self._ready_seq
            self.ready.append(group)
        else:  # checked after being held back: back to its place in line
            position = len(self.ready)
            while position and self.ready[position - 1].seq > group.seq:
                position -= 1
            self.ready.insert(position, group)
        if self.journal is not None:
            self.journal.group_completed(group.lease_id, group.seq, [reward for _, reward in group.samples], self.clock())

    # -- verification (orchestrator/verify.py runs the checks, orchestrator/app.py the loop) --

    def _drop_closed_group(self, lease_id: str, reason: str, samples: int) -> None:
        self.dropped[reason] += samples
        closed = self.closed[lease_id]
        closed.status, closed.closed_at = "dropped", self.clock()
        self._closed_order.append((closed.closed_at, lease_id))
        self.integrity.forget_lease(lease_id)
        if self.journal is not None:
            self.journal.lease_closed(lease_id, "dropped", closed.closed_at, drop_samples=True)
        self._dirty()

    def verification_done(self, lease_id: str, failed: dict[str, str]) -> None:
        """The check of a held-back group is done; `failed`: rollout id -> rejection reason
        (`logprob_mismatch` strikes its worker; `unverifiable` does not). A group with any failed
        sample is dropped whole; a clean one joins the buffer if it is still fresh."""
        group = self.pending.pop(lease_id, None)
        if group is None:
            return  # dropped meanwhile (its worker was banned)
        holder = self.closed[lease_id].holder
        if failed:
            for reason in failed.values():
                self.rejected[reason] += 1
                self.integrity.rejected(holder, reason)
            self._drop_closed_group(lease_id, "failed_verification", len(group.samples) - len(failed))
            return
        self.integrity.record(holder).passed += 1
        if not is_fresh(self.trainer_version, group.oldest_version(), self.config.max_staleness):
            self.stale_dropped += len(group.samples)
            self._drop_closed_group(lease_id, "stale_in_buffer", len(group.samples))
        else:
            self._to_ready(group)

    def held_back_ahead(self, count: int) -> bool:
        """Whether a group held back for its check is among the first `count` complete groups in
        line. A batch taken now would skip it and it would train a batch later than its lease
        was budgeted for (maybe stale by then): the batch waits for the check instead."""
        if not self.pending:
            return False
        first = min(group.seq for group in self.pending.values())
        ahead = 0
        for group in self.ready:  # in line order
            if group.seq > first or ahead >= count:
                break
            ahead += 1
        return ahead < count

    def drop_banned(self, token: str) -> int:
        """A banned token's open leases, held-back and ready groups are dropped (its prompts are
        leased again): what it sent unchecked is no longer trusted. Returns samples dropped."""
        dropped = 0
        for lease_id in [i for i, lease in self.leases.items() if token_of(lease.holder) == token]:
            dropped += len(self._close_open(lease_id, "dropped", requeue=True, reason="banned_worker").samples)
        for lease_id in [i for i in self.pending if token_of(self.closed[i].holder) == token]:
            group = self.pending.pop(lease_id)
            self._drop_closed_group(lease_id, "banned_worker", len(group.samples))
            dropped += len(group.samples)
        self.verify_queue = deque(job for job in self.verify_queue if job.lease_id in self.pending)  # no check wasted on it
        kept: deque[Group] = deque()
        for group in self.ready:
            if token_of(self.closed[group.lease_id].holder) == token:
                self._drop_closed_group(group.lease_id, "banned_worker", len(group.samples))
                dropped += len(group.samples)
            else:
                kept.append(group)
        self.ready = kept
        return dropped

    # -- trainer side ---------------------------------------------------------------------

    def advance(self, trainer_version: int) -> None:
        """The trainer now holds `trainer_version`: evict groups that can no longer train."""
        if trainer_version <= self.trainer_version:
            return  # groups in the buffer were fresh for this version when they arrived
        self.trainer_version = trainer_version
        self._dirty()
        fresh = deque()
        for group in self.ready:
            if is_fresh(self.trainer_version, group.oldest_version(), self.config.max_staleness):
                fresh.append(group)
            else:
                self.stale_dropped += len(group.samples)
                self.dropped["stale_in_buffer"] += len(group.samples)
                closed = self.closed[group.lease_id]
                closed.status, closed.closed_at = "dropped", self.clock()
                self._closed_order.append((closed.closed_at, group.lease_id))
                if self.journal is not None:
                    self.journal.lease_closed(group.lease_id, "dropped", closed.closed_at, drop_samples=True)
        self.ready = fresh

    def announce(self, version: int) -> None:
        """Version `version` is complete in the store; workers may pull it."""
        self.published_version = max(version, self.published_version or 0)
        self._dirty()
        self.advance(version)

    def served_batch(self, request_id: str) -> TrainBatch | None:
        """The batch already served for this request id, if it is still kept."""
        served = self.served.get(request_id)
        return served.batch if served is not None else None

    def batch_msgpack(self, batch: TrainBatch) -> bytes | None:
        """A kept batch as msgpack, from the arrays packed at ingest (None if no longer kept)."""
        served = self._served_by_batch_id.get(batch.batch_id or "")
        return served.msgpack() if served is not None and served.batch is batch else None

    def _served_batch(self, batch: TrainBatch, groups: list[Group]) -> ServedBatch:
        served = ServedBatch(
            batch,
            [group.lease_id for group in groups],
            [packed for group in groups for packed in group.packed],
            {group.lease_id: pack_ints(group.samples[0][0].prompt_token_ids) for group in groups if group.samples},
        )
        self._served_by_batch_id[batch.batch_id or ""] = served
        self._served_leases.update(served.lease_ids)
        return served

    def _build_batch(self, groups: list[Group], trainer_version: int, batch_id: str) -> TrainBatch:
        normalize_std = self.config.trainer.advantages.normalize_std
        samples, histogram = [], Counter()
        for group in groups:
            rewards = [reward for _, reward in group.samples]
            advantages = group_advantages(rewards, normalize_std=normalize_std)
            for (rollout, reward), advantage in zip(group.samples, advantages, strict=True):
                # Fields were validated at ingest: construct without copying the token lists.
                samples.append(
                    TrainSample.model_construct(
                        prompt_token_ids=rollout.prompt_token_ids,
                        completion_token_ids=rollout.completion_token_ids,
                        logprobs=rollout.logprobs,
                        advantage=advantage,
                        reward=reward,
                        policy_version=rollout.policy_version,
                        group_id=rollout.lease_id,
                        rollout_id=rollout.rollout_id,
                        sampling_mask=rollout.sampling_mask,
                        loss_mask=rollout.loss_mask,
                    )
                )
                histogram[str(staleness(trainer_version, rollout.policy_version))] += 1
        return TrainBatch(
            trainer_version=trainer_version,
            samples=samples,
            staleness_histogram=dict(sorted(histogram.items())),
            rollouts_accepted=self.rollouts_accepted,
            stale_dropped=self.stale_dropped,
            batch_id=batch_id,
        )

    def take_batch(self, trainer_version: int, request_id: str | None = None) -> TrainBatch | None:
        """The next `groups_per_step` fresh groups, oldest first, or None if not enough yet.

        With a `request_id` already answered (its answer was lost and the trainer asks again),
        the same batch again, as long as it is among the last `batches_kept`.
        """
        if request_id is not None and (again := self.served_batch(request_id)) is not None:
            return again
        self.advance(trainer_version)
        wanted = self.config.trainer.groups_per_step
        if len(self.ready) < wanted or self.held_back_ahead(wanted):
            return None
        groups = [self.ready.popleft() for _ in range(wanted)]
        self.groups_served += wanted
        self._dirty()
        batch = self._build_batch(groups, self.trainer_version, uuid.uuid4().hex)
        for group in groups:
            self.recent_rewards.extend(reward for _, reward in group.samples)
            self.integrity.record(self.closed[group.lease_id].holder).served += len(group.samples)
        now = self.clock()
        lease_ids = [group.lease_id for group in groups]
        for lease_id in lease_ids:
            closed = self.closed[lease_id]
            closed.status, closed.closed_at = "served", now
            self._closed_order.append((now, lease_id))
            if self.journal is not None:
                self.journal.lease_closed(lease_id, "served", now, drop_samples=False)
        key = request_id or batch.batch_id
        assert batch.batch_id is not None
        if self.journal is not None:
            self.journal.batch_served(
                key,
                now,
                {
                    "batch_id": batch.batch_id,
                    "trainer_version": batch.trainer_version,
                    "lease_ids": lease_ids,
                    "rewards": [[reward for _, reward in group.samples] for group in groups],
                    "rollouts_accepted": batch.rollouts_accepted,
                    "stale_dropped": batch.stale_dropped,
                },
            )
        self.served[key] = self._served_batch(batch, groups)
        while len(self.served) > self.config.orchestrator.batches_kept:
            old_key, old = self.served.popitem(last=False)
            self._served_leases.difference_update(old.lease_ids)
            self._served_by_batch_id.pop(old.batch.batch_id or "", None)
            if self.journal is not None:
                self.journal.batch_forgotten(old_key, old.lease_ids)
        return batch

    # -- upkeep ---------------------------------------------------------------------------

    def forget_closed(self, limit: int = 10_000) -> int:
        """Forget leases closed more than `dedupe_window_s` ago (and their rollout ids)."""
        horizon = self.clock() - self.config.orchestrator.dedupe_window_s
        forgotten = 0
        while self._closed_order and self._closed_order[0][0] < horizon and forgotten < limit:
            closed_at, lease_id = self._closed_order.popleft()
            closed = self.closed.get(lease_id)
            if closed is None or closed.closed_at != closed_at:
                continue  # its status changed later; a later entry stands for it
            if closed.status == "complete" or lease_id in self._served_leases:
                # In the buffer, or in a batch that may be asked for again: look again later.
                self._closed_order.append((self.clock(), lease_id))
                closed.closed_at = self._closed_order[-1][0]
                continue
            del self.closed[lease_id]
            for rollout_id in closed.rollout_ids:
                self.seen_rollout_ids.pop(rollout_id, None)
            if self.journal is not None:
                self.journal.lease_forgotten(lease_id)
            forgotten += 1
        return forgotten

    def status(self) -> StatusResponse:
        rewards = list(self.recent_rewards)
        return StatusResponse(
            run_name=self.config.run_name,
            policy_version=self.published_version,
            trainer_version=self.trainer_version,
            rollouts_accepted=self.rollouts_accepted,
            rollouts_rejected=dict(self.rejected),
            stale_dropped=self.stale_dropped,
            groups_ready=len(self.ready),
            groups_served=self.groups_served,
            leases_active=len(self.leases),
            leases_expired=self.leases_expired,
            reward_mean_recent=sum(rewards) / len(rewards) if rewards else None,
            uptime_s=self.clock() - self.started_at,
            rollouts_duplicate=self.duplicates,
            dropped=dict(self.dropped),
            buffer_limit=self.buffer_limit,
            journal=self.journal is not None,
            recoveries=self.recoveries,
            groups_verifying=len(self.pending),
            workers=self.integrity.summary(),
        )


def _pack(rollout: Rollout) -> Packed:
    return pack_ints(rollout.completion_token_ids), pack_floats(rollout.logprobs)


def _json_list(text: str) -> list[Any]:
    import json

    return json.loads(text)
