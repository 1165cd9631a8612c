"""Tree advantages and DEEP-GRPO's pivot utility (Guo et al. 2026, arXiv 2602.14169), each held
against a float64 reference written here from the paper's formulas, independently of the code:

- dual-stream advantages: a root sample's A = r - mean(root rewards), a branch sample's
  A = lambda * (r - mean(rewards of its pivot's branches)), each over its group's std + eps with
  std normalization;
- pivot weight u(rho) = P(success | rho) * rho^gamma, P a logistic regression of branch outcomes
  on depth ratio (fitted here by plain gradient descent on the same regularized log-loss, not
  Newton's method), pivots drawn without replacement in proportion to u.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from decentrl.rl.advantages import tree_advantages
from decentrl.rl.pivots import Candidate, RecoveryEstimate, choose_pivots, fit_logistic, pivot_utility


def _reference_tree(rewards: np.ndarray, pivots: list[object], lam: float, normalize: bool, eps: float = 1e-6) -> np.ndarray:
    out = np.zeros_like(rewards, dtype=np.float64)
    for key in set(pivots):
        idx = np.array([i for i, p in enumerate(pivots) if p == key])
        r = rewards[idx].astype(np.float64)
        centered = r - r.mean() if r.max() != r.min() else np.zeros_like(r)
        if normalize and r.max() != r.min():
            centered = centered / (r.std() + eps)  # numpy's std is the population std
        out[idx] = centered * (1.0 if key is None else lam)
    return out


@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("lam", [0.0, 0.5, 1.0, 3.0])
def test_tree_advantages_match_the_float64_reference(normalize: bool, lam: float) -> None:
    rng = np.random.default_rng(7)
    for _ in range(50):
        roots, k, pivots = int(rng.integers(2, 9)), int(rng.integers(1, 6)), int(rng.integers(0, 4))
        keys: list[object] = [None] * roots + [("r", p) for p in range(pivots) for _ in range(k)]
        order = rng.permutation(len(keys))
        keys = [keys[i] for i in order]  # samples of a unit arrive in any order
        rewards = rng.choice([0.0, 0.25, 1.0], size=len(keys))
        got = tree_advantages(rewards.tolist(), keys, lam, normalize)
        np.testing.assert_allclose(got, _reference_tree(rewards, keys, lam, normalize), rtol=1e-12, atol=1e-12)


def test_a_pivot_whose_branches_all_fail_teaches_nothing_locally() -> None:
    got = tree_advantages([1.0, 0.0, 0.0, 0.0, 0.0], [None, None, "p", "p", "p"], 1.0)
    assert got == [0.5, -0.5, 0.0, 0.0, 0.0]


def test_branches_alone_are_not_a_tree() -> None:
    with pytest.raises(ValueError, match="root samples"):
        tree_advantages([1.0, 0.0], ["p", "p"], 1.0)
    with pytest.raises(ValueError, match="2 rewards for 1"):
        tree_advantages([1.0, 0.0], [None], 1.0)


def _reference_logistic(xs: np.ndarray, ys: np.ndarray, c: float) -> tuple[float, float]:
    # Gradient descent on w^2/2 + c * sum log(1 + exp(-s (w x + b))), s = 2y - 1, to convergence.
    w = b = 0.0
    lr = 1.0 / (1.0 + c * len(xs))
    for _ in range(200_000):
        p = 1.0 / (1.0 + np.exp(-(w * xs + b)))
        gw, gb = w + c * np.sum((p - ys) * xs), c * np.sum(p - ys)
        w, b = w - lr * gw, b - lr * gb
        if abs(gw) < 1e-11 and abs(gb) < 1e-11:
            break
    return w, b


def test_the_recovery_estimate_is_the_regularized_logistic_regression() -> None:
    rng = np.random.default_rng(3)
    xs = rng.uniform(0.05, 1.0, size=80)
    ys = (rng.uniform(size=80) < 0.9 - 0.8 * xs).astype(np.float64)  # deep pivots recover less often
    for c in (0.1, 1.0, 10.0):
        w, b = fit_logistic(xs.tolist(), ys.astype(int).tolist(), c)
        rw, rb = _reference_logistic(xs, ys, c)
        assert (w, b) == pytest.approx((rw, rb), abs=1e-7)
    assert w < 0  # fitted: success falls with depth, as the data says


def test_the_estimate_is_one_until_both_outcomes_are_seen_then_learns_them() -> None:
    estimate = RecoveryEstimate(min_outcomes=11)
    for _ in range(20):
        estimate.update(0.9, False)
    assert estimate.success(0.9) == 1.0 and estimate.coef is None  # failures alone: no fit
    for i in range(20):
        estimate.update(0.2, True)
        estimate.update(0.25 + i / 1000, True)
    assert estimate.success(0.2) > 0.8 and estimate.success(0.9) < 0.5
    with pytest.raises(ValueError, match="depth ratio"):
        estimate.update(0.0, True)


def test_utility_draws_follow_p_times_ratio_to_the_gamma() -> None:
    estimate = RecoveryEstimate()
    estimate.coef = (-4.0, 2.0)  # P(success | rho) = sigmoid(2 - 4 rho)
    gamma = 2.0
    candidates = [Candidate("a", step, 5, step * 3) for step in range(1, 5)]
    weights = np.array([1 / (1 + np.exp(-(2 - 4 * c.ratio))) * c.ratio**gamma for c in candidates], dtype=np.float64)
    assert [pivot_utility(c.ratio, estimate.success(c.ratio), gamma) for c in candidates] == pytest.approx(weights.tolist(), rel=1e-12)
    rng, counts, draws = random.Random(0), np.zeros(4), 40_000
    for _ in range(draws):
        (pick,) = choose_pivots(candidates, 1, "utility", rng, estimate=estimate, gamma=gamma)
        counts[pick.step - 1] += 1
    expected = weights / weights.sum()
    assert np.abs(counts / draws - expected).max() < 0.01  # 4 sigma of a binomial at 40k draws
    two = choose_pivots(candidates, 2, "utility", random.Random(1), estimate=estimate, gamma=gamma)
    assert len({c.step for c in two}) == 2  # without replacement


def test_last_right_picks_the_boundary_before_the_first_wrong_step_and_random_is_uniform() -> None:
    chain = [Candidate("a", step, 6, step * 4, wrong_from=4) for step in range(1, 6)]
    unjudged = [Candidate("b", step, 3, step * 4) for step in range(1, 3)]
    assert [(c.rollout_id, c.step) for c in choose_pivots(chain + unjudged, 2, "last_right", random.Random(0))] == [
        ("a", 3), ("b", 2)
    ]
    rng, counts = random.Random(5), np.zeros(5)
    for _ in range(20_000):
        counts[choose_pivots(chain, 1, "random", rng)[0].step - 1] += 1
    assert np.abs(counts / 20_000 - 0.2).max() < 0.015
    assert choose_pivots([], 3, "utility", rng) == [] and choose_pivots(chain, 0, "random", rng) == []
