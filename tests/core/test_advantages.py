"""Group advantages and their options: std normalization in the orchestrator's batches
(orchestrator.advantages), zero-variance group filtering in the trainer (trainer.advantages)."""

from __future__ import annotations

import statistics
from typing import Any

import pytest
from transformers import PreTrainedTokenizerBase

from decentrl.api.wire import TrainBatch, TrainSample
from decentrl.config import ConfigError
from decentrl.rl.advantages import group_advantages, informative_samples
from decentrl.tasks import build_task
from decentrl.trainer.batching import select_samples
from orchestrator.state import RunState


def test_group_advantages_are_reward_minus_group_mean() -> None:
    rewards = [1.0, 0.5, 0.0, 0.25]
    advantages = group_advantages(rewards)
    mean = sum(rewards) / len(rewards)
    assert advantages == pytest.approx([r - mean for r in rewards])
    assert sum(advantages) == pytest.approx(0.0, abs=1e-12)


def test_group_advantages_std_normalization() -> None:
    rewards = [1.0, 0.5, 0.0, 0.25, 0.75]
    advantages = group_advantages(rewards, normalize_std=True)
    mean = statistics.fmean(rewards)
    std = statistics.pstdev(rewards)
    assert advantages == pytest.approx([(r - mean) / std for r in rewards], rel=1e-5)
    assert statistics.fmean(advantages) == pytest.approx(0.0, abs=1e-12)
    assert statistics.pstdev(advantages) == pytest.approx(1.0, rel=1e-5)


def test_group_advantages_of_a_constant_group_are_zero() -> None:
    # All samples equally good: no signal, and std normalization must not divide 0 by 0.
    assert group_advantages([0.5, 0.5, 0.5]) == [0.0, 0.0, 0.0]
    assert group_advantages([0.5, 0.5, 0.5], normalize_std=True) == [0.0, 0.0, 0.0]


def test_informative_samples_are_those_of_groups_with_different_rewards() -> None:
    rewards = [1.0, 1.0, 0.0, 0.5, 0.5, 0.5, 0.25, 0.75]
    groups = ["a", "a", "b", "c", "c", "c", "b", "d"]
    # a: equal rewards; b: 0.0 and 0.25 (interleaved with others); c: equal; d: a group of one.
    assert informative_samples(rewards, groups) == [False, False, True, False, False, False, True, False]


def sample(reward: float, group: str | None, advantage: float = 0.0) -> TrainSample:
    return TrainSample(
        prompt_token_ids=[1, 5], completion_token_ids=[6, 2], logprobs=[-0.5, -0.1],
        advantage=advantage, reward=reward, policy_version=0, group_id=group,
    )


def batch_of(samples: list[TrainSample]) -> TrainBatch:
    return TrainBatch(
        trainer_version=0, samples=samples, staleness_histogram={"0": len(samples)}, rollouts_accepted=len(samples), stale_dropped=0
    )


def test_select_samples_drops_zero_variance_groups_only_when_configured() -> None:
    samples = [sample(1.0, "a"), sample(1.0, "a"), sample(0.0, "b", -0.5), sample(1.0, "b", 0.5)]
    assert select_samples(batch_of(samples), drop_zero_variance=False) == samples
    assert select_samples(batch_of(samples), drop_zero_variance=True) == samples[2:]


def test_select_samples_needs_group_ids_to_filter() -> None:
    with pytest.raises(ValueError, match="drop_zero_variance needs group ids"):
        select_samples(batch_of([sample(1.0, None), sample(0.0, None)]), drop_zero_variance=True)


@pytest.mark.parametrize("normalize_std", [False, True])
def test_orchestrator_batches_follow_the_advantage_config(
    make_config: Any, tokenizer: PreTrainedTokenizerBase, make_rollout: Any, normalize_std: bool
) -> None:
    config = make_config(trainer={"groups_per_step": 1}, orchestrator={"advantages": {"normalize_std": normalize_std}})
    state = RunState(config=config, task=build_task(config.task), tokenizer=tokenizer)
    state.announce(0)
    (lease,) = state.grant_leases("alice/w0", 1)
    prompt = state.task.prompt(lease.prompt_id).text
    right = "".join(sorted(prompt.rstrip("=")))
    answers = [right, "0000", right[::-1]]  # three different rewards
    assert state.ingest([make_rollout(lease, text) for text in answers], "alice/w0").accepted == 3

    batch = state.take_batch(0)
    assert batch is not None
    rewards = [s.reward for s in batch.samples]
    assert len(set(rewards)) > 1
    assert [s.advantage for s in batch.samples] == pytest.approx(group_advantages(rewards, normalize_std=normalize_std))
    assert {s.group_id for s in batch.samples} == {lease.lease_id}


def test_dr_grpo_with_std_normalization_is_rejected_with_a_fix(make_config: Any) -> None:
    with pytest.raises(ConfigError, match="set orchestrator.advantages.normalize_std = false"):
        make_config(trainer={"loss": {"type": "dr_grpo"}}, orchestrator={"advantages": {"normalize_std": True}})
