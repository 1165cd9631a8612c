"""The client side of a lease (workers/lease_loop.py) on its own: renewals at half the time left
(a fake clock, a scripted orchestrator; retried, or ending the thread and telling its owner, on
errors), the request size a worker asks for, asking again after a backoff while requests fail,
and the spool that keeps unsent batches on disk until acknowledged (also across a restart).
The worker and the scorer use them against the real orchestrator (test_worker.py,
test_scorer_loop.py)."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from decentrl.api.client import InvalidAnswer, OrchestratorClient, OrchestratorError, Stopped
from decentrl.api.wire import Rollout, RolloutBatch, SamplingParams
from decentrl.backoff import backoff
from decentrl.cli.launch import free_port
from workers.lease_loop import Renewals, RequestSize, Spool, answers


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Orchestrator:
    """Renews leases `timeout_s` from its clock; a lease in `gone` answers 409, `error` is raised as is."""

    def __init__(self, clock: Clock, timeout_s: float = 10.0) -> None:
        self.clock = clock
        self.timeout_s = timeout_s
        self.renewed: list[tuple[str, float]] = []
        self.gone: set[str] = set()
        self.error: Exception | None = None

    def renew(self, lease_id: str) -> float:
        if self.error is not None:
            raise self.error
        if lease_id in self.gone:
            raise OrchestratorError(409, f"lease {lease_id} is closed")
        self.renewed.append((lease_id, self.clock.now))
        return self.clock.now + self.timeout_s


def never_fails() -> None:
    raise AssertionError("no renewal failed")


def test_each_lease_is_renewed_at_half_the_time_left_until_let_go() -> None:
    clock = Clock()
    orchestrator = Orchestrator(clock)
    renewals = Renewals(orchestrator.renew, failed=never_fails, clock=clock)
    renewals.hold("a", deadline=clock.now + 10)  # due at +5
    clock.now += 2
    renewals.hold("b", deadline=clock.now + 4)  # due at +4 (half of 4 s left, from +2)
    assert renewals.renew_due() == 1004.0 and orchestrator.renewed == []
    clock.now = 1004.0
    assert renewals.renew_due() == 1005.0 and orchestrator.renewed == [("b", 1004.0)]  # b's new deadline 1014: due 1009
    clock.now = 1005.0
    assert renewals.renew_due() == 1009.0 and orchestrator.renewed[-1] == ("a", 1005.0)  # a: deadline 1015, due 1010
    renewals.let_go("b")
    clock.now = 1009.5
    assert renewals.renew_due() == 1010.0 and len(orchestrator.renewed) == 2  # b let go: never renewed again
    renewals.let_go("a")
    assert renewals.renew_due() is None  # none held


def test_a_lease_about_to_expire_is_renewed_no_sooner_than_the_minimum() -> None:
    clock = Clock()
    renewals = Renewals(Orchestrator(clock).renew, failed=never_fails, clock=clock)
    renewals.hold("a", deadline=clock.now + 0.1)  # half of 0.1 s would hammer the orchestrator
    assert renewals.renew_due() == pytest.approx(clock.now + 0.5)


def test_a_lease_gone_is_let_go_and_another_error_is_raised() -> None:
    clock = Clock()
    orchestrator = Orchestrator(clock)
    renewals = Renewals(orchestrator.renew, failed=never_fails, clock=clock)
    renewals.hold("a", deadline=clock.now)
    renewals.hold("b", deadline=clock.now)
    orchestrator.gone.add("a")
    clock.now += 1
    renewals.renew_due()
    orchestrator.gone.clear()
    clock.now += 100
    renewals.renew_due()
    assert [lease for lease, _ in orchestrator.renewed] == ["b", "b"]  # a, gone, was let go
    orchestrator.error = OrchestratorError(401, "unknown token")
    clock.now += 100
    with pytest.raises(OrchestratorError, match="unknown token"):
        renewals.renew_due()


def test_the_renewing_thread_stops_on_an_unreachable_orchestrator_and_says_so() -> None:
    orchestrator = Orchestrator(Clock())
    orchestrator.error = ConnectionError("orchestrator at http://x unreachable for 120s")
    failed = threading.Event()
    renewals = Renewals(orchestrator.renew, failed=failed.set)  # the real clock: due at once
    thread = threading.Thread(target=renewals.run, daemon=True)
    thread.start()
    renewals.hold("a", deadline=time.time())
    assert failed.wait(10)
    thread.join(10)
    assert not thread.is_alive() and isinstance(renewals.error, ConnectionError)


def test_the_renewing_thread_wakes_for_a_new_lease_and_ends_on_close() -> None:
    clock = Clock()
    orchestrator = Orchestrator(clock)
    renewals = Renewals(orchestrator.renew, failed=never_fails, clock=clock)
    thread = threading.Thread(target=renewals.run, daemon=True)
    thread.start()  # nothing held: it waits (60 s) until a lease is held
    time.sleep(0.05)
    started = time.monotonic()
    renewals.hold("a", deadline=clock.now)  # due in MIN_RENEW_S (0.5 s, the real wait), not after the idle wait
    clock.now += 1
    while not orchestrator.renewed and time.monotonic() < started + 10:
        time.sleep(0.01)
    assert orchestrator.renewed == [("a", clock.now)] and time.monotonic() - started < 5
    renewals.close()
    thread.join(10)
    assert not thread.is_alive() and renewals.error is None


class FakeStop(threading.Event):
    """Records the waits instead of waiting."""

    def __init__(self) -> None:
        super().__init__()
        self.waits: list[float] = []

    def wait(self, timeout: float | None = None) -> bool:
        assert timeout is not None
        self.waits.append(timeout)
        return self.is_set()


def test_answers_back_off_on_passing_errors_and_raise_the_others() -> None:
    script: list[object] = [ConnectionError("down"), InvalidAnswer("bad"), ConnectionError("down"), "lease", "next"]

    def ask() -> str:
        step = script.pop(0)
        if isinstance(step, Exception):
            raise step
        return str(step)

    stop = FakeStop()
    got = answers(ask, stop=stop, passing=(ConnectionError, InvalidAnswer))
    assert next(got) == "lease" and len(stop.waits) == 3
    assert all(0 <= wait <= 0.5 * 2**n for n, wait in enumerate(stop.waits, start=1))  # full jitter, doubling
    assert next(got) == "next" and len(stop.waits) == 3  # a success resets the failures
    script.append(RuntimeError("a bug"))
    with pytest.raises(RuntimeError, match="a bug"):
        next(got)
    stop.set()
    assert list(answers(lambda: "never asked", stop=stop)) == []


def test_backoff_grows_to_its_cap() -> None:
    assert max(backoff(40, cap_s=10.0) for _ in range(200)) <= 10.0
    assert max(backoff(1) for _ in range(200)) <= 1.0


def batch(rollout_id: str) -> RolloutBatch:
    rollout = Rollout(
        rollout_id=rollout_id, run_name="r", lease_id="l", prompt_id=0, worker_id="w", policy_version=0,
        prompt_token_ids=[1], completion_token_ids=[2], logprobs=[-0.1], finish_reason="stop",
        sampling=SamplingParams(temperature=1.0, max_tokens=1),
    )
    return RolloutBatch(rollouts=[rollout])


def test_a_batch_stays_spooled_until_acknowledged_and_is_resent_oldest_first(tmp_path: Path) -> None:
    sent: list[str] = []
    reachable = [False]

    def send(posted: RolloutBatch) -> None:
        if not reachable[0]:
            raise ConnectionError("orchestrator unreachable")
        sent.append(posted.rollouts[0].rollout_id)

    spool = Spool(str(tmp_path / "spool"), send)
    assert not spool.post(batch("r1")) and not spool.post(batch("r2"))
    assert spool.unsent and len(spool.pending()) == 2 and sent == []
    assert not any(name.endswith(".partial") for name in os.listdir(spool.directory))
    restarted = Spool(spool.directory, send)  # a new process with the same directory
    reachable[0] = True
    restarted.resend()
    assert sent == ["r1", "r2"] and restarted.pending() == [] and not restarted.unsent
    assert restarted.post(batch("r3")) and sent[-1] == "r3" and restarted.pending() == []


def test_a_send_that_fails_otherwise_raises_and_keeps_the_batch(tmp_path: Path) -> None:
    def send(posted: RolloutBatch) -> None:
        raise OrchestratorError(401, "unknown token")

    spool = Spool(str(tmp_path), send)
    with pytest.raises(OrchestratorError):
        spool.post(batch("r1"))
    assert len(spool.pending()) == 1


def test_an_error_the_owner_passes_is_retried_and_the_leases_stay_held() -> None:
    orchestrator = Orchestrator(Clock())
    orchestrator.error = ConnectionError("orchestrator at http://x unreachable for 120s")
    renewals = Renewals(orchestrator.renew, failed=never_fails, passing=(ConnectionError,))
    thread = threading.Thread(target=renewals.run, daemon=True)
    thread.start()
    renewals.hold("a", deadline=time.time())  # due at once (MIN_RENEW_S)
    time.sleep(1.0)  # tried at least once, failed, backing off (at most 1 s after one failure)
    orchestrator.error = None
    deadline = time.monotonic() + 10
    while not orchestrator.renewed:
        assert time.monotonic() < deadline and thread.is_alive()
        time.sleep(0.01)
    assert renewals.error is None
    renewals.close()
    thread.join(10)
    assert not thread.is_alive()


@pytest.mark.parametrize("error", [InvalidAnswer("not a Lease"), RuntimeError("a bug"), OrchestratorError(401, "revoked")])
def test_any_other_error_ends_the_thread_and_tells_the_owner(error: Exception) -> None:
    orchestrator = Orchestrator(Clock())
    orchestrator.error = error
    failed = threading.Event()
    renewals = Renewals(orchestrator.renew, failed=failed.set, passing=(ConnectionError,))
    thread = threading.Thread(target=renewals.run, daemon=True)
    thread.start()
    renewals.hold("a", deadline=time.time())
    assert failed.wait(10)
    thread.join(10)
    assert not thread.is_alive() and renewals.error is error


def test_a_lease_gone_is_told_once_and_a_lease_not_renewed_now_is_asked_again_soon() -> None:
    clock = Clock()
    orchestrator = Orchestrator(clock)
    told: list[tuple[str, int]] = []
    stalled = {"b"}

    def renew(lease_id: str) -> float | None:
        return None if lease_id in stalled else orchestrator.renew(lease_id)

    renewals = Renewals(renew, failed=never_fails, gone=lambda lease, exc: told.append((lease, exc.status)), clock=clock)
    renewals.hold("a", deadline=clock.now + 2)
    renewals.hold("b", deadline=clock.now + 2)
    orchestrator.gone.add("a")
    clock.now += 1
    assert renewals.renew_due() == pytest.approx(clock.now + 0.5)  # b: not renewed, asked again in MIN_RENEW_S
    assert told == [("a", 409)] and orchestrator.renewed == []
    stalled.clear()
    clock.now += 0.5
    assert renewals.renew_due() == pytest.approx(clock.now + 5.0)  # b renewed (deadline +10); a let go: never told again
    assert told == [("a", 409)] and orchestrator.renewed == [("b", clock.now)]


def test_leases_due_together_are_renewed_at_once() -> None:
    # Eight renewals that each wait for all eight: done one after another they never would.
    clock = Clock()
    together = threading.Barrier(8, timeout=10)

    def renew(lease_id: str) -> float:
        together.wait()
        return clock.now + 10

    renewals = Renewals(renew, failed=never_fails, clock=clock)
    for i in range(8):
        renewals.hold(f"l{i}", deadline=clock.now)
    clock.now += 1
    assert renewals.renew_due() == pytest.approx(clock.now + 5.0)


def test_the_request_size_holds_each_group_s_share_to_the_target() -> None:
    # A CPU: every group adds 7.5 s, nothing is fixed; the target is 15 s (half a 30 s lease).
    size = RequestSize(most=8, target_s=15.0)
    size.finished(8, 200.0)  # the cold first request: not counted
    assert size.groups() == 8 and size.per_group_s() is None
    size.finished(8, 60.0)
    assert size.groups() == 4  # 7.5 s a group as if nothing were fixed: 2 fit, but one size seen halves at most
    size.finished(4, 30.0)
    assert size.per_group_s() == pytest.approx(7.5) and size.groups() == 2
    size.finished(2, 15.0)
    assert size.groups() == 2
    # A GPU decoding long completions: 120 s whatever the rows; fewer groups would not be faster.
    size = RequestSize(most=8, target_s=15.0)
    for groups, seconds in [(8, 30.0), (8, 120.0), (4, 118.0)]:
        size.finished(groups, seconds)
    assert size.per_group_s() == pytest.approx(0.5) and size.groups() == 8
    # One group takes longer than the target: one a request, never none.
    size = RequestSize(most=8, target_s=15.0)
    for groups, seconds in [(1, 1.0), (1, 40.0), (2, 80.0)]:
        size.finished(groups, seconds)
    assert size.groups() == 1
    # An orchestrator that does not say its lease timeout: the configured size.
    size = RequestSize(most=4, target_s=None)
    for seconds in (1.0, 100.0, 100.0):
        size.finished(4, seconds)
    assert size.groups() == 4


def test_a_stopped_client_gives_up_its_retries_at_once(tmp_path: Path) -> None:
    """SIGTERM's path (issue 46, F10): `stop()` ends a retry loop against an orchestrator that is gone
    with Stopped, a ConnectionError, so a spooled post stays spooled and the lease loop ends."""
    client = OrchestratorClient(f"http://127.0.0.1:{free_port()}", "token", max_wait_s=60.0)
    threading.Timer(0.5, client.stop).start()
    started = time.monotonic()
    spool = Spool(str(tmp_path / "spool"), client.post_rollouts)
    assert not spool.post(batch("r0"))
    assert time.monotonic() - started < 2.0 and len(spool.pending()) == 1
    assert list(answers(client.info, stop=threading.Event(), passing=(ConnectionError,))) == []
    with pytest.raises(Stopped):
        client.info()
