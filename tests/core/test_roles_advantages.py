"""Units of roles (a proposer and its solvers): the proposer's learnability (Absolute Zero, R-Zero),
R-Zero's repetition penalty and the `roles` advantages (a node's own baseline; SPIRAL's
role-conditioned EMA or Absolute Zero's task-relative baseline for one-sample nodes), each against
a float64 reference written here from the papers' equations."""

from __future__ import annotations

import numpy as np
import pytest

from decentrl.rl.advantages import learnability, repetition_penalties, roles_advantages


def azr_reference(solves: list[float]) -> float:
    # Absolute Zero: r_propose = 0 if mean solve rate is 0 or 1, else 1 - mean solve rate.
    p = np.mean(np.asarray(solves, dtype=np.float64))
    return 0.0 if p == 0.0 or p == 1.0 else float(1.0 - p)


def rzero_reference(solves: list[float]) -> float:
    # R-Zero: r_uncertainty = 1 - 2 |p_hat - 1/2|.
    p = np.mean(np.asarray(solves, dtype=np.float64))
    return float(1.0 - 2.0 * np.abs(p - 0.5))


SOLVES = [[1, 1, 1, 1], [0, 0, 0, 0], [1, 0, 0, 0], [1, 1, 1, 0], [1, 0, 1, 0], [0.5, 1, 0.25], [1], [0]]


@pytest.mark.parametrize("solves", SOLVES)
def test_learnability_matches_the_papers(solves: list[float]) -> None:
    assert learnability(solves, "absolute_zero") == pytest.approx(azr_reference(solves), abs=1e-12)
    assert learnability(solves, "r_zero") == pytest.approx(rzero_reference(solves), abs=1e-12)
    p = float(np.mean(solves))
    assert learnability(solves, "r_zero") == pytest.approx(2 * min(p, 1 - p), abs=1e-12)


def test_learnability_rewards_the_edge_of_ability() -> None:
    assert learnability([1, 1, 1, 1], "absolute_zero") == 0.0, "solved by all: nothing to learn"
    assert learnability([0, 0, 0, 0], "absolute_zero") == 0.0, "solved by none: nothing to learn"
    assert learnability([1, 0, 0, 0], "absolute_zero") > learnability([1, 1, 1, 0], "absolute_zero"), "harder pays more"
    assert learnability([1, 0, 1, 0], "r_zero") == 1.0
    assert learnability([], "r_zero") == 0.0, "no solver result: no reward"
    with pytest.raises(ValueError, match="absolute_zero"):
        learnability([1.0], "nope")


def test_repetition_penalty_is_weight_times_cluster_share() -> None:
    proposals = ["3+4", "3+4", None, "12*7", "3+4", "9-2"]
    weight, batch = 0.5, len(proposals)
    reference = []
    for x in proposals:  # lambda |C_k| / B, counting the cluster by a direct loop
        reference.append(0.0 if x is None else weight * np.float64(sum(1 for y in proposals if y == x)) / batch)
    assert repetition_penalties(proposals, weight) == pytest.approx(reference, abs=1e-12)
    assert repetition_penalties(["a", "b"], 0.0) == [0.0, 0.0]


def test_roles_advantages_node_baseline_and_spiral_rae() -> None:
    nodes = [[0.0], [1.0, 0.0, 0.0, 1.0], [0.5], [0.0], [1.0, 1.0], [0.25]]
    keys = ["digits/proposer", "digits/solver", "digits/proposer", "other/proposer", "digits/solver", "digits/proposer"]
    decay = 0.9
    advantages, baselines = roles_advantages(nodes, keys, {"digits/proposer": 0.2}, single="rae", decay=decay)
    # Reference: SPIRAL's b <- a b + (1 - a) R; A = R - b, per (game, role), in order; a node of
    # several samples is centred on its own mean.
    b = {"digits/proposer": np.float64(0.2)}
    want = []
    for rewards, key in zip(nodes, keys, strict=True):
        r = np.asarray(rewards, dtype=np.float64)
        if len(r) > 1:
            want.append(list(r - r.mean()))
        else:
            b[key] = decay * b.get(key, np.float64(0.0)) + (1 - decay) * r[0]
            want.append([r[0] - b[key]])
    for got, expected in zip(advantages, want, strict=True):
        assert got == pytest.approx(expected, abs=1e-12)
    assert baselines == pytest.approx({k: float(v) for k, v in b.items()}, abs=1e-12)
    assert advantages[4] == [0.0, 0.0], "all solvers right: no signal"


def test_roles_advantages_task_relative_batch_baseline() -> None:
    nodes = [[0.0], [0.5], [1.0], [0.2], [1.0, 0.0, 0.5]]
    keys = ["a/proposer", "a/proposer", "a/proposer", "b/proposer", "a/solver"]
    advantages, baselines = roles_advantages(nodes, keys, {"a/proposer": 5.0}, single="batch", decay=0.9, normalize_std=True)
    a = np.asarray([0.0, 0.5, 1.0], dtype=np.float64)
    ref = (a - a.mean()) / (a.std() + 1e-6)  # Absolute Zero's TRR++: per task and role over the batch
    assert [x[0] for x in advantages[:3]] == pytest.approx(list(ref), rel=1e-9)
    assert advantages[3] == [0.0], "alone in its kind and role: its own mean, no signal"
    s = np.asarray([1.0, 0.0, 0.5])
    assert advantages[4] == pytest.approx(list((s - s.mean()) / (s.std() + 1e-6)), rel=1e-9)
    assert baselines == {"a/proposer": 5.0}, "the batch baseline keeps no state"


def test_roles_advantages_bad_arguments() -> None:
    with pytest.raises(ValueError, match="one kind/role per node"):
        roles_advantages([[1.0]], [], {}, single="rae", decay=0.9)
    with pytest.raises(ValueError, match="'rae' or 'batch'"):
        roles_advantages([[1.0]], ["a/b"], {}, single="ema", decay=0.9)
