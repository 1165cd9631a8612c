"""The advantage estimators beside GRPO (RLOO, REINFORCE++ and its group baseline) and DAPO's
overlong shaping and filtering, against float64 references written here from the papers'
equations; the orchestrator's batches built with them; and their config errors."""

from __future__ import annotations

import statistics
from typing import Any

import pytest

from decentrl.api.wire import Lease
from decentrl.config import AdvantageConfig, ConfigError, OverlongConfig, parse_config
from decentrl.rl.advantages import (
    ESTIMATORS,
    group_advantages,
    overlong_penalty,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
    rloo_advantages,
)
from orchestrator.batches import build_batch
from orchestrator.buffer import Group

GROUPS = [[1.0, 0.0, 0.5, 0.25], [0.75, 0.75, 0.75], [0.0, 1.0], [0.3, 0.9, 0.1, 0.6, 0.2]]


def test_rloo_is_reward_minus_the_mean_of_the_others() -> None:
    for rewards in GROUPS:
        G = len(rewards)
        expected = [r - sum(rewards[j] for j in range(G) if j != i) / (G - 1) for i, r in enumerate(rewards)]
        advantages = rloo_advantages(rewards)
        assert advantages == pytest.approx(expected, abs=1e-12)
        assert sum(advantages) == pytest.approx(0.0, abs=1e-12), "RLOO advantages sum to zero per group"
        mean = statistics.fmean(rewards)
        assert advantages == pytest.approx([G / (G - 1) * (r - mean) for r in rewards], abs=1e-12)


def test_rloo_of_a_constant_group_or_a_group_of_one_is_exactly_zero() -> None:
    assert rloo_advantages([0.1, 0.1, 0.1]) == [0.0, 0.0, 0.0]
    assert rloo_advantages([0.7]) == [0.0]


def test_reinforce_pp_whitens_over_the_whole_batch() -> None:
    flat = [r for rewards in GROUPS for r in rewards]
    mean, std = statistics.fmean(flat), statistics.pstdev(flat)
    advantages = reinforce_pp_advantages(GROUPS)
    assert [len(a) for a in advantages] == [len(g) for g in GROUPS]
    assert [a for group in advantages for a in group] == pytest.approx([(r - mean) / (std + 1e-6) for r in flat], rel=1e-9)
    assert all(a > 0 for a in advantages[1]), "no group baseline: an all-good group is pushed up"


def test_reinforce_pp_baseline_centres_per_group_and_scales_by_the_batch_std() -> None:
    centred = [[r - statistics.fmean(rewards) for r in rewards] for rewards in GROUPS]
    std = statistics.pstdev([a for group in centred for a in group])
    advantages = reinforce_pp_baseline_advantages(GROUPS)
    for got, want in zip(advantages, centred, strict=True):
        assert got == pytest.approx([a / (std + 1e-6) for a in want], rel=1e-9, abs=1e-12)
        assert sum(got) == pytest.approx(0.0, abs=1e-12)
    assert advantages[1] == [0.0, 0.0, 0.0], "a group of equal rewards has no signal"
    assert statistics.pstdev([a for group in advantages for a in group]) == pytest.approx(1.0, rel=1e-5)
    assert reinforce_pp_baseline_advantages([[0.5, 0.5], [1.0, 1.0]]) == [[0.0, 0.0], [0.0, 0.0]]


def test_grpo_estimator_is_group_advantages_unchanged() -> None:
    for normalize_std in (False, True):
        config = AdvantageConfig(normalize_std=normalize_std)
        assert ESTIMATORS["grpo"](GROUPS, config) == [group_advantages(g, normalize_std) for g in GROUPS]


def test_every_estimator_type_in_the_config_has_a_function() -> None:
    types = AdvantageConfig.model_fields["type"].annotation.__args__  # type: ignore[union-attr]
    # `roles` reads the samples' nodes, not only their rewards: orchestrator/batches.py `roles_outcome`.
    assert set(types) == set(ESTIMATORS) | {"roles"}


@pytest.mark.parametrize(("max_length", "cache"), [(20, 8), (20, 0), (20, 20)])
def test_overlong_penalty_is_dapo_soft_punishment(max_length: int, cache: int) -> None:
    config = OverlongConfig(max_length=max_length, cache=cache, penalty=1.0)

    def reference(L: int) -> float:  # DAPO eq. 13
        if L <= max_length - cache:
            return 0.0
        if max_length - cache < L <= max_length:
            return ((max_length - cache) - L) / cache
        return -1.0

    for length in range(0, max_length + 5):
        assert overlong_penalty(length, config) == pytest.approx(reference(length), abs=1e-12)
    assert overlong_penalty(max_length, config) == (-1.0 if cache else 0.0)  # cache 0: a step just past max_length
    assert overlong_penalty(max_length - cache, config) == 0.0 and overlong_penalty(max_length + 1, config) == -1.0
    assert overlong_penalty(max_length + 1, OverlongConfig(max_length=max_length, cache=cache, penalty=0.5)) == -0.5


def lease(lease_id: str) -> Lease:
    return Lease(lease_id=lease_id, prompt_id=0, prompt_token_ids=[1, 5], group_size=4, deadline=0.0)


def group(make_rollout: Any, lease_id: str, rewards: list[float], lengths: list[int], finish: list[str]) -> Group:
    rollouts = [make_rollout(lease(lease_id), list(range(3, 3 + n)), finish_reason=f) for n, f in zip(lengths, finish, strict=True)]
    return Group.of(lease_id, 0, rollouts, rewards)


def test_batches_use_the_configured_estimator_and_shape_then_mask(make_rollout: Any) -> None:
    groups = [
        group(make_rollout, "a", [1.0, 1.0, 0.0, 1.0], [4, 10, 12, 16], ["stop", "stop", "stop", "length"]),
        group(make_rollout, "b", [0.0, 0.5], [5, 6], ["stop", "stop"]),
    ]
    config = AdvantageConfig(type="rloo", overlong=OverlongConfig(max_length=16, cache=8), mask_truncated=True)
    batch = build_batch(groups, trainer_version=0, batch_id="x", advantages=config, rollouts_accepted=6, stale_dropped=0)

    # Shaped rewards: lengths 4, 10, 12, 16 in a band (8, 16]: 0, -2/8, -4/8, -8/8.
    shaped = [1.0, 1.0 - 0.25, 0.0 - 0.5, 1.0 - 1.0]
    assert [s.reward for s in batch.samples[:4]] == pytest.approx(shaped)
    assert [s.advantage for s in batch.samples[:4]] == pytest.approx(rloo_advantages(shaped))
    assert [s.advantage for s in batch.samples[4:]] == pytest.approx([-0.5, 0.5])
    # Overlong filtering: the truncated sample trains nothing, the others keep their masks.
    assert batch.samples[3].loss_mask == [0] * 16
    assert all(s.loss_mask is None for s in batch.samples[:3] + batch.samples[4:])


def test_default_batches_are_unchanged(make_rollout: Any) -> None:
    groups = [group(make_rollout, "a", [1.0, 0.0, 0.5], [20, 30, 40], ["length", "stop", "stop"])]
    batch = build_batch(groups, trainer_version=0, batch_id="x", advantages=AdvantageConfig(), rollouts_accepted=3, stale_dropped=0)
    assert [s.reward for s in batch.samples] == [1.0, 0.0, 0.5]
    assert [s.advantage for s in batch.samples] == group_advantages([1.0, 0.0, 0.5])
    assert all(s.loss_mask is None for s in batch.samples)


def test_reinforce_pp_batches_normalize_across_groups(make_rollout: Any) -> None:
    groups = [group(make_rollout, "a", [1.0, 1.0], [4, 4], ["stop"] * 2), group(make_rollout, "b", [0.0, 1.0], [4, 4], ["stop"] * 2)]
    batch = build_batch(groups, trainer_version=0, batch_id="x", advantages=AdvantageConfig(type="reinforce_pp"),
                        rollouts_accepted=4, stale_dropped=0)
    assert [s.advantage for s in batch.samples] == pytest.approx(
        [a for g in reinforce_pp_advantages([[1.0, 1.0], [0.0, 1.0]]) for a in g])


@pytest.mark.parametrize(
    ("data", "needles"),
    [
        ({"orchestrator": {"advantages": {"type": "ppo"}}}, ["orchestrator.advantages.type", "rloo"]),
        ({"orchestrator": {"advantages": {"type": "rloo", "normalize_std": True}}},
         ["orchestrator.advantages.normalize_std", "set normalize_std = false"]),
        ({"orchestrator": {"advantages": {"overlong": {"max_length": 8, "cache": 9}}}},
         ["orchestrator.advantages.overlong.cache (9) must be at most max_length (8)", "lower cache"]),
        ({"orchestrator": {"advantages": {"overlong": {"max_length": 8, "cache": -1}}}},
         ["orchestrator.advantages.overlong.cache"]),
        ({"orchestrator": {"advantages": {"overlong": {"max_length": 8, "cache": 2, "penalty": -1}}}},
         ["orchestrator.advantages.overlong.penalty"]),
        ({"orchestrator": {"advantages": {"overlong": {"cache": 2}}}}, ["orchestrator.advantages.overlong.max_length"]),
        ({"sampling": {"max_tokens": 8}, "orchestrator": {"advantages": {"overlong": {"max_length": 16, "cache": 4}}}},
         ["overlong.max_length (16) exceeds sampling.max_tokens (8)", "set max_length <= 8"]),
    ],
    ids=["unknown-type", "rloo-normalize-std", "cache-above-max", "negative-cache", "negative-penalty", "no-max-length",
         "max-length-above-budget"],
)
def test_bad_advantage_config_is_an_error_naming_the_field_and_fix(data: dict, needles: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(data, source="run.toml")
    for needle in needles:
        assert needle in str(info.value)
