"""Rewards, recomputed by the orchestrator: the task's verifier, never the worker's claimed reward.

RunState (orchestrator/state.py) scores a group once it is full: a single-turn completion is
decoded (orchestrator/tokens.py) and handed to the task's reward; a multi-turn episode is
replayed against its environment (decentrl/tasks/episodes.py), which the ingest checks
(orchestrator/checks.py) also do to refuse a transcript the environment would not have given.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from decentrl.tasks import Task
from decentrl.tasks.episodes import EpisodeTask, replay_episode, tokenizer_codec
from decentrl.wire import Rollout
from orchestrator.tokens import Decoder

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from decentrl.tokenizer import RustTokenizer


class Scorer:
    def __init__(
        self, *, task: Task | EpisodeTask, tokenizer: PreTrainedTokenizerBase | RustTokenizer, decode: Decoder,
        end_ids: set[int],
    ) -> None:
        """`end_ids`: what ends a model turn (the ids the worker backends stop at)."""
        self.task = task
        self.decode = decode
        self.end_ids = end_ids
        self._episode_codec = tokenizer_codec(tokenizer) if isinstance(task, EpisodeTask) else None

    def rewards(self, rollouts: list[Rollout]) -> list[float]:
        if isinstance(self.task, EpisodeTask):
            return [self.episode_reward(rollout) for rollout in rollouts]
        task = self.task
        texts = self.decode([rollout.completion_token_ids for rollout in rollouts])
        return [task.reward(task.prompt(r.prompt_id), text) for r, text in zip(rollouts, texts, strict=True)]

    def episode_reward(self, rollout: Rollout) -> float:
        """Replay the episode's environment over the transcript; raises EpisodeMismatch when the
        transcript is not what the environment says."""
        assert isinstance(self.task, EpisodeTask) and self._episode_codec is not None
        return replay_episode(
            self.task, self.task.prompt(rollout.prompt_id), rollout.completion_token_ids, rollout.loss_mask,
            rollout.finish_reason, rollout.sampling, self._episode_codec, eos_ids=self.end_ids,
        )
