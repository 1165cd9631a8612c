"""BatchPrefetcher: the next step's batch is fetched while the caller works on the current one."""

from __future__ import annotations

import threading
import time

import pytest

from decentrl.api.wire import TrainBatch
from decentrl.trainer.prefetch import BatchPrefetcher


def batch_for(step: int) -> TrainBatch:
    return TrainBatch(trainer_version=step - 1, samples=[], staleness_histogram={}, rollouts_accepted=step, stale_dropped=0)


class SlowSource:
    """A fetch that takes `delay_s` and records which steps were asked for, from which thread."""

    def __init__(self, delay_s: float, fail_at: int | None = None) -> None:
        self.delay_s = delay_s
        self.fail_at = fail_at
        self.asked: list[int] = []
        self.threads: set[str] = set()

    def __call__(self, step: int) -> TrainBatch:
        self.asked.append(step)
        self.threads.add(threading.current_thread().name)
        time.sleep(self.delay_s)
        if step == self.fail_at:
            raise ConnectionError(f"orchestrator unreachable at step {step}")
        return batch_for(step)


def test_each_step_gets_its_own_batch_and_nothing_is_fetched_past_the_last_step() -> None:
    source = SlowSource(delay_s=0.0)
    prefetcher = BatchPrefetcher(source, last_step=5)
    got = [prefetcher.take(step).trainer_version for step in range(1, 6)]
    assert got == [0, 1, 2, 3, 4]
    time.sleep(0.05)  # a stray fetch past the last step would show up by now
    assert source.asked == [1, 2, 3, 4, 5]
    assert all(name.startswith("batch-prefetch-") for name in source.threads)


def test_the_next_fetch_overlaps_the_callers_work() -> None:
    source = SlowSource(delay_s=0.3)
    prefetcher = BatchPrefetcher(source, last_step=3)
    prefetcher.take(1)  # nothing was prefetched for the first step: it waits the whole fetch
    time.sleep(0.4)  # "training" step 1: step 2's batch arrives meanwhile
    started = time.perf_counter()
    assert prefetcher.take(2).trainer_version == 1
    assert time.perf_counter() - started < 0.15
    assert source.asked == [1, 2, 3]


def test_a_resumed_loop_starts_at_any_step() -> None:
    source = SlowSource(delay_s=0.0)
    prefetcher = BatchPrefetcher(source, last_step=9)
    assert prefetcher.take(7).trainer_version == 6
    assert prefetcher.take(8).trainer_version == 7
    assert source.asked[:2] == [7, 8]


def test_a_failed_fetch_is_raised_by_take() -> None:
    prefetcher = BatchPrefetcher(SlowSource(delay_s=0.0, fail_at=2), last_step=3)
    prefetcher.take(1)
    with pytest.raises(ConnectionError, match="step 2"):
        prefetcher.take(2)


def test_a_take_with_a_wait_answers_none_until_the_batch_is_there_and_fetches_it_once() -> None:
    source = SlowSource(delay_s=0.6)
    prefetcher = BatchPrefetcher(source, last_step=2)
    started = time.monotonic()
    assert prefetcher.take(1, wait_s=0.1) is None  # a heartbeat's wait (decentrl/trainer/distributed.py)
    assert time.monotonic() - started < 0.5
    while (batch := prefetcher.take(1, wait_s=0.1)) is None:
        pass
    assert batch.trainer_version == 0
    assert source.asked[:1] == [1] and source.asked.count(1) == 1  # the same fetch, not one per wait
