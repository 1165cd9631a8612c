"""Multi-turn episodes: the guess-the-number environment, the worker's episode loop (transcript,
loss mask, logprobs), the orchestrator's replay (reward recomputed, tampering rejected) and user
environments loaded by import path."""

from __future__ import annotations

import functools
import textwrap
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from transformers import PreTrainedTokenizerBase

from decentrl.api.wire import Lease, SamplingParams
from decentrl.config import GuessTaskConfig, ImportTaskConfig
from decentrl.model.build import build_tiny_tokenizer
from decentrl.model.stopping import ends_generation
from decentrl.tasks import build_task
from decentrl.tasks.episodes import EpisodeMismatch, EpisodeTask, TextCodec, replay_episode, split_turns, tokenizer_codec
from decentrl.tasks.guess import GuessTask
from orchestrator.state import RunState
from workers.episodes import run_episodes
from workers.sample import Sample

TASK_CONFIG = GuessTaskConfig(max_number=99, max_turns=4, num_prompts=16, seed=3)
TASK = GuessTask(TASK_CONFIG)
EOS_IDS = {build_tiny_tokenizer().eos_token_id}


@pytest.fixture
def codec(tokenizer: PreTrainedTokenizerBase) -> TextCodec:
    return tokenizer_codec(tokenizer)


def lease(prompt_id: int, codec: TextCodec, task: EpisodeTask = TASK, group_size: int = 1) -> Lease:
    return Lease(lease_id=f"l{prompt_id}", prompt_id=prompt_id, prompt_token_ids=[1] + codec.encode(task.prompt(prompt_id).text),
                 group_size=group_size, deadline=0.0)


def scripted(rounds: list[list[str]], codec: TextCodec, eos: int | None, logprob: float = -0.5) -> Any:
    """A stand-in for the model: in round r, active episode i says rounds[r][i] then end-of-sequence
    (cut at the turn's budget; no end-of-sequence when `eos` is None: a worker that cuts turns
    itself). Each token gets `logprob` and version 7."""
    turns: Iterator[list[str]] = iter(rounds)

    def complete(samples: list[Sample], sampling: SamplingParams) -> None:
        for sample, text in zip(samples, next(turns), strict=True):
            ids = codec.encode(text) + ([] if eos is None else [eos])
            sample.extend(ids[: sample.budget], [logprob] * min(len(ids), sample.budget), [7] * min(len(ids), sample.budget), None)
            sample.finish_reason = "stop" if len(ids) <= sample.budget else "length"

    return complete


def params(max_tokens: int, stop: list[str] | None = None) -> SamplingParams:
    return SamplingParams(temperature=1.0, max_tokens=max_tokens, stop=stop or [])


def ends(codec: TextCodec, stop: list[str] | None = None) -> Callable[[list[int]], bool]:
    return functools.partial(ends_generation, eos_ids=EOS_IDS, stops=stop or [], text_of=codec.decode)


def replay(
    sample: Sample, prompt_id: int, codec: TextCodec, max_tokens: int, task: EpisodeTask = TASK, stop: list[str] | None = None
) -> float:
    assert sample.finish_reason is not None
    return replay_episode(task, task.prompt(prompt_id), sample.token_ids, sample.loss_mask, sample.finish_reason,
                          params(max_tokens, stop), codec, ends=ends(codec, stop))


def test_guess_environment_says_higher_or_lower_and_scores_by_guesses() -> None:
    env = TASK.environment(TASK.prompt(0))
    secret = env.secret
    assert 0 < secret < 99 and TASK.max_turn_tokens == 3
    assert TASK.environment(TASK.prompt(0)).secret == secret  # seeded: the orchestrator replays the same one
    answers = [env.step(turn).text for turn in ("=", "", "²", str(secret - 1), str(secret + 1))]
    assert answers == ["0=", "0=", "0=", "1=", "2="]
    assert env.reward() == 0.0
    found = TASK.environment(TASK.prompt(0))
    assert [found.step(turn).done for turn in (str(secret + 1), "7=", f" {secret}")] == [False, False, True]
    assert found.reward() == pytest.approx(1 - 2 / 4)  # found at the third guess of at most 4
    first = TASK.environment(TASK.prompt(0))
    assert first.step(str(secret)).done and first.reward() == 1.0


def test_episode_transcript_masks_environment_tokens_and_replays_to_the_same_reward(
    codec: TextCodec, tokenizer: PreTrainedTokenizerBase
) -> None:
    secret = TASK.environment(TASK.prompt(0)).secret
    sampling = SamplingParams(temperature=1.0, max_tokens=32)
    complete = scripted([["="], [str(secret + 1)], [str(secret)]], codec, tokenizer.eos_token_id)
    (sample,) = run_episodes([lease(0, codec)], sampling, task=TASK, codec=codec, complete=complete)
    eos = tokenizer.eos_token_id
    model1, env1 = codec.encode("=") + [eos], codec.encode("0=")
    model2, env2 = codec.encode(str(secret + 1)) + [eos], codec.encode("2=")
    model3 = codec.encode(str(secret)) + [eos]
    assert sample.token_ids == model1 + env1 + model2 + env2 + model3
    assert sample.loss_mask == [1] * len(model1) + [0, 0] + [1] * len(model2) + [0, 0] + [1] * len(model3)
    assert [lp for lp, m in zip(sample.logprobs, sample.loss_mask) if not m] == [0.0] * 4
    assert all(lp == -0.5 for lp, m in zip(sample.logprobs, sample.loss_mask) if m)
    assert set(sample.versions) == {7} and sample.finish_reason == "stop"
    assert sample.claimed_reward == pytest.approx(1 - 2 / 4)
    assert replay(sample, 0, codec, 32) == sample.claimed_reward
    # Tampered environment tokens (the worker claims "higher" where the environment says "lower").
    tampered = sample.token_ids.copy()
    tampered[len(model1) + 2 + len(model2)] = codec.encode("1")[0]
    with pytest.raises(EpisodeMismatch, match="environment turn 2 is not what the environment answers"):
        replay_episode(TASK, TASK.prompt(0), tampered, sample.loss_mask, "stop", params(32), codec, ends=ends(codec))
    # Model tokens passed off as environment tokens (never trained, so never checked) do not replay either.
    relabeled = sample.loss_mask.copy()
    relabeled[0] = 0
    with pytest.raises(EpisodeMismatch, match="starts and ends with a model turn"):
        replay_episode(TASK, TASK.prompt(0), sample.token_ids, relabeled, "stop", params(32), codec, ends=ends(codec))


def test_episode_ends_at_the_token_budget_or_the_turn_limit(codec: TextCodec, tokenizer: PreTrainedTokenizerBase) -> None:
    secret = TASK.environment(TASK.prompt(1)).secret
    wrong = str((secret + 50) % 100)
    # 3 + 2 + 3 tokens, then the answer (2) and one more token would not fit in 9: "length".
    short = SamplingParams(temperature=1.0, max_tokens=9)
    (sample,) = run_episodes([lease(1, codec)], short, task=TASK, codec=codec,
                             complete=scripted([[wrong], [wrong]], codec, tokenizer.eos_token_id))
    assert sample.finish_reason == "length" and len(sample.token_ids) == 2 * (len(wrong) + 1) + 2
    assert sample.loss_mask is not None and sample.loss_mask[-1] == 1 and sample.claimed_reward == 0.0
    assert replay(sample, 1, codec, 9) == 0.0
    with pytest.raises(EpisodeMismatch, match="ends with length, not stop"):
        replay_episode(TASK, TASK.prompt(1), sample.token_ids, sample.loss_mask, "stop", params(9), codec, ends=ends(codec))
    # A budget mid-turn: the model's turn is cut (no end-of-sequence) and the episode ends there.
    (cut,) = run_episodes([lease(1, codec)], SamplingParams(temperature=1.0, max_tokens=2), task=TASK, codec=codec,
                          complete=scripted([["123"]], codec, tokenizer.eos_token_id))
    assert cut.token_ids == codec.encode("12") and cut.finish_reason == "length" and replay(cut, 1, codec, 2) == 0.0
    # Four wrong guesses: the turn limit ends the episode ("stop"), with room left.
    (limited,) = run_episodes([lease(1, codec)], SamplingParams(temperature=1.0, max_tokens=64), task=TASK,
                              codec=codec, complete=scripted([[wrong]] * 4, codec, tokenizer.eos_token_id))
    assert limited.finish_reason == "stop" and limited.loss_mask is not None and limited.loss_mask.count(0) == 6
    assert replay(limited, 1, codec, 64) == 0.0


def test_replay_rejects_transcripts_the_episode_loop_cannot_produce(codec: TextCodec, tokenizer: PreTrainedTokenizerBase) -> None:
    eos = tokenizer.eos_token_id
    secret = TASK.environment(TASK.prompt(2)).secret
    right, wrong = codec.encode(str(secret)) + [eos], codec.encode(str((secret + 1) % 100)) + [eos]
    feedback = codec.encode("2=" if (secret + 1) % 100 > secret else "1=")

    def check(ids: list[int], mask: list[int], finish: str = "stop", max_tokens: int = 64) -> float:
        return replay_episode(TASK, TASK.prompt(2), ids, mask, finish, params(max_tokens), codec, ends=ends(codec))

    assert check(right, [1] * len(right)) == 1.0
    assert check(right, None) == 1.0  # type: ignore[arg-type] - no mask: one model turn
    assert check(wrong + feedback + right, [1] * len(wrong) + [0, 0] + [1] * len(right)) == pytest.approx(0.75)
    with pytest.raises(EpisodeMismatch, match="ends \\(stop\\) after model turn 1, but the transcript goes on"):
        check(right + feedback + right, [1] * len(right) + [0, 0] + [1] * len(right))
    with pytest.raises(EpisodeMismatch, match="ends with None, not stop"):  # cut short: neither done nor at a limit
        check(wrong, [1] * len(wrong))
    with pytest.raises(EpisodeMismatch, match="more than its budget of 3"):
        check([3, 4, 5, 6], [1, 1, 1, 1], finish="length", max_tokens=4)
    with pytest.raises(EpisodeMismatch, match="more than max_turns 4"):
        check((wrong + feedback) * 4 + wrong, ([1] * len(wrong) + [0, 0]) * 4 + [1] * len(wrong))


def without_eos(sample: Sample, turn: int, eos: int) -> tuple[list[int], list[int]]:
    """The transcript and loss mask with model turn `turn`'s end-of-sequence left out: what a
    worker that cuts the model's turns itself posts (the environment sees the same text)."""
    runs = split_turns(sample.token_ids, sample.loss_mask)
    model_runs = [index for index, (model, _) in enumerate(runs) if model]
    assert runs[model_runs[turn - 1]][1].pop() == eos
    return [t for _, ids in runs for t in ids], [int(model) for model, ids in runs for _ in ids]


def test_replay_checks_how_each_model_turn_ended(codec: TextCodec, tokenizer: PreTrainedTokenizerBase) -> None:
    """A model turn shorter than its budget (3 tokens here) ends at end-of-sequence or at the
    token completing a stop string; a worker cutting turns elsewhere (to make other guesses
    than the policy's) is caught, though the environment would answer the cut turns alike."""
    eos = tokenizer.eos_token_id
    assert TASK.environment(TASK.prompt(4)).secret == 47 and TASK.max_turn_tokens == 3
    honest = scripted([["17"], ["5"], ["47"]], codec, eos)
    (sample,) = run_episodes([lease(4, codec)], params(64), task=TASK, codec=codec, complete=honest)
    assert replay(sample, 4, codec, 64) == pytest.approx(0.5)  # every turn ends at end-of-sequence
    ids, mask = without_eos(sample, 2, eos)
    with pytest.raises(EpisodeMismatch, match="model turn 2 ends after 1 of its 3 tokens without end-of-sequence or a stop string"):
        replay_episode(TASK, TASK.prompt(4), ids, mask, "stop", params(64), codec, ends=ends(codec))
    # No end-of-sequence: "17" ends at the stop string "7" (its token kept), "123" at the budget.
    cut = scripted([["17"], ["123"]] * 2, codec, None)
    (stopped,) = run_episodes([lease(4, codec)], params(64, ["7"]), task=TASK, codec=codec, complete=cut)
    assert codec.decode(stopped.token_ids) == "171=1232=171=123" and stopped.finish_reason == "stop"
    assert replay(stopped, 4, codec, 64, stop=["7"]) == 0.0
    with pytest.raises(EpisodeMismatch, match="model turn 1 ends after 2 of its 3 tokens"):
        replay(stopped, 4, codec, 64)  # the same transcript, sampled without that stop string
    with pytest.raises(EpisodeMismatch, match="model turn 1 ends after 2 of its 3 tokens"):
        replay(stopped, 4, codec, 64, stop=["1"])  # "1" was complete one token earlier: the turn ran on


USER_TASK = '''
from decentrl.tasks import Prompt
from decentrl.tasks.episodes import Answer, EpisodeTask


class Countdown:
    """Say the digits from `start` down to 0, one per turn; the environment echoes "=" between."""

    def __init__(self, start):
        self.expected, self.right = start, 0

    def step(self, model_turn):
        if model_turn != str(self.expected):
            return Answer("", done=True)
        self.right += 1
        self.expected -= 1
        return Answer("=", done=self.expected < 0)

    def reward(self):
        return self.right / 4


class CountDownTask(EpisodeTask):
    def __init__(self, start=3):
        self.start, self.num_prompts, self.max_turns, self.max_turn_tokens = start, 8, 4, 2

    def prompt(self, prompt_id):
        return Prompt(prompt_id=prompt_id, text=f"{self.start}=")

    def environment(self, prompt):
        return Countdown(self.start)
'''


def test_user_episode_task_loads_by_import_path(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, codec: TextCodec, tokenizer: PreTrainedTokenizerBase
) -> None:
    (tmp_path / "my_env.py").write_text(textwrap.dedent(USER_TASK))
    monkeypatch.syspath_prepend(str(tmp_path))
    task = build_task(ImportTaskConfig(target="my_env:CountDownTask", options={"start": 3}))
    assert isinstance(task, EpisodeTask)
    sampling = SamplingParams(temperature=1.0, max_tokens=32)
    samples = run_episodes([lease(0, codec, task), lease(1, codec, task)], sampling, task=task, codec=codec,
                           complete=scripted([["3", "3"], ["2", "1"], ["1"], ["0"]], codec, tokenizer.eos_token_id))
    assert [s.claimed_reward for s in samples] == [1.0, 0.25]
    assert [replay(s, i, codec, 32, task) for i, s in enumerate(samples)] == [1.0, 0.25]
    assert samples[0].loss_mask == [1, 1, 0] * 3 + [1, 1]


def test_orchestrator_scores_episodes_by_replay_and_rejects_tampering(
    make_config: Any, make_rollout: Any, tokenizer: PreTrainedTokenizerBase, codec: TextCodec
) -> None:
    config = make_config(sampling={"max_tokens": 32}, group_size=2).model_copy(update={"task": TASK_CONFIG})
    state = RunState(config=config, task=build_task(config.task), tokenizer=tokenizer)
    state.announce(0)
    (granted,) = state.grant_leases("vol/w0", 1)
    secret = TASK.environment(TASK.prompt(granted.prompt_id)).secret
    wrong = str(secret + 1 if secret < 99 else secret - 1)
    complete = scripted([[wrong, "="], [str(secret), "="], ["="], ["="]], codec, tokenizer.eos_token_id)
    samples = run_episodes([granted, granted], state.sampling, task=TASK, codec=codec, complete=complete)

    def post(sample: Sample, **fields: Any) -> Any:
        values = dict(logprobs=sample.logprobs, loss_mask=sample.loss_mask, finish_reason=sample.finish_reason,
                      claimed_reward=sample.claimed_reward, sampling=state.sampling)
        values.update(fields)
        return state.ingest([make_rollout(granted, sample.token_ids, **values)], "vol/w0")

    flipped = samples[0].token_ids.copy()
    flipped[len(wrong) + 1] = codec.encode("0")[0]  # "2=" -> "0=": not the environment's answer
    assert post(samples[0], completion_token_ids=flipped).rejected[0].reason == "episode_mismatch"
    # Without a mask the transcript is one model turn, longer than a turn may be.
    assert post(samples[0], loss_mask=None).rejected[0].reason == "episode_mismatch"
    # A model turn cut short of its budget without end-of-sequence (the ids the tokenizer and the
    # model's generation config end a generation with, as the orchestrator reads them).
    ids, mask = without_eos(samples[0], 1, tokenizer.eos_token_id)
    cut = post(samples[0], completion_token_ids=ids, loss_mask=mask, logprobs=samples[0].logprobs[: len(ids)])
    assert cut.rejected[0].reason == "episode_mismatch"
    for sample in samples:
        assert post(sample).accepted == 1
    (group,) = state.ready
    assert [reward for _, reward in group.samples] == [pytest.approx(0.75), 0.0]
    assert [rollout.loss_mask for rollout, _ in group.samples] == [s.loss_mask for s in samples]


def test_single_turn_tasks_refuse_a_loss_mask(make_config: Any, make_rollout: Any, tokenizer: PreTrainedTokenizerBase) -> None:
    config = make_config()
    state = RunState(config=config, task=build_task(config.task), tokenizer=tokenizer)
    state.announce(0)
    (granted,) = state.grant_leases("vol/w0", 1)
    rollout = make_rollout(granted, "1234", loss_mask=[1, 1, 0, 0, 1])
    assert state.ingest([rollout], "vol/w0").rejected[0].reason == "loss_mask_without_episodes"
