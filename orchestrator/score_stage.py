"""The scoring stage of a model reward, as ingest runs it: a complete group waits in the score
queue, scorers' posts complete it, its rewards are combined and it joins the line (or is dropped).

RunState (orchestrator/state.py) hands `wait` each complete group it holds back for its model
scores (the `score` stage of ingest, and again at recovery for a group that was waiting), `post`
each scorer's post (orchestrator/score_handlers.py), and `recover_steps` each group recovered in
line or in a kept batch (orchestrator/recovery.py). The queue, its leases and the posts' checks
are score_queue.py; the rewards are combined by scoring.py; the buffer (buffer.py) holds the group
back in its place until its scores and its logprob check, if it has one, are both in.
"""

from __future__ import annotations

from decentrl.api.wire import Rollout, ScoreAck, ScorePost, ScoreResult
from decentrl.config import RunConfig
from decentrl.rl.staleness import is_fresh
from orchestrator.buffer import Buffer, Group
from orchestrator.counters import Versions
from orchestrator.integrity import Integrity
from orchestrator.leases import LeaseBook
from orchestrator.score_queue import ScoreQueue
from orchestrator.scoring import Scorer


class ScoreStage:
    def __init__(
        self, *, config: RunConfig, versions: Versions, scorer: Scorer, score_queue: ScoreQueue, buffer: Buffer,
        lease_book: LeaseBook, integrity: Integrity,
    ) -> None:
        self.config = config
        self.versions = versions
        self.scorer = scorer
        self.score_queue = score_queue
        self.buffer = buffer
        self.lease_book = lease_book
        self.integrity = integrity
        self.taken: dict[str, ScoreResult] = {}  # journaled scores, read at recovery

    def wait(self, group: Group, samples: list[Rollout]) -> None:
        """`group` (held back for its scores) has its samples, split into steps for a process
        reward, queued for scorers."""
        steps = self.scorer.steps(samples)
        group.step_ends = [s.ends for s in steps] if steps is not None else None
        if self.score_queue.add(group.lease_id, self.scorer.items(samples, steps), self.taken):
            self.scored(group.lease_id)  # recovered with every score already taken

    def post(self, holder: str, body: ScorePost) -> ScoreAck:
        """Take a scorer's post (all or nothing: ScoreError, or a LeaseError for a lease it cannot
        use); the groups it completes combine their rewards and join the line (or are dropped:
        stale, or a judge reply that did not parse)."""
        ack, done = self.score_queue.post(holder, body)
        for group_id in done:
            self.scored(group_id)
        return ack

    def scored(self, group_id: str) -> None:
        results = self.score_queue.take(group_id)
        group = self.buffer.pending.get(group_id)
        if group is None:
            return  # dropped while its scores came in
        rewards = self.scorer.combine(group.verifier_rewards, results)
        if rewards is None:  # a judge reply that did not parse, on_parse_failure = drop
            self.buffer.release_held_back(lambda g: g.lease_id == group_id)
            self.lease_book.close(group_id, "dropped", reason="judge_parse_failure", counted=group.size)
            return
        group.rewards = rewards
        if group.step_ends is not None:
            group.step_scores = [result.step_scores for result in results]
        self.integrity.rewards_claimed(self.lease_book.closed[group_id].holder, group.samples)
        if self.buffer.done_waiting(group_id, "scores") is None:
            return  # it still waits for its logprob check
        if is_fresh(self.versions.trainer, group.oldest_version, self.config.max_staleness):
            self.buffer.to_ready(group)
        else:
            self.lease_book.close(group_id, "dropped", reason="stale_waiting_scores", counted=group.size)

    def recover_steps(self, group: Group) -> None:
        """A group recovered in line or in a kept batch: its steps split again, its step scores
        from the journal."""
        if self.scorer.steps_config is None:
            return  # no step scores in this run: nothing to read
        rollouts = group.rollouts
        steps = self.scorer.steps(rollouts)
        assert steps is not None
        group.step_ends = [s.ends for s in steps]
        results = [self.taken.get(rollout.rollout_id) for rollout in rollouts]
        group.step_scores = [result.step_scores if result is not None else None for result in results]
