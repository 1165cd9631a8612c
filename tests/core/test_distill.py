"""On-policy distillation's pieces that need no process: `distill_advantages` against a float64
reference written from the formula (GKD, arXiv 2306.13649; Thinking Machines 2025), and the
config's errors, each saying which key to change."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from decentrl.config import DistillConfig, parse_config
from decentrl.config.load import ConfigError
from decentrl.rl.advantages import distill_advantages, distill_baseline


def reference(teacher: np.ndarray, student: np.ndarray, mask: np.ndarray, outcome: float, weight: float,
              outcome_weight: float, clip: float | None) -> np.ndarray:
    """A_t = m_t * (weight * clip(teacher_t - student_t) + outcome_weight * A), in float64."""
    gap = teacher.astype(np.float64) - student.astype(np.float64)
    if clip is not None:
        gap = np.clip(gap, -clip, clip)
    return mask * (weight * gap + outcome_weight * outcome)


@pytest.mark.parametrize("clip", [None, 0.5])
def test_distill_advantages_equal_the_float64_reference(clip: float | None) -> None:
    rng = np.random.default_rng(0)
    for _ in range(50):
        n = int(rng.integers(1, 40))
        teacher, student = -rng.exponential(2.0, n), -rng.exponential(1.0, n)
        mask = rng.integers(0, 2, n) if rng.random() < 0.5 else np.ones(n, dtype=int)
        outcome, weight, outcome_weight = rng.normal(), rng.uniform(0.1, 3.0), rng.choice([0.0, rng.uniform(0, 2)])
        config = DistillConfig(weight=weight, outcome_weight=outcome_weight, clip=clip)
        got = distill_advantages(teacher.tolist(), student.tolist(), mask.tolist(), outcome, config)
        expected = reference(teacher, student, mask, outcome, weight, outcome_weight, clip)
        np.testing.assert_allclose(got, expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize("clip", [None, 0.5])
def test_the_group_baseline_centres_each_position_on_the_groups_mean_gap(clip: float | None) -> None:
    """baseline = "group": token t's gap minus the mean gap of the group's graded, unmasked samples
    at t (float64 reference); samples of different lengths; one sample the teacher did not grade."""
    rng = np.random.default_rng(1)
    lengths = [5, 3, 7, 4]
    teachers = [(-rng.exponential(2.0, n)).tolist() for n in lengths]
    students = [(-rng.exponential(1.0, n)).tolist() for n in lengths]
    masks = [None, [1, 0, 1], None, [1, 1, 1, 1]]
    graded: list[list[float] | None] = [teachers[0], teachers[1], None, teachers[3]]
    config = DistillConfig(baseline="group", clip=clip, weight=2.0)
    baseline = distill_baseline(graded, students, masks, config)
    assert baseline is not None and len(baseline) == 5
    for t in range(5):
        gaps = [
            np.clip(np.float64(graded[i][t]) - students[i][t], -(clip or np.inf), clip or np.inf)
            for i in range(4) if graded[i] is not None and t < lengths[i] and (masks[i] is None or masks[i][t])
        ]
        assert baseline[t] == pytest.approx(float(np.mean(gaps)), abs=1e-12)
    got = distill_advantages(graded[0], students[0], masks[0], 0.5, config, baseline)
    gap0 = np.clip(np.array(teachers[0]) - np.array(students[0]), -(clip or np.inf), clip or np.inf)
    np.testing.assert_allclose(got, 2.0 * (gap0 - np.array(baseline)), rtol=0, atol=1e-12)
    # Without a baseline the gaps are taken as they are.
    assert distill_baseline(graded, students, masks, DistillConfig()) is None


def test_a_sample_the_teacher_did_not_score_keeps_the_weighted_outcome_alone() -> None:
    config = DistillConfig(weight=2.0, outcome_weight=0.5)
    assert distill_advantages(None, [-1.0, -2.0, -0.5], [1, 0, 1], 0.4, config) == [0.2, 0.0, 0.2]
    assert distill_advantages(None, [-1.0, -2.0], None, 0.4, DistillConfig()) == [0.0, 0.0]


def test_log_probs_of_another_length_are_an_error_naming_the_counts() -> None:
    with pytest.raises(ValueError, match="2 teacher log-probs for 3 completion tokens"):
        distill_advantages([-1.0, -1.0], [-1.0, -2.0, -0.5], None, 0.0, DistillConfig())


def run_config(distill: dict[str, Any] | None = None, **top: Any) -> Any:
    orchestrator: dict[str, Any] = {"rewards": top.pop("rewards", {"type": "sum", "model_weight": 0.0})}
    if distill is not None:
        orchestrator["advantages"] = {"distill": distill}
    return parse_config({"orchestrator": orchestrator, **top}, source="test")


def test_a_distilling_config_loads_with_a_teacher_scorer() -> None:
    config = run_config({"weight": 1.0, "outcome_weight": 0.5}, num_scorers=1, scorer={"type": "teacher", "path": "/m"})
    assert config.orchestrator.advantages.distill == DistillConfig(outcome_weight=0.5)
    assert config.scorer is not None and config.scorer.type == "teacher" and config.scorer.temperature == 1.0
    assert run_config(None).orchestrator.advantages.distill is None


@pytest.mark.parametrize(
    ("distill", "top", "message"),
    [
        ({}, {"rewards": {"type": "verifier"}}, "set orchestrator.rewards.type = 'sum'"),
        ({}, {"rewards": {"type": "model", "step_scores": True}}, "set step_scores = false"),
        ({}, {"num_scorers": 1, "scorer": {"type": "hf", "path": "/rm"}}, "set [scorer] type = 'teacher'"),
        (None, {"num_scorers": 1, "scorer": {"type": "teacher", "path": "/m"}}, "add [orchestrator.advantages.distill]"),
        ({"weight": 0.0}, {}, "weight"),
        ({"weight": 2000.0}, {}, "weight"),
        ({"outcome_weight": -1.0}, {}, "outcome_weight"),
        ({"clip": 0.0}, {}, "clip"),
        ({"type": "forward_kl"}, {}, "type"),
        ({"temperature": 1.0}, {}, "temperature"),  # an unknown key
    ],
)
def test_config_errors_say_how_to_fix_the_file(distill: dict[str, Any] | None, top: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as refused:
        run_config(distill, **top)
    assert message in str(refused.value)


def test_a_teacher_scorer_config_is_bounded() -> None:
    for bad in ({"batch_size": 0}, {"temperature": 0.0}, {"max_length": 1}, {"dtype": "int8"}):
        with pytest.raises(ConfigError):
            parse_config({"scorer": {"type": "teacher", "path": "/m", **bad}}, source="test")
