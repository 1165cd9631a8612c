"""A worker whose requests outlast the orchestrator's lease timeout (rollout workers do not renew
their leases): every rollout comes back lease_expired, and the worker says once, at WARNING, which
setting to change. Real orchestrator on loopback and a real file:// store (tests/workers/test_worker.py);
the worker is slowed past the lease timeout by the simulated latency the benchmarks use."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest

from decentrl.config import SimulationConfig
from tests.workers.test_worker import TRAINER, WORKER, Setup, make_setup

pytestmark = pytest.mark.integration  # a real server and worker threads on loopback

LEASE_TIMEOUT_S = 0.3
DELAY_S = 0.8  # after each generation, well past the lease's deadline


@pytest.fixture
def short_lease_setup(tmp_path: Any) -> Iterator[Setup]:
    yield from make_setup(tmp_path, orchestrator_options={"lease_timeout_s": LEASE_TIMEOUT_S})


def test_rollouts_rejected_lease_expired_warn_once_naming_the_settings(
    short_lease_setup: Setup, caplog: pytest.LogCaptureFixture
) -> None:
    setup = short_lease_setup
    setup.publish(0, seed=0)
    worker = setup.worker(simulation=SimulationConfig(latency_median_s=DELAY_S, latency_sigma=0.0))
    caplog.set_level(logging.INFO)
    worker.run(max_iterations=2)  # two requests, each posted after its leases expired
    rejected = setup.orchestrator.client(WORKER).status().rollouts_rejected
    assert worker.rollouts_posted == 0 and rejected == {"lease_expired": 8}, rejected
    warnings = [r for r in caplog.records if r.name == "decentrl.worker" and r.levelno == logging.WARNING]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    message = warnings[0].getMessage()
    for setting in ("[orchestrator] lease_timeout_s", "[worker] groups_per_request", "[sampling] max_tokens"):
        assert setting in message
    assert WORKER not in caplog.text and TRAINER not in caplog.text
