"""benchmarks/gpu_check.py in its reduced mode (the one CI runs without CUDA): every section (the
`gpu` tests, trainer and hf worker against their bare loops, the compiled step, an end-to-end run of
configs/gpu1.toml)
runs through to a result, so the GPU path cannot rot between GPU runs. The figures mean nothing
here; only that each is there and sane."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from decentrl.cli.launch import running

pytestmark = pytest.mark.integration

ROOT = Path(__file__).parents[2]
SUMMARY = {
    "trainer_vs_bare_135m", "trainer_vs_bare_0_6b", "one_unit_vs_per_block_135m", "one_unit_vs_per_block_0_6b",
    "trainer_mfu_0_6b", "trainer_tokens_per_s_0_6b",
    "compiled_vs_eager_135m", "compiled_vs_eager_0_6b", "compiled_vs_bare_135m", "compiled_vs_bare_0_6b",
    "worker_hf_vs_bare", "gpu_tests_passed", "gpu_tests_failed", "total_s",
}


@pytest.mark.timeout(600)
def test_gpu_check_reduced_runs_every_section(tmp_path: Path) -> None:
    # --reduced: the small shapes on any machine (the default only without CUDA).
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--out", str(tmp_path), "--reduced"],
        cwd=ROOT, capture_output=True, text=True, timeout=570,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["reduced"] is True
    for section in ("tests", "trainer", "worker", "e2e", "compile"):
        assert "error" not in result[section], (section, result[section])
        assert result[section]["section_s"] > 0

    tests = result["tests"]
    assert (tests["exit_code"], tests["failed"], tests["errors"]) == (0, 0, 0), tests
    assert tests["files"]  # the gpu-marked test files were found

    for shape in ("smollm2_135m", "qwen3_0_6b"):
        trainer = result["trainer"][shape]
        assert trainer["tokens_per_s"] > 0 and trainer["trainer_vs_bare"] > 0 and trainer["one_unit_vs_per_block"] > 0, trainer

    for shape in ("smollm2_135m", "qwen3_0_6b"):  # [trainer] compile against the same step eager
        compiled = result["compile"][shape]
        assert compiled["compiled_vs_eager"] > 0 and compiled["compiled_first_step_s"] > compiled["compiled_step_s"], compiled
        assert result["summary"][f"compiled_vs_eager_{shape.split('_', 1)[1]}"] == compiled["compiled_vs_eager"]

    assert result["worker"]["worker_hf_vs_bare"] > 0 and result["worker"]["worker_hf_vs_bare_no_cudnn_sdp"] > 0

    e2e = result["e2e"]
    assert e2e["exit_code"] == 0, e2e
    assert e2e["steps"] == 3
    assert e2e["versions_loaded"] >= 1
    assert e2e["step_s"] > 0
    assert e2e["publish_s"] is not None

    assert set(result["summary"]) == SUMMARY
    assert result["summary"]["worker_hf_vs_bare"] == result["worker"]["worker_hf_vs_bare"]
    bare, compiled = result["trainer"]["qwen3_0_6b"]["bare_step_s"], result["compile"]["qwen3_0_6b"]["compiled_step_s"]
    assert result["summary"]["compiled_vs_bare_0_6b"] == pytest.approx(bare / compiled)
    assert json.loads((tmp_path / "gpu_check.json").read_text()) == result


def load_gpu_check():  # noqa: ANN201
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    return gpu_check


def test_a_section_stopped_by_its_budget_keeps_what_it_had_printed() -> None:
    """A section's child prints one JSON object a shape as it goes; stopped early, the check keeps
    them (the later line of a key wins) and skips what is not JSON."""
    gpu_check = load_gpu_check()
    stdout = b'{"smollm2_135m": {"eager_step_s": 1.0}}\nW1127 a torch warning\n{"smollm2_135m": {"eager_step_s": 2.0}}\n[1]\n'
    assert gpu_check.printed_so_far(stdout) == {"smollm2_135m": {"eager_step_s": 2.0}}
    assert gpu_check.printed_so_far(None) == {} and gpu_check.printed_so_far("") == {}


def test_the_memory_sampler_names_a_role_after_its_process_is_gone() -> None:
    """nvidia-smi still lists a rank while it exits, when /proc no longer has its argv (the H100
    run of 2026-11-27 reported the trainer rank twice, once as `pid-N`)."""
    sampler = load_gpu_check().GpuMemorySampler("unused")
    rank = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()", "trainer"], stdin=subprocess.PIPE)
    deadline = time.monotonic() + 10  # (its argv appears as it execs; nvidia-smi lists it later still)
    while not Path(f"/proc/{rank.pid}/cmdline").read_text() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sampler.named(rank.pid) == "trainer"
    rank.communicate(b"")  # exits and is reaped
    assert sampler.role_of(rank.pid) == f"pid-{rank.pid}"
    assert sampler.named(rank.pid) == "trainer"


@pytest.mark.timeout(120)
def test_an_end_to_end_run_out_of_time_is_stopped_with_every_role_it_started() -> None:
    """A run stopped by its budget: the run, torchrun's trainer and the worker all get the signal
    (a role left behind would hold the GPU through the sections after it)."""
    gpu_check = load_gpu_check()
    result = gpu_check.run_e2e(reduced=True, timeout_s=12)
    assert result["exit_code"] is None and "timed out after 12s" in result["output_tail"], result
    left = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and "decentrl-gpu-e2e-" in (proc / "cmdline").read_text():
                left.append((proc / "cmdline").read_text().replace("\0", " "))
        except OSError:
            continue
    assert not left, left


@pytest.mark.timeout(60)  # without the kill, the role holds the run's output open: communicate() waits on
def test_a_run_that_does_not_stop_is_killed_with_the_roles_in_sessions_of_their_own() -> None:
    """A loaded machine: the run outlasts its stop time after the interrupt. Its roles, each in a
    session of its own (out of reach of the run's group signal), are killed with it and gone
    when `finish_run` returns."""
    gpu_check = load_gpu_check()
    role = (
        "import signal, subprocess, sys, time\n"
        "signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import signal, time; "
        "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)'], start_new_session=True)\n"
        "print(child.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    run = gpu_check.start_run([sys.executable, "-c", role])
    child = int(run.stdout.readline())
    code, _ = gpu_check.finish_run(run, timeout_s=0.5, stop_s=1.0)
    assert code is None
    assert not running(child)
