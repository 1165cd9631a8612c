"""Unit tests for decentrl.rl.staleness: the freshness rule and the lease budget."""

from __future__ import annotations

import pytest

from decentrl.rl.staleness import is_fresh, lease_budget, staleness


@pytest.mark.parametrize(
    ("trainer_version", "rollout_version", "max_staleness", "fresh"),
    [
        (0, 0, 0, True),  # synchronous: only the trainer's own version
        (1, 0, 0, False),
        (5, 5, 0, True),
        (3, 2, 1, True),  # exactly max_staleness behind
        (3, 1, 1, False),  # one more than allowed
        (3, 1, 2, True),
        (3, 0, 2, False),
        (0, 1, 5, False),  # a future version is never fresh, however large the window
        (2, 3, 0, False),
        (2, 3, 1, False),
    ],
)
def test_is_fresh_boundaries(trainer_version: int, rollout_version: int, max_staleness: int, fresh: bool) -> None:
    assert is_fresh(trainer_version, rollout_version, max_staleness) is fresh


def test_staleness_is_trainer_minus_rollout_version() -> None:
    assert staleness(7, 5) == 2
    assert staleness(5, 7) == -2


@pytest.mark.parametrize(
    ("published", "max_staleness", "groups_per_step", "committed", "budget"),
    [
        (0, 0, 4, 0, 4),  # v0, synchronous: exactly the first step's groups
        (0, 0, 4, 4, 0),
        (0, 1, 4, 0, 8),  # one version of slack: two steps' worth
        (2, 1, 4, 5, 11),  # (2 + 1 + 1) * 4 - 5
        (1, 0, 3, 6, 0),
        (0, 0, 4, 9, 0),  # over-committed (e.g. after eviction accounting) never goes negative
    ],
)
def test_lease_budget_arithmetic(
    published: int, max_staleness: int, groups_per_step: int, committed: int, budget: int
) -> None:
    assert lease_budget(published, max_staleness, groups_per_step, committed) == budget


def test_lease_budget_agrees_with_is_fresh() -> None:
    # Groups are consumed in order, groups_per_step a step: group number c trains the step that
    # starts from version c // groups_per_step. A group may be leased now (sampled under the
    # published version) iff that step is at most max_staleness versions later. Fewer than
    # published * groups_per_step committed groups cannot happen: every published step consumed
    # groups_per_step of them.
    for published in range(4):
        for max_staleness in range(3):
            for groups_per_step in (1, 2, 5):
                for committed in range(published * groups_per_step, 40):
                    step_version = committed // groups_per_step
                    allowed = lease_budget(published, max_staleness, groups_per_step, committed) > 0
                    assert allowed == is_fresh(step_version, published, max_staleness), (
                        published,
                        max_staleness,
                        groups_per_step,
                        committed,
                    )
