"""The reward stage of the pipeline, chosen once at start-up from `[orchestrator.rewards] type`.

RunState hands every complete group to `start`: `VerifierRewards` gives the task verifier's final
rewards at once; `ModelRewards` (docs/rewards.md) queues the group's items for scorers, and
`finish` combines their scores with the verifier's. Never the worker's claimed reward.
"""

from __future__ import annotations

from decentrl.api.wire import ScoreResult
from orchestrator.buffer import Group
from orchestrator.rewards import Rewards
from orchestrator.score_queue import ScoreQueue


class VerifierRewards:
    def __init__(self, rewards: Rewards) -> None:
        self.rewards = rewards

    def start(self, group: Group) -> bool:
        """Reward `group` with the task's verifier; True: its rewards are final now."""
        group.rewards = self.rewards.rewards(group.rollouts)
        return True

    def restore_steps(self, group: Group) -> None:
        """No process rewards without scorers: nothing to restore."""

    def recovered(self, scores: dict[str, str]) -> None:
        """No model scores are journaled in a verifier-only run."""


class ModelRewards:
    def __init__(self, rewards: Rewards, queue: ScoreQueue) -> None:
        self.rewards = rewards
        self.queue = queue
        self.taken: dict[str, ScoreResult] = {}  # scores journaled before a restart, by rollout id

    def start(self, group: Group) -> bool:
        """Queue `group`'s samples (less those scored before a restart); False: it waits."""
        rollouts = group.rollouts
        group.verifier_rewards = self.rewards.verifier_rewards(rollouts)
        if group.verifier_rewards is not None:
            group.rewards = group.verifier_rewards  # final once scored (`finish`)
        steps = self.rewards.steps(rollouts)
        group.step_ends = [s.ends for s in steps] if steps is not None else None
        self.queue.add(group.lease_id, self.rewards.items(rollouts, steps), self.taken)
        return False

    def finish(self, group: Group) -> bool:
        """The last score of `group` is in: it leaves the queue with its rewards combined. False:
        it is to be dropped (a judge reply that did not parse, with on_parse_failure = drop)."""
        results = self.queue.take(group.lease_id)
        rewards = self.rewards.combine(group.verifier_rewards, results)
        if rewards is None:
            return False
        group.rewards = rewards
        if group.step_ends is not None:
            group.step_scores = [result.step_scores for result in results]
        if self.rewards.token_ids:
            group.teacher_logprobs = [result.token_logprobs for result in results]
        return True

    def restore_steps(self, group: Group) -> None:
        """A group recovered in line or in a kept batch: its steps split again, its step scores
        and a teacher's log-probs from the journal. In a run without either nothing is read: a
        recovered group's samples stay in the journal until it is served."""
        if self.rewards.steps_config is None and not self.rewards.token_ids:
            return
        results = [self.taken.get(rollout.rollout_id) for rollout in group.rollouts]
        if self.rewards.token_ids:
            group.teacher_logprobs = [result.token_logprobs if result is not None else None for result in results]
        steps = self.rewards.steps(group.rollouts)
        if steps is not None:
            group.step_ends = [s.ends for s in steps]
            group.step_scores = [result.step_scores if result is not None else None for result in results]

    def recovered(self, scores: dict[str, str]) -> None:
        """The scores the journal holds (rollout id -> ScoreResult as JSON), read at a restart."""
        self.taken = {rollout_id: ScoreResult.model_validate_json(data) for rollout_id, data in scores.items()}
