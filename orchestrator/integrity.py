"""Bookkeeping of untrusted workers: strikes, bans, spot-check sampling, replays.

RunState owns one `Integrity` and calls it where verification has a word: `admit` at ingest, the
claimed rewards once a group's rewards are final, the verdicts of the logprob checks. Keyed by
token name (a holder's part before "/"): a token may serve many worker ids, and a ban revokes it.

Invariants:
- a strike is only given for something an honest worker never does (STRIKE_REASONS);
- a token with `max_strikes` strikes is banned once (`newly_banned` hands it out once);
- a replay is content (prompt, completion, logprobs) kept before under another lease *and another
  claimed version*: identical logprobs under different weights do not happen honestly, while the
  same content under the same version is an honest coincidence. Content of a lease closed
  without training is forgotten (`forget_lease`, from the one lease-close path);
- records and kept content hashes are journaled at each commit (`journal_changes`) and restored
  on recovery, so a restart forgets neither a ban nor a replay.
"""

from __future__ import annotations

import hashlib
import json
import random
from array import array
from collections import Counter
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field

from decentrl.api.wire import Rollout
from decentrl.config import VerificationConfig
from orchestrator.events import IntegrityChanges

# Rejection reasons that only a faulty or dishonest worker produces: each is a strike.
STRIKE_REASONS = frozenset(
    {"replay", "bad_finish_reason", "future_version", "prompt_mismatch", "token_out_of_vocabulary", "logprob_mismatch",
     "not_reproduced", "bad_sample_index"}
)
REWARD_MATCH = 1e-6  # a claimed reward this close to the recomputed one agrees


def token_of(holder: str) -> str:
    return holder.split("/", 1)[0]


def content_hash(rollout: Rollout) -> bytes:
    """A digest of what a sample says (prompt, completion, logprobs): compared for replays here,
    and by a deterministic run for the copies of one place (orchestrator/lease_policy.py)."""
    parts = array("q", rollout.prompt_token_ids), array("q", rollout.completion_token_ids), array("d", rollout.logprobs)
    return hashlib.blake2b(b"|".join(part.tobytes() for part in parts), digest_size=16).digest()


@dataclass
class WorkerRecord:
    """What the orchestrator knows of one token."""

    rollouts: int = 0  # accepted at ingest
    checked: int = 0  # rollouts chosen for a logprob check
    passed: int = 0  # pending groups whose check passed
    strikes: int = 0
    reward_mismatches: int = 0  # claimed_reward disagreed with the recomputed reward (flagged, never used)
    served: int = 0  # samples that reached the trainer
    rejections: Counter[str] = field(default_factory=Counter)
    banned: bool = False

    def summary(self) -> dict[str, object]:
        return {**asdict(self), "rejections": dict(self.rejections)}

    @classmethod
    def from_summary(cls, data: dict[str, object]) -> WorkerRecord:
        known = {name: value for name, value in data.items() if name in cls.__dataclass_fields__}
        return cls(**{**known, "rejections": Counter(data.get("rejections") or {})})  # type: ignore[arg-type]


class Integrity:
    def __init__(self, config: VerificationConfig, *, journaled: bool = False) -> None:
        """`journaled`: keep what changed for `journal_changes` (a durable journal asks for it)."""
        self.config = config
        self.rng = random.Random()
        self.journaled = journaled
        self.workers: dict[str, WorkerRecord] = {}
        self._content: dict[bytes, tuple[str, int]] = {}  # content hash -> (lease id, claimed version)
        self._by_lease: dict[str, list[bytes]] = {}
        self._banned_queue: list[str] = []
        # Changed since the last commit (journaled only):
        self._changed: set[str] = set()  # token names
        self._unsaved: dict[str, list[tuple[bytes, str, int]]] = {}  # lease id -> its newly kept hashes
        self._forgotten: list[str] = []  # leases whose saved hashes go

    def record(self, holder: str) -> WorkerRecord:
        """The token's record, to change (it is journaled with the next commit)."""
        name = token_of(holder)
        if self.journaled:
            self._changed.add(name)
        found = self.workers.get(name)
        if found is None:  # not setdefault: that would build a record on every call (each accepted rollout)
            found = self.workers[name] = WorkerRecord()
        return found

    def _known(self, holder: str) -> WorkerRecord:
        """The token's record to read (a blank one for a token never seen): nothing is journaled."""
        return self.workers.get(token_of(holder)) or WorkerRecord()

    def has_passed_check(self, holder: str) -> bool:
        return self._known(holder).passed > 0

    # -- at ingest ------------------------------------------------------------------------

    def admit(self, rollout: Rollout, holder: str, reason: str | None) -> tuple[str | None, bool]:
        """Verification's one word on a posted rollout, after the ingest checks gave `reason`
        (None: they accept it): the reason it is refused (a banned holder, a replay of content
        kept before, or the checks' reason, counted against its holder) or None, and whether its
        logprobs are to be recomputed. An accepted rollout's content is kept."""
        if self.is_banned(holder):
            reason = "banned"
        elif reason is None and self.config.enabled:
            digest = self.replay_of(rollout)
            if digest is not None:
                self.kept(rollout.lease_id, digest, rollout.policy_version)
                return None, self.wants_check(holder)
            reason = "replay"
        if reason is not None:
            self.rejected(holder, reason)
        return reason, False

    def replay_of(self, rollout: Rollout) -> bytes | None:
        """The rollout's content hash, or None when it replays content kept under another lease
        and another version."""
        digest = content_hash(rollout)
        found = self._content.get(digest)
        replay = found is not None and found[0] != rollout.lease_id and found[1] != rollout.policy_version
        return None if replay else digest

    def kept(self, lease_id: str, digest: bytes, version: int) -> None:
        if self._content.setdefault(digest, (lease_id, version))[0] == lease_id and self.journaled:
            self._unsaved.setdefault(lease_id, []).append((digest, lease_id, version))
        self._by_lease.setdefault(lease_id, []).append(digest)

    def forget_lease(self, lease_id: str) -> None:
        """The lease closed without training: its content may honestly come again."""
        digests = self._by_lease.pop(lease_id, None)
        if digests is None:
            return
        for digest in digests:
            if self._content.get(digest, ("",))[0] == lease_id:
                del self._content[digest]
        if self.journaled:
            self._unsaved.pop(lease_id, None)
            self._forgotten.append(lease_id)

    # -- journal ----------------------------------------------------------------------------

    def journal_changes(self) -> IntegrityChanges:
        """What changed since the last call (the journal asks at each commit)."""
        changes = IntegrityChanges(
            forgotten=self._forgotten,
            kept=[row for rows in self._unsaved.values() for row in rows],
            workers=[(name, json.dumps(self.workers[name].summary())) for name in sorted(self._changed)],
        )
        self._forgotten, self._unsaved, self._changed = [], {}, set()
        return changes

    def restore(self, workers: dict[str, dict[str, object]], content: list[tuple[bytes, str, int]]) -> None:
        """Recovery: the records and kept hashes the journal committed."""
        self.workers = {name: WorkerRecord.from_summary(data) for name, data in workers.items()}
        self._content = {digest: (lease_id, version) for digest, lease_id, version in content}
        self._by_lease = {}
        for digest, lease_id, _ in content:
            self._by_lease.setdefault(lease_id, []).append(digest)

    def wants_check(self, holder: str) -> bool:
        """Whether this accepted rollout's logprobs are recomputed: all of a new or flagged
        token's, a `spot_check_fraction` of the others'."""
        record = self.record(holder)
        record.rollouts += 1
        flagged = record.strikes > 0 or record.reward_mismatches > 0
        chosen = (
            record.checked < self.config.new_worker_checks or flagged
            or self.rng.random() < self.config.spot_check_fraction
        )
        if chosen:
            record.checked += 1
        return chosen

    # -- outcomes -------------------------------------------------------------------------

    def rewards_claimed(self, holder: str, samples: Iterable[tuple[Rollout, float]]) -> None:
        """A group's final rewards against those its worker claimed (counted, never used)."""
        for rollout, reward in samples:
            if rollout.claimed_reward is not None and abs(rollout.claimed_reward - reward) > REWARD_MATCH:
                self.record(holder).reward_mismatches += 1

    def rejected(self, holder: str, reason: str) -> None:
        record = self.record(holder)
        record.rejections[reason] += 1
        if reason in STRIKE_REASONS and self.config.enabled:
            record.strikes += 1
            if record.strikes >= self.config.max_strikes and not record.banned:
                record.banned = True
                self._banned_queue.append(token_of(holder))

    def is_banned(self, holder: str) -> bool:
        return self._known(holder).banned

    def newly_banned(self) -> list[str]:
        """Tokens banned since the last call (each handed out once), to be revoked."""
        banned, self._banned_queue = self._banned_queue, []
        return banned

    def summary(self) -> dict[str, dict[str, object]]:
        return {name: record.summary() for name, record in sorted(self.workers.items())}
