"""Where to branch a tree unit (issue 47): DEEP-GRPO's pivot utility (Guo et al. 2026, "Deep
Dense Exploration for LLM Reinforcement Learning via Pivot-Driven Resampling", arXiv
2602.14169), and the two rules it is held against.

A candidate pivot is a step boundary of a root sample that failed: the end of its step j of T
steps (j < T, so something is left to continue), at depth ratio rho = j / T in (0, 1). DEEP-GRPO
weighs a candidate by

    u(rho) = P(success | rho) * rho^gamma

where P(success | rho) is an online estimate of how often a branch from that depth recovers (a
logistic regression of the branches' outcomes on their depth ratios, refitted as outcomes come
in, over a sliding window; 1 until both outcomes have been seen), and rho^gamma a bias toward
deep pivots; pivots are drawn without replacement with probability proportional to u. The
worker holding the unit chooses with `choose_pivots`, by `rule`: `utility` (the above),
`last_right` (the last boundary before the first step judged wrong: a process reward model's
pick), or `random` (uniform over the candidates: the control that tells the branching's gain
from the rule's).
"""

from __future__ import annotations

import math
import random
from collections import deque
from dataclasses import dataclass
from typing import Literal

PivotRule = Literal["utility", "last_right", "random"]


@dataclass(frozen=True)
class Candidate:
    """A step boundary of a failed root sample: after its `step`-th step (1-based) of `steps`,
    `at` completion tokens in; `wrong_from`: the first step judged wrong (1-based; None: none was)."""

    rollout_id: str
    step: int
    steps: int
    at: int
    wrong_from: int | None = None

    @property
    def ratio(self) -> float:
        return self.step / self.steps


def pivot_utility(ratio: float, success: float, gamma: float) -> float:
    """u = P(success | ratio) * ratio^gamma."""
    return success * ratio**gamma


class RecoveryEstimate:
    """P(success | depth ratio) from the outcomes of branches: an L2-regularized logistic
    regression p(rho) = sigmoid(w * rho + b), minimizing w^2 / 2 + C * sum of log-losses (the
    intercept is not penalized), refitted by Newton's method over the last `window` outcomes.
    Until `min_outcomes` outcomes of both kinds are in, every depth is taken as recoverable (1)."""

    def __init__(self, *, window: int = 10_000, min_outcomes: int = 11, c: float = 1.0) -> None:
        self.outcomes: deque[tuple[float, int]] = deque(maxlen=window)
        self.min_outcomes = min_outcomes
        self.c = c
        self.coef: tuple[float, float] | None = None  # (w, b) once fitted

    def update(self, ratio: float, success: bool) -> None:
        """One branch from depth `ratio` ended right (`success`) or not; refits."""
        if not 0.0 < ratio <= 1.0:
            raise ValueError(f"a depth ratio is in (0, 1]; got {ratio}")
        self.outcomes.append((ratio, int(success)))
        labels = {y for _, y in self.outcomes}
        if len(self.outcomes) >= self.min_outcomes and labels == {0, 1}:
            self.coef = fit_logistic([x for x, _ in self.outcomes], [y for _, y in self.outcomes], self.c, self.coef)

    def success(self, ratio: float) -> float:
        if self.coef is None:
            return 1.0
        w, b = self.coef
        return _sigmoid(w * ratio + b)


def fit_logistic(
    xs: list[float], ys: list[int], c: float = 1.0, start: tuple[float, float] | None = None, iterations: int = 50
) -> tuple[float, float]:
    """(w, b) minimizing w^2 / 2 + c * sum_i log(1 + exp(-s_i (w x_i + b))), s_i = 2 y_i - 1:
    Newton's method on the two parameters (the objective is strictly convex in w, and in b once
    both labels occur)."""
    w, b = start if start is not None else (0.0, 0.0)
    for _ in range(iterations):
        gw, gb, hww, hwb, hbb = w, 0.0, 1.0, 0.0, 0.0
        for x, y in zip(xs, ys, strict=True):
            p = _sigmoid(w * x + b)
            gw += c * (p - y) * x
            gb += c * (p - y)
            h = c * p * (1.0 - p)
            hww += h * x * x
            hwb += h * x
            hbb += h
        det = hww * hbb - hwb * hwb
        if det <= 0.0:
            break
        dw = (hbb * gw - hwb * gb) / det
        db = (hww * gb - hwb * gw) / det
        w, b = w - dw, b - db
        if abs(dw) < 1e-12 and abs(db) < 1e-12:
            break
    return w, b


def _sigmoid(z: float) -> float:
    if z >= 0:
        return 1.0 / (1.0 + math.exp(-z))
    e = math.exp(z)
    return e / (1.0 + e)


def choose_pivots(
    candidates: list[Candidate], count: int, rule: PivotRule, rng: random.Random, *,
    estimate: RecoveryEstimate | None = None, gamma: float = 0.1,
) -> list[Candidate]:
    """Up to `count` distinct pivots among `candidates`, by `rule` (module docstring)."""
    if not candidates or count <= 0:
        return []
    if rule == "random":
        return rng.sample(candidates, min(count, len(candidates)))
    if rule == "last_right":
        # Per chain, the boundary just before its first wrong step (chains judged wrong first:
        # the PRM says where they went astray), then the deepest boundary of the others.
        best: dict[str, Candidate] = {}
        for candidate in candidates:
            limit = candidate.wrong_from - 1 if candidate.wrong_from is not None else candidate.steps
            if candidate.step <= limit and (
                candidate.rollout_id not in best or candidate.step > best[candidate.rollout_id].step
            ):
                best[candidate.rollout_id] = candidate
        ranked = sorted(best.values(), key=lambda c: (c.wrong_from is None, -c.ratio))
        return ranked[:count]
    estimate = estimate if estimate is not None else RecoveryEstimate()
    weights = [pivot_utility(c.ratio, estimate.success(c.ratio), gamma) for c in candidates]
    left = list(range(len(candidates)))
    chosen: list[Candidate] = []
    while left and len(chosen) < count:
        total = sum(weights[i] for i in left)
        if total <= 0.0:
            pick = rng.randrange(len(left))  # every weight underflowed: uniform
        else:
            target, pick = rng.random() * total, len(left) - 1
            for n, i in enumerate(left):
                target -= weights[i]
                if target < 0.0:
                    pick = n
                    break
        chosen.append(candidates[left.pop(pick)])
    return chosen
