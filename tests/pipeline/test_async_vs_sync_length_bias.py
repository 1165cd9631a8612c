"""benchmarks/async_vs_sync.py's length bias of stale drops: read from the trainer's per-step
metrics (each batch's completion_length_mean and reward_mean against its stale_report), weighted
by samples, and pooled over seeds as if one run."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("async_vs_sync", ROOT / "benchmarks" / "async_vs_sync.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def step(samples: int, length: float, reward: float, dropped: int = 0, dropped_length: float | None = None,
         dropped_reward: float | None = None) -> dict:
    """One metrics.jsonl record, the fields the report reads."""
    return {
        "samples": samples, "completion_length_mean": length, "reward_mean": reward,
        "stale_report_samples": dropped, "stale_report_length_mean": dropped_length,
        "stale_report_reward_mean": dropped_reward,
    }


def test_dropped_and_trained_are_weighted_by_samples(bench: ModuleType) -> None:
    metrics = [
        step(256, 6.0, 0.1),  # nothing dropped before the first batch
        step(256, 5.0, 0.3, dropped=24, dropped_length=6.0, dropped_reward=0.2),
        step(128, 4.0, 0.5, dropped=8, dropped_length=5.0, dropped_reward=None),  # stale at ingest: no reward
    ]
    bias = bench.length_bias(metrics)
    assert bias["trained_samples"] == 640 and bias["dropped_samples"] == 32 and bias["dropped_rewarded_samples"] == 24
    assert bias["trained_length_mean"] == pytest.approx((256 * 6 + 256 * 5 + 128 * 4) / 640)
    assert bias["trained_reward_mean"] == pytest.approx((256 * 0.1 + 256 * 0.3 + 128 * 0.5) / 640)
    assert bias["dropped_length_mean"] == pytest.approx((24 * 6 + 8 * 5) / 32)
    assert bias["dropped_reward_mean"] == pytest.approx(0.2)
    # Against the batch of the same step: +1 token at both steps, -0.1 reward where it is known.
    assert bias["length_gap_same_step"] == pytest.approx(1.0)
    assert bias["reward_gap_same_step"] == pytest.approx(-0.1)


def test_a_run_without_drops_reports_no_dropped_means(bench: ModuleType) -> None:
    bias = bench.length_bias([step(256, 5.0, 0.3), step(256, 5.0, 0.4)])
    assert bias["dropped_samples"] == 0 and bias["trained_length_mean"] == pytest.approx(5.0)
    assert bias["dropped_length_mean"] is None and bias["length_gap_same_step"] is None
    assert bias["dropped_reward_mean"] is None and bias["reward_gap_same_step"] is None


def test_seeds_pool_as_one_run(bench: ModuleType) -> None:
    first = [step(100, 5.0, 0.2, dropped=10, dropped_length=6.0, dropped_reward=0.1)]
    second = [step(300, 4.0, 0.4, dropped=30, dropped_length=4.0, dropped_reward=0.5), step(100, 4.0, 0.4)]
    pooled = bench.pool_length_bias([bench.length_bias(first), bench.length_bias(second)])
    assert pooled == pytest.approx(bench.length_bias(first + second))
    assert list(pooled) == list(bench.length_bias(first))
    nothing = bench.length_bias([step(100, 5.0, 0.2)])
    assert bench.pool_length_bias([nothing, bench.length_bias(first)])["dropped_length_mean"] == pytest.approx(6.0)
