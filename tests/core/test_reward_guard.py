"""The reward guard: reward code that raises, hangs or returns nonsense scores 0, is counted, and
the guard goes on answering (a real spawned child process; a hang is ended by killing it)."""

from __future__ import annotations

import functools
import logging
import time
from pathlib import Path

import pytest

from decentrl.tasks.guard import RewardGuard, RewardGuardError

REWARDS = '''
import time

def score(text, reference):
    if text == "raise":
        raise RuntimeError("boom")
    if text == "hang":
        while True:
            time.sleep(0.01)
    if text == "big":
        return 7.0
    if text == "nan":
        return float("nan")
    return float(text == reference)


def factory():
    return score


def broken_factory():
    raise ImportError("no such library")
'''


@pytest.fixture
def guard(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):  # noqa: ANN201 - a RewardGuard
    (tmp_path / "guard_rewards.py").write_text(REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    import guard_rewards  # noqa: PLC0415 - written by this fixture

    made = RewardGuard(guard_rewards.factory, timeout_s=1.0, name="test")
    yield made
    made.close()


def test_raise_hang_and_nonsense_score_zero_and_are_counted(guard: RewardGuard, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="decentrl.tasks.guard")
    assert guard(0, "a", "a") == 1.0
    assert guard(1, "raise", "a") == 0.0
    started = time.monotonic()
    assert guard(2, "hang", "a") == 0.0
    assert time.monotonic() - started < 10  # bounded: the child was killed after 1 s
    assert guard(3, "big", "a") == 0.0
    assert guard(4, "nan", "a") == 0.0
    assert guard(5, "b", "b") == 1.0  # a fresh child after the hang
    assert dict(guard.failures) == {"error": 1, "timeout": 1, "out_of_range": 2}
    assert "prompt 1 scored 0: RuntimeError: boom" in caplog.text
    assert "prompt 2 scored 0: no answer within 1.0 s" in caplog.text


def test_a_scorer_that_cannot_be_built_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "guard_rewards2.py").write_text(REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    import guard_rewards2  # noqa: PLC0415

    guard = RewardGuard(functools.partial(guard_rewards2.broken_factory), timeout_s=1.0, name="test")
    with pytest.raises(RewardGuardError, match="could not build its scorer: ImportError: no such library"):
        guard(0, "a", "a")
