"""Multi-turn episodes on the worker (workers/worker.py): the model acts, the environment answers,
repeat; the episodes of one lease request advance together, one batched generation per turn. The
transcript is one completion: model tokens (loss_mask 1), environment tokens (loss_mask 0). The
limits are decentrl/tasks/episodes.py's, which the orchestrator's replay checks.
"""

from __future__ import annotations

from collections.abc import Callable

from pydantic import TypeAdapter

from decentrl.api.wire import Lease, RunInfo, SamplingParams
from decentrl.config import TaskConfig
from decentrl.tasks import build_task
from decentrl.tasks.episodes import Environment, EpisodeTask, TextCodec, episode_end, turn_budget
from workers.sample import Sample

# Fills each sample to its budget (or end-of-sequence / stop string), across weight swaps.
Complete = Callable[[list[Sample], SamplingParams], None]


def episode_task_of(info: RunInfo) -> EpisodeTask | None:
    """The run's multi-turn task, built as on the orchestrator; None for single-turn runs."""
    if info.episode_task is None:
        return None
    task = build_task(TypeAdapter(TaskConfig).validate_python(info.episode_task))
    if not isinstance(task, EpisodeTask):
        raise ValueError(f"the orchestrator announced {info.episode_task} as multi-turn, but it is no EpisodeTask here")
    return task


def run_episodes(
    leases: list[Lease], sampling: SamplingParams, *, task: EpisodeTask, codec: TextCodec, complete: Complete
) -> list[Sample]:
    """One episode per lease entry (a lease appears once per sample of its group)."""
    episodes: list[tuple[Sample, Environment]] = [
        (Sample(prompt=lease.prompt_token_ids, budget=sampling.max_tokens, loss_mask=[]),
         task.environment(task.prompt(lease.prompt_id)))
        for lease in leases
    ]
    turn = 0
    while active := [(sample, env) for sample, env in episodes if sample.finish_reason is None]:
        turn += 1
        model_turns = [
            Sample(prompt=sample.prompt + sample.token_ids,
                   budget=turn_budget(task, used=len(sample.token_ids), max_tokens=sampling.max_tokens))
            for sample, _ in active
        ]
        complete(model_turns, sampling)
        for (episode, environment), model in zip(active, model_turns, strict=True):
            take_turn(episode, environment, model, turn=turn, task=task, codec=codec, max_tokens=sampling.max_tokens)
    return [sample for sample, _ in episodes]


def take_turn(
    episode: Sample, environment: Environment, model: Sample, *, turn: int, task: EpisodeTask, codec: TextCodec,
    max_tokens: int,
) -> None:
    """Append the model's turn, let the environment answer, and append the answer or end the episode."""
    assert episode.loss_mask is not None
    # The model turn's routes cover the whole transcript: the rows of earlier turns stay as
    # recorded, the environment's tokens get the rows this turn's forward computed for them.
    episode.extend_routes(model.routes)
    episode.extend(model.token_ids, model.logprobs, model.versions, model.masks)
    episode.loss_mask += [1] * len(model.token_ids)
    answer = environment.step(codec.decode(model.token_ids))
    answer_ids = codec.encode(answer.text)
    end = episode_end(
        done=answer.done, turns=turn, used=len(episode.token_ids), answer_tokens=len(answer_ids), task=task,
        max_tokens=max_tokens,
    )
    if end is not None:
        episode.finish_reason = end
        episode.claimed_reward = environment.reward()
        return
    if not answer_ids:
        raise ValueError(
            f"{type(environment).__name__}.step answered {answer.text!r} (no tokens) without ending the episode; "
            "an environment that goes on must answer with at least one token"
        )
    n = len(answer_ids)
    # Environment tokens were not sampled: logprob 0, the version of the turn before them, and
    # (when truncation is recorded) a sampling mask holding only the token itself.
    episode.extend(answer_ids, [0.0] * n, [model.versions[-1]] * n, [[t] for t in answer_ids] if model.masks else None)
    episode.loss_mask += [0] * n
