"""Per-token advantages from step scores (decentrl/rl/advantages.py `process_advantages`), the
zero-variance rule with them, and TrainSample.token_advantages on the wire (bad input rejected).

The formula checks are hand-computed: every number below is exact in binary floating point, so
the results are compared with ==.
"""

from __future__ import annotations

import math
import random
import statistics
import struct

import msgpack
import pytest
from pydantic import ValidationError

from decentrl.api.encoding import EXT_FLOAT64, MEDIA_JSON, MEDIA_MSGPACK, encode_model, unpack_msgpack
from decentrl.api.wire import TrainBatch, TrainSample
from decentrl.config import AdvantageConfig
from decentrl.rl.advantages import group_advantages, informative_samples, process_advantages
from decentrl.trainer.batching import select_samples

# Sample 0: 5 tokens, steps ending at 1 and 4, scored 1 and 0.
# Sample 1: 4 tokens, steps ending at 0 and 2 (token 3 is an environment token after the last turn), scored 0 and 1.
# The group's step scores [1, 0, 0, 1] have mean 0.5 and std 0.5: centered [0.5, -0.5, -0.5, 0.5].
SCORES = [[1.0, 0.0], [0.0, 1.0]]
ENDS = [[1, 4], [0, 2]]
MASKS: list[list[int] | None] = [None, [1, 1, 1, 0]]
LENGTHS = [5, 4]


def advantages(outcome: list[float] | None = None, **config: object) -> list[list[float]]:
    return process_advantages(SCORES, ENDS, MASKS, LENGTHS, outcome or [0.0, 0.0], AdvantageConfig(**config))


def test_return_credits_each_token_with_its_step_and_every_later_step() -> None:
    # Sample 0: steps 0.5, -0.5 -> returns 0.0, -0.5; sample 1: -0.5, 0.5 -> 0.0, 0.5.
    assert advantages() == [[0.0, 0.0, -0.5, -0.5, -0.5], [0.0, 0.5, 0.5, 0.0]]


def test_step_credits_each_token_with_its_own_step() -> None:
    assert advantages(process="step") == [[0.5, 0.5, -0.5, -0.5, -0.5], [-0.5, 0.5, 0.5, 0.0]]


def test_std_normalization_divides_by_the_groups_step_score_std() -> None:
    eps = 1e-6
    unit = 0.5 / (0.5 + eps)
    expected = [[0.0, 0.0, -unit, -unit, -unit], [0.0, unit, unit, 0.0]]
    assert advantages(normalize_std=True) == expected


def test_weights_mix_the_outcome_advantage_into_every_trained_token() -> None:
    # 2 * process + 0.5 * outcome, outcome advantages 0.25 and -0.25; the mask-0 token stays 0.
    got = advantages([0.25, -0.25], process_weight=2.0, outcome_weight=0.5)
    assert got == [[0.125, 0.125, -0.875, -0.875, -0.875], [-0.125, 0.875, 0.875, 0.0]]
    # Outcome only: every trained token has its sample's outcome advantage.
    assert advantages([0.25, -0.25], process_weight=0.0, outcome_weight=1.0) == [[0.25] * 5, [-0.25, -0.25, -0.25, 0.0]]


def test_a_group_of_equal_step_scores_has_exactly_zero_process_advantage() -> None:
    # fmean([0.1, 0.1, 0.1]) is 0.10000000000000002: a naive mean would leave 1e-17 residues.
    got = process_advantages([[0.1, 0.1], [0.1]], [[0, 1], [2]], [None, None], [2, 3], [0.0, 0.0], AdvantageConfig(normalize_std=True))
    assert got == [[0.0, 0.0], [0.0, 0.0, 0.0]]
    assert group_advantages([0.1, 0.1, 0.1]) == [0.0, 0.0, 0.0]


def test_a_reference_written_from_the_paper_agrees_on_a_random_group() -> None:
    rng = random.Random(7)
    scores, ends, lengths = [], [], []
    for _ in range(6):
        length = rng.randrange(3, 40)
        cut = sorted(rng.sample(range(length - 1), rng.randrange(0, min(5, length - 1))))
        ends.append(cut + [length - 1])
        scores.append([rng.random() for _ in ends[-1]])
        lengths.append(length)
    flat = [s for row in scores for s in row]
    mean, std = statistics.fmean(flat), statistics.pstdev(flat)
    got = process_advantages(scores, ends, [None] * 6, lengths, [0.0] * 6, AdvantageConfig(normalize_std=True))
    for i in range(6):
        # DeepSeekMath 4.1.3: A_it = sum over steps j with index(j) >= t of (r_ij - mean) / std.
        expected = [sum((s - mean) / (std + 1e-6) for s, e in zip(scores[i], ends[i]) if e >= t) for t in range(lengths[i])]
        assert got[i] == pytest.approx(expected, rel=1e-12, abs=1e-12)


@pytest.mark.parametrize(
    ("scores", "ends", "lengths", "match"),
    [
        ([[1.0]], [[0, 1]], [2], "1 step scores for 2 steps"),
        ([[]], [[]], [2], "0 step scores"),
        ([[1.0, 0.0]], [[1, 1]], [2], "strictly increasing"),
        ([[1.0, 0.0]], [[1, 0]], [2], "strictly increasing"),
        ([[1.0]], [[2]], [2], "below 2"),
        ([[1.0]], [[-1]], [2], "strictly increasing"),
    ],
)
def test_step_scores_that_do_not_match_the_steps_are_rejected(
    scores: list[list[float]], ends: list[list[int]], lengths: list[int], match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        process_advantages(scores, ends, [None], lengths, [0.0], AdvantageConfig())
    with pytest.raises(ValueError, match="one entry per sample"):
        process_advantages([[1.0]], [[0]], [None, None], [1], [0.0], AdvantageConfig())


# -- the trainer's zero-variance rule ------------------------------------------------------------


def sample(reward: float, group: str, tokens: list[float] | None = None) -> TrainSample:
    return TrainSample(
        prompt_token_ids=[1, 5], completion_token_ids=[6, 7, 2], logprobs=[-0.5, -0.1, -0.2],
        advantage=0.0, reward=reward, policy_version=0, group_id=group, token_advantages=tokens,
    )


def test_equal_outcomes_with_different_step_scores_still_train() -> None:
    samples = [
        sample(1.0, "a", [0.5, 0.5, -0.5]), sample(1.0, "a", [0.0, 0.0, 0.0]),  # equal rewards, step signal: kept
        sample(1.0, "b", [0.0, 0.0, 0.0]), sample(0.0, "b", [0.0, 0.0, 0.0]),  # rewards differ, all advantages 0: dropped
        sample(1.0, "c"), sample(0.0, "c"),  # no step scores, rewards differ: kept
        sample(1.0, "d"), sample(1.0, "d"),  # no step scores, equal rewards: dropped
    ]
    keep = informative_samples([s.reward for s in samples], [s.group_id or "" for s in samples], [s.token_advantages for s in samples])
    assert keep == [True, True, False, False, True, True, False, False]
    batch = TrainBatch(trainer_version=0, samples=samples, staleness_histogram={"0": 8}, rollouts_accepted=8, stale_dropped=0)
    assert select_samples(batch, drop_zero_variance=True) == samples[:2] + samples[4:6]


# -- TrainSample.token_advantages on the wire ----------------------------------------------------


def test_token_advantages_round_trip_as_a_typed_float64_array() -> None:
    tokens = [0.1, -0.3333333333333333, 2.5]
    batch = TrainBatch(trainer_version=0, samples=[sample(1.0, "a", tokens)], staleness_histogram={}, rollouts_accepted=1, stale_dropped=0)
    raw = msgpack.unpackb(encode_model(batch, MEDIA_MSGPACK), raw=False)
    assert raw["samples"][0]["token_advantages"].code == EXT_FLOAT64  # exact: not float32
    for body in (unpack_msgpack(encode_model(batch, MEDIA_MSGPACK)), encode_model(batch, MEDIA_JSON)):
        decoded = TrainBatch.model_validate(body) if isinstance(body, dict) else TrainBatch.model_validate_json(body)
        assert decoded.samples[0].token_advantages == tokens


def body_with(tokens: object) -> dict[str, object]:
    body = sample(1.0, "a").model_dump()
    body["token_advantages"] = tokens
    return body


@pytest.mark.parametrize(
    ("tokens", "match"),
    [
        ([0.5, 0.5], "token_advantages has 2 entries but completion_token_ids has 3"),
        ([0.5, 0.5, 0.5, 0.5], "has 4 entries"),
        ([0.5, math.nan, 0.5], "finite"),
        ([math.inf, 0.0, 0.0], "finite"),
        ([0.0, 0.0, -math.inf], "finite"),
        ([0.5, "x", 0.5], "float"),
        ([0.5, None, 0.5], "float"),
        ("0.5", "list"),
        ([0.0] * (2**17 + 1), "at most 131072"),
    ],
)
def test_bad_token_advantages_are_rejected(tokens: object, match: str) -> None:
    with pytest.raises(ValidationError, match=match):
        TrainSample.model_validate(body_with(tokens))


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_token_advantages_in_a_typed_array_are_rejected(bad: float) -> None:
    body = body_with([0.5, bad, 0.5])
    packed = unpack_msgpack(msgpack.packb({"token_advantages": msgpack.ExtType(EXT_FLOAT64, struct.pack("<3d", 0.5, bad, 0.5))}))
    body["token_advantages"] = packed["token_advantages"]  # a TypedList: its values skip per-element checks
    with pytest.raises(ValidationError, match="finite"):
        TrainSample.model_validate(body)
