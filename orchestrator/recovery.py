"""Recovery: the journal's meta row, and the state rebuilt from what the journal committed.

RunState (orchestrator/state.py) hands `meta_row` to the journal (written with the next commit
after a change) and, when it starts on a journal that holds a run, calls `recover` with the
journal's snapshot (orchestrator/journal.py) before it serves anything. Recovered: versions,
counters, prompt order, open leases (deadlines, holders, partial samples), closed leases still
remembered (and their rollout ids, so resends stay duplicates), the buffer in its order with
its rewards, the last batches served (so a re-ask gets the same batch), and what integrity knew.
What a restart cannot know (which samples were picked for a logprob check) RunState redoes
after `recover` returns.
"""

from __future__ import annotations

import heapq
import json
import logging
from collections import Counter, deque
from collections.abc import Callable
from typing import Any

from decentrl.determinism import required_version
from decentrl.encoding import unpack_msgpack
from decentrl.wire import Lease, Rollout
from orchestrator.batches import Batches, pack_sample
from orchestrator.buffer import Buffer, Group
from orchestrator.counters import Counters, Versions
from orchestrator.integrity import Integrity
from orchestrator.journal import Snapshot, decode_rollout
from orchestrator.leases import ClosedLease, LeaseBook, OpenLease

log = logging.getLogger("decentrl.orchestrator.recovery")


def meta_row(*, versions: Versions, counters: Counters, lease_book: LeaseBook, buffer: Buffer) -> dict[str, Any]:
    """The journal's meta row (key "state"): versions, prompt order position, counters."""
    return {
        "published_version": versions.published,
        "trainer_version": versions.trainer,
        "prompt_cursor": lease_book.prompts.cursor,
        "requeued": list(lease_book.prompts.requeued),
        "ready_seq": buffer.ready_seq,
        "rollouts_accepted": counters.rollouts_accepted,
        "tokens_accepted": counters.tokens_accepted,
        "duplicates": counters.duplicates,
        "rejected": dict(counters.rejected),
        "dropped": dict(counters.dropped),
        "stale_dropped": counters.stale_dropped,
        "groups_served": counters.groups_served,
        "leases_expired": counters.leases_expired,
        "recoveries": counters.recoveries,
    }


def _restore_meta(
    meta: dict[str, Any], *, versions: Versions, counters: Counters, lease_book: LeaseBook, buffer: Buffer
) -> None:
    versions.published = meta["published_version"]
    versions.trainer = meta["trainer_version"]
    lease_book.prompts.cursor = meta["prompt_cursor"]
    lease_book.prompts.requeued = deque(meta["requeued"])
    buffer.ready_seq = meta["ready_seq"]
    counters.rollouts_accepted = meta["rollouts_accepted"]
    counters.tokens_accepted = meta.get("tokens_accepted", 0)  # absent from journals of older versions
    counters.duplicates = meta["duplicates"]
    counters.rejected = Counter(meta["rejected"])
    counters.dropped = Counter(meta["dropped"])
    counters.stale_dropped = meta["stale_dropped"]
    counters.groups_served = meta["groups_served"]
    counters.leases_expired = meta["leases_expired"]
    counters.recoveries = meta["recoveries"] + 1


def _with_place(lease: Lease, lease_book: LeaseBook, ready_seq: int | None, groups_served: int) -> Lease:
    """Deterministic runs: a recovered lease with its place and version again. The journal keeps a
    complete group's place (its ready_seq) and an open lease's prompt; a prompt occurs once in any
    num_prompts consecutive places, and an open lease's place lies between the groups served and
    the cursor, so it is the last place before the cursor that holds its prompt."""
    queue = lease_book.prompts
    if ready_seq:
        index = ready_seq - 1
    else:
        if queue.cursor - groups_served > len(queue.order):
            raise ValueError(
                f"journal: cannot place open lease {lease.lease_id} of a deterministic run: more places are in "
                f"flight ({queue.cursor - groups_served}) than the task has prompts ({len(queue.order)}); "
                "use a task with more prompts than (max_staleness + 2) * trainer.groups_per_step"
            )
        index = queue.cursor - 1 - (queue.cursor - 1 - queue.order.index(lease.prompt_id)) % len(queue.order)
    version = required_version(
        index, groups_per_step=lease_book.config.trainer.groups_per_step, max_staleness=lease_book.config.max_staleness
    )
    return lease.model_copy(update={"index": index, "policy_version": version})


def recover(
    snapshot: Snapshot,
    *,
    run_name: str,
    versions: Versions,
    counters: Counters,
    lease_book: LeaseBook,
    buffer: Buffer,
    batches: Batches,
    integrity: Integrity,
    restore_steps: Callable[[Group], None],
) -> None:
    """Rebuild the state the journal committed (into freshly made, empty parts). `restore_steps`
    gives a group recovered in line or in a kept batch its process rewards again (its steps split
    again, its step scores from the journal's scores; RunState `_recover_steps`), so a batch asked
    for again after a restart carries the same per-token advantages."""
    _restore_meta(snapshot.meta, versions=versions, counters=counters, lease_book=lease_book, buffer=buffer)
    ready: list[Group] = []
    rebuilt: dict[str, list[Rollout]] = {}  # lease id -> its samples still held in the journal
    for row in sorted(snapshot.leases, key=lambda r: (r["closed_at"] or 0.0, r["lease_id"])):
        lease = Lease.model_construct(  # journaled as granted: validated when it was made
            lease_id=row["lease_id"],
            prompt_id=row["prompt_id"],
            prompt_token_ids=unpack_msgpack(row["prompt_token_ids"]),
            group_size=row["group_size"],
            deadline=row["deadline"],
        )
        if lease_book.prompts.deterministic and row["status"] in ("open", "complete"):
            lease = _with_place(lease, lease_book, row["ready_seq"], counters.groups_served)
        entries = snapshot.rollouts.get(lease.lease_id, [])
        ids = [rollout_id for rollout_id, _ in entries]
        for rollout_id in ids:
            lease_book.seen_rollout_ids[rollout_id] = lease.lease_id
        samples = [
            decode_rollout(
                data, rollout_id=rollout_id, lease_id=lease.lease_id, run_name=run_name,
                prompt_token_ids=lease.prompt_token_ids,
            )
            for rollout_id, data in entries
            if data is not None
        ]
        rebuilt[lease.lease_id] = samples
        packed = [pack_sample(sample) for sample in samples]
        status = row["status"]
        if status == "open":
            lease_book.open[lease.lease_id] = OpenLease(lease=lease, holder=row["holder"], samples=samples, packed=packed)
            heapq.heappush(lease_book.deadlines, (lease.deadline, lease.lease_id))
            continue
        lease_book.closed[lease.lease_id] = ClosedLease(lease, row["holder"], status, row["closed_at"], ids)
        lease_book.closed_order.append((row["closed_at"], lease.lease_id))
        if status == "complete":
            rewards = json.loads(row["rewards"])
            ready.append(Group(lease.lease_id, lease.prompt_id, list(zip(samples, rewards)), packed, row["ready_seq"]))
            restore_steps(ready[-1])
    buffer.ready = deque(sorted(ready, key=lambda group: group.seq))
    for request_id, body in snapshot.batches:
        lease_ids = body["lease_ids"]
        if not all(lease_id in lease_book.closed and lease_id in rebuilt for lease_id in lease_ids):
            log.warning("journal: batch %s refers to forgotten leases; it cannot be served again", body["batch_id"])
            continue
        groups = [
            Group(
                lease_id, lease_book.closed[lease_id].lease.prompt_id, list(zip(rebuilt[lease_id], body["rewards"][i])),
                [pack_sample(sample) for sample in rebuilt[lease_id]],
            )
            for i, lease_id in enumerate(lease_ids)
        ]
        for group in groups:
            restore_steps(group)
        batch = batches.build(
            groups, trainer_version=body["trainer_version"], batch_id=body["batch_id"],
            rollouts_accepted=body["rollouts_accepted"], stale_dropped=body["stale_dropped"],
        )
        batches.keep(request_id, batch, groups)
    integrity.restore(snapshot.workers, snapshot.content)
