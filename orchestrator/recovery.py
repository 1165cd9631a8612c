"""Recovery: the journal's meta row, and the state rebuilt from what the journal committed.

RunState calls `recover` with the journal's snapshot before it serves anything, then redoes what a
restart cannot know (which samples were picked for a logprob check).
"""

from __future__ import annotations

import functools
import json
import logging
from collections import Counter, deque
from collections.abc import Callable, Iterable
from typing import Any

from decentrl.api.wire import Lease, Rollout, StaleReport, TrainBatch
from decentrl.config import AdvantageConfig
from decentrl.rl.determinism import required_version
from orchestrator.batches import KeptBatches, ServedBatch, build_batch
from orchestrator.buffer import Buffer, Group
from orchestrator.codec import decode_rollout
from orchestrator.counters import Counters, Versions
from orchestrator.integrity import Integrity
from orchestrator.journal import RunJournal, Snapshot, lease_of
from orchestrator.leases import ClosedLease, LeaseBook, OpenLease

log = logging.getLogger("decentrl.orchestrator.recovery")

# The counters the meta row holds under their own names; one a journal of an older version lacks starts at 0.
COUNTS = (
    "rollouts_accepted", "tokens_accepted", "duplicates", "stale_dropped", "groups_served", "groups_skipped",
    "leases_expired", "hedged_leases", "hedge_duplicates", "hedge_mismatches", "hedge_copies_told", "recoveries",
)


def meta_row(
    *, versions: Versions, counters: Counters, lease_book: LeaseBook, buffer: Buffer, streams: dict[str, Versions] | None = None,
    taken: dict[str, set[str]] | None = None,
) -> dict[str, Any]:
    """The journal's meta row (key "state"): versions (a run of two policies: each stream's too,
    and which policies' trainers took each ready unit, `taken`), prompt order position, counters,
    and the places a step consumes (which pin a deterministic run's places to versions)."""
    return {
        "streams": {name: [stream.published, stream.trainer, stream.consumed] for name, stream in (streams or {}).items()},
        "taken": {lease_id: sorted(policies) for lease_id, policies in (taken or {}).items()},
        "places_per_step": lease_book.config.places_per_step,
        "published_version": versions.published,
        "trainer_version": versions.trainer,
        "prompt_cursor": lease_book.prompts.cursor,
        "requeued": list(lease_book.prompts.requeued),
        "ready_seq": buffer.ready_seq,
        "rejected": dict(counters.rejected),
        "dropped": dict(counters.dropped),
        **{name: getattr(counters, name) for name in COUNTS},
    }


def _with_place(lease: Lease, lease_book: LeaseBook, ready_seq: int | None, groups_consumed: int) -> Lease:
    """Deterministic runs: a recovered lease with its place and version again. A complete group's
    place is its ready_seq; an open lease's is the last place before the cursor that holds its
    prompt (a prompt occurs once in any num_prompts consecutive places, and an open lease's place
    lies between the groups consumed and the cursor)."""
    queue = lease_book.prompts
    if ready_seq:
        index = ready_seq - 1
    else:
        if queue.cursor - groups_consumed > len(queue.order):
            raise ValueError(
                f"journal: cannot place open lease {lease.lease_id} of a deterministic run: more places are in "
                f"flight ({queue.cursor - groups_consumed}) than the task has prompts ({len(queue.order)}); "
                "use a task with more prompts than (max_staleness + 2) * the groups a step consumes"
            )
        index = queue.cursor - 1 - (queue.cursor - 1 - queue.order.index(lease.prompt_id)) % len(queue.order)
    version = required_version(
        index, groups_per_step=lease_book.config.places_per_step, max_staleness=lease_book.config.max_staleness
    )
    return lease.model_copy(update={"index": index, "policy_version": version})


def recover(
    snapshot: Snapshot,
    *,
    journal: RunJournal,
    run_name: str,
    versions: Versions,
    counters: Counters,
    lease_book: LeaseBook,
    buffer: Buffer,
    batches: KeptBatches,
    advantages: AdvantageConfig,
    integrity: Integrity,
    restore_steps: Callable[[Group], None],
    streams: dict[str, Versions] | None = None,
) -> None:
    """Rebuild the state the journal committed, into freshly made, empty parts. Samples of
    buffered and kept groups are read from the journal when first needed; closed leases' rollout
    ids stay on disk. `restore_steps` gives a group in the ready queue or in a kept batch its
    process rewards again, so a batch asked for again carries the same token advantages."""
    meta = snapshot.meta
    pinned, places = meta.get("places_per_step"), lease_book.config.places_per_step  # absent in older journals
    if lease_book.config.deterministic and pinned is not None and pinned != places:
        raise ValueError(
            f"this deterministic run's journal consumed {pinned} places a step, the config says {places} "
            "(trainer.groups_per_step, times orchestrator.dynamic_sampling.oversample when it is on): a place's version "
            "follows from it, so it cannot change between starts; restore the setting, or start a new run dir"
        )
    versions.published, versions.trainer = meta["published_version"], meta["trainer_version"]
    for name, (published, trainer, consumed) in meta.get("streams", {}).items():  # absent in older journals
        if streams is not None and name in streams:
            streams[name].published, streams[name].trainer, streams[name].consumed = published, trainer, consumed
    lease_book.prompts.cursor = meta["prompt_cursor"]
    lease_book.prompts.requeued = deque(meta["requeued"])
    buffer.ready_seq = meta["ready_seq"]
    counters.rejected, counters.dropped = Counter(meta["rejected"]), Counter(meta["dropped"])
    for name in COUNTS:
        setattr(counters, name, meta.get(name, 0))
    counters.recoveries += 1
    lease_book.journaled = True
    lease_book.remembered = deque(snapshot.remembered)

    def reader(lease: Lease) -> Callable[[], list[Rollout]]:
        return lambda: _decoded(journal.samples(lease.lease_id), lease, run_name)

    ready: list[Group] = []
    for row in sorted(snapshot.leases, key=lambda r: (r["closed_at"] or 0.0, r["lease_id"])):
        lease = lease_of(row)
        status = row["status"]
        if lease_book.config.deterministic and status in ("open", "complete"):
            lease = _with_place(lease, lease_book, row["ready_seq"], counters.groups_consumed)
        if status == "open":
            entries = snapshot.rollouts.get(lease.lease_id, [])
            for rollout_id, _ in entries:
                lease_book.seen_rollout_ids[rollout_id] = lease.lease_id
            lease_book.hold(OpenLease(lease=lease, holder=row["holder"], samples=_decoded(entries, lease, run_name)))
            continue
        # In the buffer (complete) or in a batch kept (served): samples stay on disk.
        rewards = json.loads(row["rewards"])
        lease_book.closed[lease.lease_id] = ClosedLease(lease, row["holder"], status, row["closed_at"], len(rewards))
        lease_book.closed_order.append((row["closed_at"], lease.lease_id))
        if status == "complete":
            ready.append(Group(lease.lease_id, lease.prompt_id, rewards, row["oldest_version"], row["ready_seq"], read=reader(lease)))
            restore_steps(ready[-1])
    buffer.ready = deque(sorted(ready, key=lambda group: group.seq))
    for request_id, body in snapshot.batches:
        lease_ids = body["lease_ids"]
        if not all(lease_id in lease_book.closed for lease_id in lease_ids):
            log.warning("journal: batch %s refers to forgotten leases; it cannot be served again", body["batch_id"])
            continue
        groups = []
        for lease_id, rewards in zip(lease_ids, body["rewards"], strict=True):
            lease = lease_book.closed[lease_id].lease
            # A served group's oldest version is not asked again (nothing judges it stale): 0 stands in.
            groups.append(Group(lease_id, lease.prompt_id, rewards, 0, read=reader(lease)))
        batches.baselines = body.get("baselines_after") or batches.baselines  # the newest kept batch's, last
        build = functools.partial(
            _build_kept, groups, restore_steps, advantages=advantages, trainer_version=body["trainer_version"],
            baselines=body.get("baselines"),
            batch_id=body["batch_id"], rollouts_accepted=body["rollouts_accepted"], stale_dropped=body["stale_dropped"],
            stale_report=StaleReport.model_validate(body["stale_report"]) if body.get("stale_report") else None,
        )
        batches.keep(request_id, ServedBatch(body["batch_id"], groups, build))
    integrity.restore(snapshot.workers, snapshot.content)


def _build_kept(groups: list[Group], restore_steps: Callable[[Group], None], **options: Any) -> TrainBatch:
    for group in groups:
        restore_steps(group)
    return build_batch(groups, **options)


def _decoded(entries: Iterable[tuple[str, bytes | None]], lease: Lease, run_name: str) -> list[Rollout]:
    """A lease's journaled (rollout id, body), decoded (its arrays keep their bytes)."""
    samples = []
    for rollout_id, data in entries:
        assert data is not None, f"lease {lease.lease_id}: the bodies of an open or complete lease are kept"
        samples.append(decode_rollout(
            data, rollout_id=rollout_id, lease_id=lease.lease_id, run_name=run_name, prompt_token_ids=lease.prompt_token_ids,
        ))
    return samples
