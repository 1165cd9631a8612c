"""Multi-turn episodes: the model acts, an environment answers (feedback, a tool result), repeat.

A worker runs an episode live (workers/episodes.py); the orchestrator never trusts it and
replays the environment from the transcript (`replay_episode`): the rollout's completion is the
model's turns and the environment's answers concatenated, `loss_mask` 1 on the model's tokens and
0 on the environment's. Replaying feeds the decoded model turns to a fresh environment, checks
that every model turn ended as a turn ends (below), that every environment segment is exactly
what the environment answers and that the episode ended where the worker loop ends it, and
returns the environment's reward. The turn-end check keeps a worker from cutting the model's
turns where it likes (a transcript the policy would not produce, cut where the environment pays).

Hence the one rule for an environment: deterministic. The same model turns must give the same
answers and the same reward, on the worker and on the orchestrator.

Turn and token limits, shared by both sides:
- a model turn ends at end-of-sequence or at the token completing a stop string (kept; see
  decentrl/model/stopping.py), or at its budget (`turn_budget`): `max_turn_tokens` tokens, or fewer
  when the completion reaches `sampling.max_tokens`. End-of-sequence stays in the transcript
  but not in the text an environment sees (decoding skips special tokens);
- the episode ends ("stop") when the environment says done or after `max_turns` model turns; it
  ends ("length") when the environment's answer plus one more model token would not fit in
  `sampling.max_tokens` (that answer is then left out).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from decentrl.api.wire import SamplingParams
from decentrl.tasks.base import Prompt

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass(frozen=True)
class Answer:
    """The environment's reply to one model turn."""

    text: str  # inserted into the transcript as environment tokens; ignored once done
    done: bool  # the episode is over (solved, failed for good, ...)


class Environment(Protocol):
    """One episode of one prompt. Deterministic (the orchestrator replays it)."""

    def step(self, model_turn: str) -> Answer:
        """React to the model's turn (decoded, special tokens removed)."""
        ...

    def reward(self) -> float:
        """Score in [0, 1] of the episode so far; called after the last model turn."""
        ...


class EpisodeTask(ABC):
    """A multi-turn task: a prompt pool and one fresh environment per episode.

    Subclass it (the orchestrator and workers tell episode tasks from single-turn ones by this
    class) and load it with `[task] type = "import"`, `target = "package.module:Class"`; the
    module must be importable on the orchestrator and on every worker.
    """

    num_prompts: int
    max_turns: int  # model turns per episode at most
    max_turn_tokens: int  # tokens per model turn at most

    @abstractmethod
    def prompt(self, prompt_id: int) -> Prompt: ...

    @abstractmethod
    def environment(self, prompt: Prompt) -> Environment:
        """A fresh environment for one episode of `prompt`."""


@dataclass(frozen=True)
class TextCodec:
    """The model's tokenizer as environments see it: text in, token ids out, no special tokens."""

    encode: Callable[[str], list[int]]
    decode: Callable[[list[int]], str]


def tokenizer_codec(tokenizer: PreTrainedTokenizerBase) -> TextCodec:
    return TextCodec(
        encode=lambda text: tokenizer(text, add_special_tokens=False).input_ids,
        decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
    )


def turn_budget(task: EpisodeTask, *, used: int, max_tokens: int) -> int:
    """Most tokens of the next model turn, after `used` completion tokens of `max_tokens`."""
    return min(task.max_turn_tokens, max_tokens - used)


def episode_end(*, done: bool, turns: int, used: int, answer_tokens: int, task: EpisodeTask, max_tokens: int) -> str | None:
    """How the episode ends after a model turn: "stop", "length", or None (it goes on).
    `used`: completion tokens so far; `answer_tokens`: length of the environment's answer."""
    if done or turns >= task.max_turns:
        return "stop"
    if used + answer_tokens >= max_tokens:  # no room left for the answer and one model token
        return "length"
    return None


class EpisodeMismatch(ValueError):
    """The transcript is not what the environment and the worker loop produce."""


def split_turns(token_ids: list[int], loss_mask: list[int] | None) -> list[tuple[bool, list[int]]]:
    """Maximal runs of model (True) and environment (False) tokens, in order."""
    if loss_mask is None:
        return [(True, list(token_ids))]
    runs: list[tuple[bool, list[int]]] = []
    for token, model in zip(token_ids, loss_mask, strict=True):
        if runs and runs[-1][0] == bool(model):
            runs[-1][1].append(token)
        else:
            runs.append((bool(model), [token]))
    return runs


def replay_episode(
    task: EpisodeTask, prompt: Prompt, token_ids: list[int], loss_mask: list[int] | None, finish_reason: str,
    sampling: SamplingParams, codec: TextCodec, *, ends: Callable[[list[int]], bool],
) -> float:
    """The episode's reward, recomputed by replaying a fresh environment over the transcript;
    EpisodeMismatch if a model turn's end, the environment's tokens, the turn limits or the
    episode's ending disagree. `ends`: whether a model turn's tokens end its generation (the run's
    end-of-sequence ids and stop strings: decentrl/model/stopping.py `ends_generation`)."""
    runs = split_turns(token_ids, loss_mask)
    if not runs[0][0] or not runs[-1][0]:
        raise EpisodeMismatch("an episode starts and ends with a model turn")
    model_turns, env_turns = [ids for model, ids in runs if model], [ids for model, ids in runs if not model]
    if len(model_turns) > task.max_turns:
        raise EpisodeMismatch(f"{len(model_turns)} model turns, more than max_turns {task.max_turns}")
    environment = task.environment(prompt)
    used = 0
    max_tokens = sampling.max_tokens
    for turn, model_ids in enumerate(model_turns, start=1):
        budget = turn_budget(task, used=used, max_tokens=max_tokens)
        if len(model_ids) > budget:
            raise EpisodeMismatch(f"model turn {turn} has {len(model_ids)} tokens, more than its budget of {budget}")
        if len(model_ids) < budget and not ends(model_ids):
            raise EpisodeMismatch(
                f"model turn {turn} ends after {len(model_ids)} of its {budget} tokens without end-of-sequence "
                "or a stop string"
            )
        answer = environment.step(codec.decode(model_ids))
        answer_ids = codec.encode(answer.text)
        used += len(model_ids)
        end = episode_end(
            done=answer.done, turns=turn, used=used, answer_tokens=len(answer_ids), task=task, max_tokens=max_tokens
        )
        if turn < len(model_turns):
            if end is not None:
                raise EpisodeMismatch(f"the episode ends ({end}) after model turn {turn}, but the transcript goes on")
            if answer_ids != env_turns[turn - 1]:
                raise EpisodeMismatch(f"environment turn {turn} is not what the environment answers")
            used += len(answer_ids)
        elif end != finish_reason:
            raise EpisodeMismatch(f"after the last model turn the episode ends with {end}, not {finish_reason}")
    return environment.reward()
