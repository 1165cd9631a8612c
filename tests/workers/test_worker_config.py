"""A worker's settings come from `WorkerConfig` alone: the `decentrl worker` command takes only
who it is and where it connects, `decentrl run` hands workers the resolved config file, the
backend is built from [worker], and [simulation] acts in one place (workers/simulation.py)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import typer.main
from typer.testing import CliRunner

from decentrl.api.wire import RunInfo
from decentrl.cli.launch import worker_command
from decentrl.cli.main import app
from decentrl.config import SimulationConfig, load_config
from workers.backends.hf import HFBackend
from workers.backends.openai import OpenAIBackend
from workers.main import build_backend
from workers.sample import Sample
from workers.simulation import SimulatedLatency
from workers.worker import Worker

IDENTITY_AND_CONNECTION = {"--orchestrator", "--token", "--config", "--set", "--worker-id", "--cache-dir", "--spool-dir"}


def test_the_worker_command_has_no_setting_flags() -> None:
    worker = typer.main.get_command(app).commands["worker"]  # type: ignore[attr-defined]
    assert {opt for param in worker.params for opt in param.opts} == IDENTITY_AND_CONNECTION


def test_a_bad_set_stops_the_worker_before_it_connects() -> None:
    result = CliRunner().invoke(
        app, ["worker", "--orchestrator", "http://127.0.0.1:9", "--token", "t", "--set", "worker.concurency=2"]
    )
    assert result.exit_code == 2
    assert "worker.concurency: Extra inputs are not permitted" in result.output


def test_decentrl_run_hands_workers_the_resolved_config(tmp_path: Path) -> None:
    argv = worker_command(tmp_path / "config.json", tmp_path, "http://127.0.0.1:1", "worker-3")
    assert argv[argv.index("--config") + 1] == str(tmp_path / "config.json")
    assert argv[argv.index("--worker-id") + 1] == "worker-3"
    assert {arg for arg in argv if arg.startswith("--")} <= IDENTITY_AND_CONNECTION


def test_the_backend_is_built_from_the_worker_section() -> None:
    hf = build_backend(load_config(None).worker)
    assert isinstance(hf, HFBackend) and str(hf.device) == "cpu"
    config = load_config(None, [
        "worker.backend=openai", "worker.openai.url=http://127.0.0.1:8000", "worker.openai.model=m",
        "worker.openai.reload=lora",
    ])
    server = build_backend(config.worker)
    assert isinstance(server, OpenAIBackend)
    assert (server.url, server.model, server.reload) == ("http://127.0.0.1:8000", "m", "lora")


def test_simulated_latency_is_off_unless_configured() -> None:
    assert SimulatedLatency.of(SimulationConfig(), "worker-0") is None
    assert SimulatedLatency.of(SimulationConfig(latency_per_token_s=0.01), "worker-0") is not None
    slow = SimulationConfig(slowdowns={"worker-0": 3.0})
    assert SimulatedLatency.of(slow, "worker-1") is None
    latency = SimulatedLatency.of(slow, "worker-0")
    assert latency is not None and latency.extra_delay(0.5) == pytest.approx(1.0)  # 0.5 s more, twice over


def completions(*lengths: int) -> list[Sample]:
    """Finished samples with completions of these lengths (what a generation step returns)."""
    return [Sample(prompt=[1], budget=8, token_ids=[2] * n) for n in lengths]


def test_simulated_latency_wraps_a_step_and_draws_a_log_normal_delay() -> None:
    latency = SimulatedLatency(median_s=0.02, sigma=0.0, slowdown=2.0, seed="s")
    assert latency.extra_delay(0.0) == pytest.approx(0.04)  # sigma 0: exactly the median, times the slowdown
    assert latency.extra_delay(0.0, tokens=100) == pytest.approx(0.04)  # no per-token part unless configured
    step = latency.around(lambda n: completions(n), abandoned=lambda n: False, woken=threading.Condition())
    started = time.perf_counter()
    assert [len(s.token_ids) for s in step(3)] == [3]
    assert time.perf_counter() - started >= 0.04
    spread = SimulatedLatency(median_s=1.0, sigma=1.0, slowdown=1.0, seed="s")
    draws = sorted(spread.extra_delay(0.0) for _ in range(2001))
    assert draws[1000] == pytest.approx(1.0, rel=0.15)  # the median is median_s



def test_a_simulated_delay_ends_early_once_its_step_is_abandoned() -> None:
    """The delay stands for generation on the worker's accelerator: a step whose leases all lost
    to another copy wakes when told (the Condition), not when its 30 s delay is over; one not
    abandoned, or told of something else, waits its delay out."""
    latency = SimulatedLatency(median_s=30.0, sigma=0.0, slowdown=1.0, seed="s")
    woken, lost = threading.Condition(), set[str]()
    step = latency.around(lambda lease: completions(1), abandoned=lambda lease: lease in lost, woken=woken)
    done: list[float] = []

    def run() -> None:
        assert len(step("a")) == 1
        done.append(time.perf_counter() - started)

    slot = threading.Thread(target=run)
    started = time.perf_counter()
    slot.start()
    time.sleep(0.2)
    with woken:
        lost.add("b")  # another lease's news: the step still waits
        woken.notify_all()
    time.sleep(0.2)
    assert slot.is_alive()
    with woken:
        lost.add("a")
        woken.notify_all()
    slot.join(timeout=5)
    assert not slot.is_alive() and 0.4 <= done[0] < 2.0
    quick = SimulatedLatency(median_s=0.05, sigma=0.0, slowdown=1.0, seed="s")
    started = time.perf_counter()
    assert len(quick.around(lambda n: completions(n), abandoned=lambda n: False, woken=threading.Condition())(3)) == 1
    assert time.perf_counter() - started >= 0.05


def test_a_per_token_delay_makes_a_longer_request_later() -> None:
    """[simulation] latency_per_token_s: the delay grows with the completion tokens a request
    produced (all its samples), on top of the same log-normal tails as without it (same seed),
    and a slow worker is slower per token too."""
    config = SimulationConfig(latency_median_s=0.5, latency_sigma=1.0, latency_per_token_s=0.01, seed=4)
    with_tokens, without = SimulatedLatency.of(config, "worker-0"), SimulatedLatency.of(
        config.model_copy(update={"latency_per_token_s": 0.0}), "worker-0"
    )
    assert with_tokens is not None and without is not None
    for tokens in (0, 8, 48):
        assert with_tokens.extra_delay(0.0, tokens) == pytest.approx(without.extra_delay(0.0, tokens) + 0.01 * tokens)
    only = SimulatedLatency.of(SimulationConfig(latency_per_token_s=0.01), "worker-0")  # no tail: length alone
    assert only is not None and only.extra_delay(0.0, 30) == pytest.approx(0.3)
    slow = SimulatedLatency(median_s=0.0, sigma=1.0, per_token_s=0.01, slowdown=3.0, seed="s")
    assert slow.extra_delay(0.1, 20) == pytest.approx(0.1 * 2 + 3 * 0.2)
    step = SimulatedLatency(median_s=0.0, sigma=0.0, per_token_s=0.01, slowdown=1.0, seed="s").around(
        lambda lengths: completions(*lengths), abandoned=lambda lengths: False, woken=threading.Condition()
    )
    waited = []
    for lengths in ((1, 1), (6, 6, 6, 6, 6, 6, 6, 6)):  # 2 and 48 completion tokens
        started = time.perf_counter()
        step(lengths)
        waited.append(time.perf_counter() - started)
    assert 0.02 <= waited[0] < 0.3 and waited[1] >= 0.48

class InfoOnly:
    """A client that only answers /v1/info (enough to build a Worker)."""

    def __init__(self, store_url: str) -> None:
        self.store_url = store_url

    def info(self) -> RunInfo:
        return RunInfo(run_name="r", store_url=self.store_url, policy_version=None, max_staleness=1, group_size=2)


def test_the_worker_wraps_its_generation_step_only_for_a_simulation(tmp_path: Path) -> None:
    config = load_config(None, ["worker.concurrency=3"])

    def worker(simulation: SimulationConfig) -> Worker:
        return Worker(config.worker, worker_id="worker-0", cache_dir=str(tmp_path / "cache"),
                      client=InfoOnly(f"file://{tmp_path}/store"), backend=HFBackend(), simulation=simulation)  # type: ignore[arg-type]

    plain = worker(SimulationConfig())
    assert plain._samples_for == plain._generate_leases
    assert plain.store.url == f"file://{tmp_path}/store"  # the URL the orchestrator announced
    assert worker(SimulationConfig(latency_median_s=1.0))._samples_for != plain._generate_leases


def test_a_server_backend_is_called_by_every_slot_at_once_and_an_in_process_one_combined(tmp_path: Path) -> None:
    """An OpenAI-compatible server batches concurrent requests itself: the worker does not batch
    again (workers/batching.py `combine`); hf and vllm generate one call at a time, combined."""
    server = load_config(None, ["worker.backend=openai", "worker.openai.url=http://127.0.0.1:8000", "worker.openai.model=m"])
    for config, combined in ((load_config(None), True), (server, False)):
        worker = Worker(config.worker, worker_id="worker-0", cache_dir=str(tmp_path / "cache"),
                        client=InfoOnly(f"file://{tmp_path}/store"), backend=HFBackend())  # type: ignore[arg-type]
        assert worker._batcher.combine is combined
