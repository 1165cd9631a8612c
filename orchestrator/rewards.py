"""Rewards, recomputed by the orchestrator: the task's verifier, never the worker's claimed reward.

A single-turn completion is decoded and handed to the task's reward; a multi-turn episode is
replayed against its environment. With a model reward (docs/rewards.md) the samples also become
the items scorers score, and `combine` is the one place that reads the reward's type and weights.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from decentrl.api.wire import BranchParent, ChatMessage, PartialStep, Rollout, ScoreItem, ScoreResult
from decentrl.config import PromptConfig, RewardConfig, StepsConfig
from decentrl.rl.steps import Steps, split_steps
from decentrl.tasks import Task
from decentrl.tasks.episodes import EpisodeTask, replay_episode, tokenizer_codec
from decentrl.tasks.prompts import chat_messages, uses_chat
from orchestrator.tokenizer import Decoder

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from decentrl.model.tokenizer import RustTokenizer


class Rewards:
    def __init__(
        self, *, task: Task | EpisodeTask, tokenizer: PreTrainedTokenizerBase | RustTokenizer, decode: Decoder,
        ends: Callable[[list[int]], bool], rewards: RewardConfig, prompt: PromptConfig, steps: StepsConfig,
        token_ids: bool = False,
    ) -> None:
        """`ends`: whether a model turn's tokens end its generation; `steps`: how a
        completion is split for step scores (used with `rewards.step_scores`); `token_ids`: items
        carry the samples' token ids, for a distillation teacher ([orchestrator.advantages.distill])."""
        self.task = task
        self.decode = decode
        self.ends = ends
        self.config = rewards
        self.prompt_config = prompt
        self.steps_config = steps if rewards.step_scores else None
        self.token_ids = token_ids
        self._chat = rewards.uses_model and uses_chat(prompt, tokenizer)
        self._episode_codec = tokenizer_codec(tokenizer) if isinstance(task, EpisodeTask) else None

    def verifier_rewards(self, rollouts: list[Rollout]) -> list[float] | None:
        """The task's rewards, when the run's reward uses them (None for a model-only reward)."""
        return None if self.config.type == "model" else self.rewards(rollouts)

    def steps(self, rollouts: list[Rollout]) -> list[Steps] | None:
        """Process rewards: each sample's steps (decentrl/rl/steps.py); None when the run wants no step scores."""
        if self.steps_config is None:
            return None
        return [
            split_steps(r.completion_token_ids, r.loss_mask, decode=self.decode, config=self.steps_config) for r in rollouts
        ]

    def items(self, rollouts: list[Rollout], steps: list[Steps] | None) -> list[ScoreItem]:
        texts = self.decode(answers(rollouts))
        items = []
        for i, (rollout, text) in enumerate(zip(rollouts, texts, strict=True)):
            prompt = self.task.prompt(rollout.prompt_id)
            messages = (
                [ChatMessage(role=m["role"], content=m["content"]) for m in chat_messages(self.prompt_config, prompt)]
                if self._chat else None
            )
            items.append(ScoreItem(
                rollout_id=rollout.rollout_id, prompt_id=rollout.prompt_id, prompt=prompt.text, messages=messages,
                completion=text, steps=steps[i].texts if steps is not None else None,
                prompt_token_ids=rollout.prompt_token_ids if self.token_ids else None,
                completion_token_ids=rollout.completion_token_ids if self.token_ids else None,
            ))
        return items

    def step_item(self, prompt_id: int, rollout_id: str, prefix: list[int], steps: list[PartialStep]) -> ScoreItem:
        """The item of a partial step (the last of `steps`): the task's prompt, the text so far
        (a branch's `prefix` tokens, then each step's) and the steps' own texts."""
        texts = self.decode([list(prefix)] + [list(step.token_ids) for step in steps])
        return ScoreItem(
            rollout_id=rollout_id, prompt_id=prompt_id, prompt=self.task.prompt(prompt_id).text,
            completion="".join(texts), steps=texts[1:], step=steps[-1].step,
        )

    def combine(self, verifier: list[float] | None, scores: list[ScoreResult]) -> list[float] | None:
        """The group's rewards from the verifier's and the scorers'; None when the group is to be
        dropped (a judge reply that did not parse, with on_parse_failure = drop)."""
        config = self.config
        if any(result.score is None for result in scores) and config.on_parse_failure == "drop":
            return None
        model = [config.default_score if result.score is None else result.score for result in scores]
        if config.type == "model":
            return model
        assert verifier is not None
        return [config.verifier_weight * v + config.model_weight * m for v, m in zip(verifier, model, strict=True)]

    def rewards(self, rollouts: list[Rollout]) -> list[float]:
        if isinstance(self.task, EpisodeTask):
            return [self.episode_reward(rollout) for rollout in rollouts]
        task = self.task
        texts = self.decode(answers(rollouts))
        return [task.reward(task.prompt(r.prompt_id), text) for r, text in zip(rollouts, texts, strict=True)]

    def episode_reward(self, rollout: Rollout) -> float:
        """Replay the episode's environment over the transcript; EpisodeMismatch if it differs."""
        assert isinstance(self.task, EpisodeTask) and self._episode_codec is not None
        return replay_episode(
            self.task, self.task.prompt(rollout.prompt_id), rollout.completion_token_ids, rollout.loss_mask,
            rollout.finish_reason, rollout.sampling, self._episode_codec, ends=self.ends,
        )


def answers(rollouts: list[Rollout]) -> list[list[int]]:
    """Each sample's whole answer, the tokens its reward judges: a root's completion; a tree
    branch's prefix (its prompt's tokens past its unit's prompt, the roots': the parent's first
    `at` completion tokens, as ingest checks) then its continuation. A branch judged on its
    continuation alone would miss every step its prefix holds."""
    base = next((len(r.prompt_token_ids) for r in rollouts if r.node is None or r.node.parent is None), None)
    out = []
    for rollout in rollouts:
        branch = rollout.node is not None and isinstance(rollout.node.parent, BranchParent)
        if branch and base is None:
            raise ValueError("a unit of branches without its roots: a branch's prefix is read past the roots' prompt")
        out.append([*rollout.prompt_token_ids[base:], *rollout.completion_token_ids] if branch else list(rollout.completion_token_ids))
    return out
