"""The reward stage of the pipeline, chosen once at start-up from `[orchestrator.rewards] type`.

RunState hands every complete group to `start`: `VerifierRewards` gives the task verifier's final
rewards at once; `ModelRewards` (docs/rewards.md) queues the group's items for scorers, and
`finish` combines their scores with the verifier's; `RolesRewards` derives a unit's solver node
from its proposer's sample and rewards the proposer from its solvers. Never the worker's claimed reward.
In a run of tree units the verdicts on a sample's posted steps become its process rewards
(`step_verdicts`), read once when its unit completes: no step is scored a second time.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from decentrl.api.wire import DerivedParent, Rollout, RolloutNode, ScoreResult
from decentrl.rl.advantages import repetition_penalties
from decentrl.tasks.base import Prompt
from decentrl.tasks.propose import Proposal, ProposeTask
from orchestrator.buffer import Group
from orchestrator.leases import SOLVER, Derived
from orchestrator.rewards import Rewards
from orchestrator.score_queue import ScoreQueue

# A finished sample's verdict on each step it names, None where one is not in (orchestrator/score_queue.py
# StepBook.verdicts_of); None when its posted steps are not its steps.
Verdicts = Callable[[Rollout], list[float | None] | None]


def step_verdicts(group: Group, verdicts: Verdicts) -> None:
    """Process rewards from verdicts (tree units, docs/rewards.md "Pivots"): a sample that named its
    steps (`step_ends`, token counts), posted each of them and has every one judged gets the
    verdicts as its step scores, each step ending at its last token; the others train on their
    outcome alone. Nothing is set when no sample qualifies."""
    scores = [verdicts(rollout) for rollout in group.rollouts]
    full = [s if s is not None and None not in s else None for s in scores]
    if all(s is None for s in full):
        return
    group.step_ends = [
        [end - 1 for end in rollout.step_ends or ()] if s is not None else [] for rollout, s in zip(group.rollouts, full, strict=True)
    ]
    group.step_scores = full  # type: ignore[assignment]


class VerifierRewards:
    def __init__(self, rewards: Rewards, *, verdicts: Verdicts | None = None) -> None:
        """`verdicts`: a tree run's step verdicts (None: a run without partial steps)."""
        self.rewards = rewards
        self.verdicts = verdicts
        self.journaled: Verdicts | None = None  # after a restart: the verdicts the journal holds, for recovered groups

    def start(self, group: Group) -> bool:
        """Reward `group` with the task's verifier (and its steps' verdicts); True: its rewards are final now."""
        group.rewards = self.rewards.rewards(group.rollouts)
        if self.verdicts is not None:
            step_verdicts(group, self.verdicts)
        return True

    def restore_steps(self, group: Group) -> None:
        """A group recovered in line or in a kept batch: its verdicts' process rewards again (tree units)."""
        if self.journaled is not None:
            step_verdicts(group, self.journaled)

    def recovered(self, scores: dict[str, str], verdicts: Verdicts | None = None) -> None:
        """Read at a restart: no model scores are journaled in a verifier-only run; `verdicts`: the
        journaled steps' (None: none journaled)."""
        self.journaled = verdicts


class ModelRewards:
    def __init__(self, rewards: Rewards, queue: ScoreQueue, *, verdicts: Verdicts | None = None) -> None:
        """`verdicts`: a tree run's step verdicts, its process rewards unless the scorers score
        whole samples per step (`rewards.step_scores`)."""
        self.rewards = rewards
        self.queue = queue
        self.verdicts = verdicts
        self.journaled: Verdicts | None = None  # after a restart: the verdicts the journal holds, for recovered groups
        self.taken: dict[str, ScoreResult] = {}  # scores journaled before a restart, by rollout id

    def start(self, group: Group) -> bool:
        """Queue `group`'s samples (less those scored before a restart); False: it waits."""
        rollouts = group.rollouts
        group.verifier_rewards = self.rewards.verifier_rewards(rollouts)
        if group.verifier_rewards is not None:
            group.rewards = group.verifier_rewards  # final once scored (`finish`)
        steps = self.rewards.steps(rollouts)
        group.step_ends = [s.ends for s in steps] if steps is not None else None
        if steps is None and self.verdicts is not None:
            step_verdicts(group, self.verdicts)
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
        if self.rewards.steps_config is not None:  # else any step scores are the verdicts' (`start`)
            group.step_scores = [result.step_scores for result in results]
        if self.rewards.token_ids:
            group.teacher_logprobs = [result.token_logprobs for result in results]
        return True

    def restore_steps(self, group: Group) -> None:
        """A group recovered in line or in a kept batch: its steps split again, its step scores
        and a teacher's log-probs from the journal. In a run without either nothing is read: a
        recovered group's samples stay in the journal until it is served. A tree run's verdicts are
        its process rewards again, as at its completion, unless scorers score steps."""
        if self.rewards.steps_config is None and self.journaled is not None:
            step_verdicts(group, self.journaled)
        if self.rewards.steps_config is None and not self.rewards.token_ids:
            return
        results = [self.taken.get(rollout.rollout_id) for rollout in group.rollouts]
        if self.rewards.token_ids:
            group.teacher_logprobs = [result.token_logprobs if result is not None else None for result in results]
        steps = self.rewards.steps(group.rollouts)
        if steps is not None:
            group.step_ends = [s.ends for s in steps]
            group.step_scores = [result.step_scores if result is not None else None for result in results]

    def recovered(self, scores: dict[str, str], verdicts: Verdicts | None = None) -> None:
        """The scores the journal holds (rollout id -> ScoreResult as JSON), read at a restart;
        `verdicts`: the journaled steps' (None: none journaled)."""
        self.journaled = verdicts
        self.taken = {rollout_id: ScoreResult.model_validate_json(data) for rollout_id, data in scores.items()}


class RolesRewards(VerifierRewards):
    """Units of roles ([orchestrator.roles]): the solver node derived from the proposer's sample
    (`derive`), and, once the unit is complete, every sample's reward: a solver's correctness on
    the derived problem, the proposer's from its solvers' (validity first, then learnability:
    the task's `proposer_reward`, decentrl/tasks/propose.py)."""

    def __init__(
        self, rewards: Rewards, task: ProposeTask, render: Callable[[Prompt], list[int]], *, solver_policy: str | None = None
    ) -> None:
        """`solver_policy`: a run of two policies' solver policy, named on each solver node (None: one policy)."""
        super().__init__(rewards)
        self.task = task
        self.render = render
        self.solver_policy = solver_policy
        # The last proposals' canonical forms (None: invalid), for R-Zero's repetition penalty.
        self.recent: deque[str | None] = deque(maxlen=task.config.repetition_window)

    def proposal(self, rollout: Rollout) -> Proposal | None:
        return self.task.propose(self.rewards.decode([rollout.completion_token_ids])[0], rollout.prompt_id)

    def derive(self, rollout: Rollout) -> Derived | None:
        """The solver node of a proposer's sample, its prompt rendered here (a worker never
        supplies it); None for an invalid proposal, which ends the unit."""
        proposal = self.proposal(rollout)
        if proposal is None:
            return None
        parent = DerivedParent(rollout_id=rollout.rollout_id, derived=0)
        node = RolloutNode(node_id=SOLVER, parent=parent, role=SOLVER, policy=self.solver_policy)
        return Derived(node, self.render(self.task.solver_prompt(proposal, rollout.prompt_id)))

    def start(self, group: Group) -> bool:
        rollouts = group.rollouts
        proposer = next(i for i, r in enumerate(rollouts) if r.node is None or r.node.parent is None)
        proposal = self.proposal(rollouts[proposer])
        texts = self.rewards.decode([r.completion_token_ids for r in rollouts])
        rewards = [0.0] * len(rollouts)
        if proposal is not None:
            prompt = self.task.solver_prompt(proposal, rollouts[proposer].prompt_id)
            for i, text in enumerate(texts):
                if i != proposer:
                    rewards[i] = self.task.reward(prompt, text)
        passes = [self.task.passed(prompt, text) for i, text in enumerate(texts) if i != proposer] if proposal is not None else []
        rewards[proposer] = self.task.proposer_reward(proposal, passes)
        weight = self.task.config.repetition_penalty
        if weight > 0:
            self.recent.append(proposal.canonical if proposal is not None else None)
            if proposal is not None:  # R-Zero: max(0, learnability - penalty)
                rewards[proposer] = max(0.0, rewards[proposer] - repetition_penalties(list(self.recent), weight)[-1])
        group.rewards = rewards
        return True
