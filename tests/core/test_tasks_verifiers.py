"""The `verifiers` task source (decentrl/tasks/verifiers_env.py) against small environments
defined in tests/verifiers_envs.py with verifiers' own classes (`verifiers.v1`: TaskData, Task with `@vf.reward`,
Taskset, Env): prompts from the taskset, rewards from the task's reward functions through the
guard's child process, a held-out split, and a multi-turn Env played by the worker's episode loop
and replayed by the orchestrator. Skipped, with the reason, where the package is not installed
(the `verifiers` extra); the missing-package error itself is tested without it."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from transformers import PreTrainedTokenizerBase

from decentrl.api.wire import Lease, SamplingParams
from decentrl.config import RunConfig, VerifiersTaskConfig, parse_config
from decentrl.model.stopping import ends_generation
from decentrl.tasks import build_task
from decentrl.tasks.episodes import EpisodeMismatch, EpisodeTask, TextCodec, replay_episode, tokenizer_codec
from orchestrator.state import RunState
from tests.verifiers_envs import MODULES, write_environments
from workers.episodes import run_episodes
from workers.sample import Sample

MISSING = 'needs the verifiers extra: pip install -e ".[verifiers]"'
HAS_VERIFIERS = importlib.util.find_spec("verifiers") is not None
needs_verifiers = pytest.mark.skipif(not HAS_VERIFIERS, reason=MISSING)

@pytest.fixture(scope="module", autouse=True)
def environments(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The environments of tests/verifiers_envs.py on sys.path (the guard's spawned child inherits it)."""
    root = write_environments(tmp_path_factory.mktemp("vf_envs"))
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(root))
        yield root
    for name in MODULES:
        sys.modules.pop(name, None)


def verifiers_task(**fields: Any) -> Any:  # noqa: ANN401 - VerifiersTask or VerifiersEpisodeTask
    return build_task(parse_config({"task": {"type": "verifiers", **fields}}).task)


def test_a_missing_package_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "verifiers" else real(name, *a))
    with pytest.raises(ValueError, match=r"task.type 'verifiers' needs verifiers: install the verifiers extra"):
        verifiers_task(taskset="vf_reverse")


@needs_verifiers
def test_prompts_come_from_the_taskset_and_rewards_from_its_reward_functions() -> None:
    task = verifiers_task(taskset="vf_reverse", options={"count": 4})
    assert not isinstance(task, EpisodeTask) and task.num_prompts == 4  # the taskset's own option
    assert [task.prompt(i).messages for i in (0, 1)] == [
        (("system", "Reverse."), ("user", "012=")), (("system", "Reverse."), ("user", "123=")),
    ]
    prompt = task.prompt(2)
    assert task.reward(prompt, "432") == 1.0  # both rewards, weight 0.5 each
    assert task.reward(prompt, "423") == 0.5  # the first digit only
    assert task.reward(prompt, "") == 0.0
    assert task.reward_failures == {}


@needs_verifiers
def test_a_reward_that_raises_or_leaves_the_unit_interval_scores_zero_and_is_counted() -> None:
    rewards = {"bonus": {"fn": "vf_reverse:bonus"}, "broken": {"fn": "vf_reverse:broken", "weight": 0.0}}
    task = verifiers_task(taskset="vf_reverse", options={"task": {"rewards": {"bonus": rewards["bonus"]}}})
    assert task.reward(task.prompt(0), "210") == 0.0  # 0.5 + 0.5 + 1.0: not a score in [0, 1]
    assert task.reward_failures == {"out_of_range": 1}
    task = verifiers_task(taskset="vf_reverse", options={"task": {"rewards": {"broken": rewards["broken"]}}})
    assert task.reward(task.prompt(0), "210") == 0.0
    assert task.reward_failures == {"error": 1}


@needs_verifiers
def test_a_share_of_the_tasks_is_held_out_for_eval(make_config: Any) -> None:
    task = verifiers_task(taskset="vf_reverse", eval_fraction=0.5, seed=1)
    heldout = task.heldout_task()
    train = {task.prompt(i).text for i in range(task.num_prompts)}
    held = {heldout.prompt(i).text for i in range(heldout.num_prompts)}
    assert task.num_prompts == heldout.num_prompts == 3 and not train & held
    assert heldout.reward(heldout.prompt(0), heldout.prompt(0).text.split("\n")[-1][:3][::-1]) == 1.0
    with pytest.raises(ValueError, match="holds nothing out: set task.eval_fraction"):
        verifiers_task(taskset="vf_reverse").heldout_task()


@needs_verifiers
def test_what_decentrl_cannot_run_fails_at_start_up() -> None:
    with pytest.raises(ModuleNotFoundError, match="taskset 'vf_nope' not found"):
        verifiers_task(taskset="vf_nope")
    with pytest.raises(ValueError, match="has no prompt \\(the user opens\\): only a multi-turn Env can open it"):
        verifiers_task(taskset="vf_guess", env="single_agent")
    with pytest.raises(ValueError, match=r"declares the seats \['player', 'opponent'\]; .* plays exactly one seat"):
        verifiers_task(taskset="vf_guess", env="vf_pair")
    task = verifiers_task(taskset="vf_guess", env="vf_sleepy")
    environment = task.environment(task.prompt(0))
    with pytest.raises(ValueError, match="the Env awaited None: .* may await only its seat's turns"):
        environment.step("5")


# -- multi-turn ---------------------------------------------------------------------------


def lease(task: EpisodeTask, prompt_id: int, codec: TextCodec) -> Lease:
    ids = [1] + codec.encode(task.prompt(prompt_id).text)
    return Lease(lease_id=f"l{prompt_id}", prompt_id=prompt_id, prompt_token_ids=ids, group_size=1, deadline=0.0)


def scripted(rounds: list[list[str]], codec: TextCodec, eos: int) -> Any:  # noqa: ANN401 - a Complete
    """The model: in round r, active episode i says rounds[r][i], then end-of-sequence."""
    turns = iter(rounds)

    def complete(samples: list[Sample], sampling: SamplingParams) -> None:
        for sample, text in zip(samples, next(turns), strict=True):
            ids = codec.encode(text) + [eos]
            sample.extend(ids, [-0.5] * len(ids), [0] * len(ids), None)
            sample.finish_reason = "stop"

    return complete


@needs_verifiers
def test_a_multi_turn_env_is_played_by_the_worker_and_replayed_by_the_orchestrator(
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    task = verifiers_task(taskset="vf_guess", max_turns=4, max_turn_tokens=2)
    assert isinstance(task, EpisodeTask)
    assert task.prompt(0).text == "9=" and task.prompt(0).messages == (("user", "9="),)  # the Env opens
    codec, eos = tokenizer_codec(tokenizer), tokenizer.eos_token_id
    sampling = SamplingParams(temperature=1.0, max_tokens=32)
    # Secrets: prompt 0 -> 3, prompt 1 -> 0.
    complete = scripted([["5", "="], ["3", "0"]], codec, eos)
    played = run_episodes([lease(task, 0, codec), lease(task, 1, codec)], sampling, task=task, codec=codec,
                          complete=complete)
    assert [sample.claimed_reward for sample in played] == [0.75, 0.75]  # found at the second guess
    assert played[0].token_ids == codec.encode("5") + [eos] + codec.encode("2=") + codec.encode("3") + [eos]
    assert played[1].token_ids == codec.encode("=") + [eos] + codec.encode("0=") + codec.encode("0") + [eos]
    assert played[0].loss_mask == [1, 1, 0, 0, 1, 1]
    replayer = verifiers_task(taskset="vf_guess", max_turns=4, max_turn_tokens=2)  # the orchestrator's copy

    def replay(token_ids: list[int], prompt_id: int) -> float:
        return replay_episode(replayer, replayer.prompt(prompt_id), token_ids, played[prompt_id].loss_mask, "stop",
                              sampling, codec, ends=lambda ids: ends_generation(ids, eos_ids={eos}, stops=[], text_of=codec.decode))

    assert [replay(sample.token_ids, i) for i, sample in enumerate(played)] == [0.75, 0.75]
    lied = list(played[0].token_ids)
    lied[2] = codec.encode("1")[0]  # "2=" (lower) passed off as "1=" (higher)
    with pytest.raises(EpisodeMismatch, match="environment turn 1 is not what the environment answers"):
        replay(lied, 0)


@needs_verifiers
def test_the_orchestrator_scores_a_multi_turn_env_itself(
    make_config: Any, make_rollout: Any, tokenizer: PreTrainedTokenizerBase, clock: Any
) -> None:
    config: RunConfig = make_config(sampling={"max_tokens": 32}, group_size=2)
    config = config.model_copy(update={"task": VerifiersTaskConfig(taskset="vf_guess", max_turns=4, max_turn_tokens=2)})
    state = RunState(config=config, task=build_task(config.task), tokenizer=tokenizer, clock=clock)
    state.announce(0)
    (granted,) = state.grant_leases("vol/w0", 1)
    codec, eos = tokenizer_codec(tokenizer), tokenizer.eos_token_id
    assert tokenizer.decode(granted.prompt_token_ids, skip_special_tokens=True) == "9="
    task = build_task(config.task)  # the worker's copy
    secret = (7 * granted.prompt_id + 3) % 10
    wrong = str((secret + 5) % 10)
    samples = run_episodes([granted, granted], state.sampling, task=task, codec=codec,
                           complete=scripted([[str(secret), wrong], [str(secret)]], codec, eos))
    rollouts = [
        make_rollout(granted, sample.token_ids, logprobs=sample.logprobs, loss_mask=sample.loss_mask,
                     finish_reason=sample.finish_reason, claimed_reward=0.0, sampling=state.sampling)
        for sample in samples
    ]
    assert state.ingest(rollouts, "vol/w0").accepted == 2
    (group,) = state.ready
    assert [reward for _, reward in group.samples] == [1.0, 0.75]  # recomputed, not the claimed 0.0
