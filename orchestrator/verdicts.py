"""What follows a verdict on a worker: the result of a held-back group's logprob check, or a ban.

The verification scheduler (orchestrator/verification.py) runs the checks of orchestrator/verify.py and
reports each through RunState.verification_done; a token that reaches `max_strikes`
(orchestrator/integrity.py) is banned and RunState.drop_banned drops what it still has waiting.
Both go through RunState (orchestrator/state.py) to this part. Every group dropped here closes
its lease through LeaseBook.close (orchestrator/leases.py).
"""

from __future__ import annotations

from decentrl.config import RunConfig
from decentrl.rl.staleness import is_fresh
from orchestrator.buffer import Buffer, Group
from orchestrator.counters import Counters, Versions
from orchestrator.integrity import Integrity, token_of
from orchestrator.leases import LeaseBook


class Verdicts:
    def __init__(
        self,
        *,
        config: RunConfig,
        versions: Versions,
        counters: Counters,
        lease_book: LeaseBook,
        buffer: Buffer,
        integrity: Integrity,
    ) -> None:
        self.config = config
        self.versions = versions
        self.counters = counters
        self.lease_book = lease_book
        self.buffer = buffer
        self.integrity = integrity

    def checked(self, lease_id: str, failed: dict[str, str]) -> None:
        """The check of a held-back group is done; `failed`: rollout id -> rejection reason
        (`logprob_mismatch` strikes its worker; `unverifiable` does not). A group with any failed
        sample is dropped whole; a clean one joins the line if it is still fresh."""
        group = self.buffer.pending.get(lease_id)
        if group is None:
            return  # dropped meanwhile (its worker was banned, or it went stale waiting for its scores)
        holder = self.lease_book.closed[lease_id].holder
        if failed:
            del self.buffer.pending[lease_id]
            for reason in failed.values():
                self.counters.rejected[reason] += 1
                self.integrity.rejected(holder, reason)
            self.lease_book.close(
                lease_id, "dropped", reason="failed_verification", counted=group.size - len(failed)
            )
            return
        self.integrity.record(holder).passed += 1
        if self.buffer.done_waiting(lease_id, "check") is None:
            return  # it still waits for its model scores (orchestrator/score_queue.py)
        if is_fresh(self.versions.trainer, group.oldest_version, self.config.max_staleness):
            self.buffer.to_ready(group)
        else:
            self.lease_book.close(lease_id, "dropped", reason="stale_in_buffer", counted=group.size)

    def banned(self, token: str) -> int:
        """A banned token's open leases, held-back and ready groups are dropped (its prompts are
        leased again): what it sent unchecked is no longer trusted. Returns samples dropped."""
        dropped = 0
        for lease_id in self.lease_book.held_by(token):
            closed = self.lease_book.close(lease_id, "dropped", reason="banned_worker", requeue="back")
            dropped += closed.samples

        def of_token(group: Group) -> bool:
            return token_of(self.lease_book.closed[group.lease_id].holder) == token

        for group in self.buffer.release_held_back(of_token) + self.buffer.evict(of_token):
            self.lease_book.close(group.lease_id, "dropped", reason="banned_worker", counted=group.size)
            dropped += group.size
        return dropped
