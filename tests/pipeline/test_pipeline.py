"""The real pipeline: `decentrl run` starts an orchestrator, two workers and a two-rank FSDP2
trainer (torchrun, gloo) that talk only over loopback HTTP and a file:// checkpoint store."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from decentrl.store.checkpoints import CheckpointStore

pytestmark = pytest.mark.integration

# The smallest model and completions the pipeline tests train (TOML tables, shared).
TINY_MODEL = """
[model]
hidden_size = 32
num_layers = 1
num_heads = 2
intermediate_size = 64
[sampling]
max_tokens = 6
"""


def pipeline_config(*, run_name: str, steps: int, max_staleness: int, lr: float, extra: str = "") -> str:
    """Two workers and a two-rank trainer on TINY_MODEL, groups of 4, 8 groups a step."""
    return f"""
run_name = "{run_name}"
max_staleness = {max_staleness}
group_size = 4
num_workers = 2
trainer_ranks = 2
{TINY_MODEL}
[orchestrator]
port = 0
[worker]
groups_per_request = 4
[trainer]
steps = {steps}
groups_per_step = 8
lr = {lr}
{extra}"""


def run_decentrl(tmp_path: Path, *, steps: int, max_staleness: int) -> tuple[subprocess.CompletedProcess[str], Path]:
    return run_config(tmp_path, pipeline_config(run_name="it", steps=steps, max_staleness=max_staleness, lr=3e-3))


def decentrl_run_command(tmp_path: Path, text: str) -> tuple[list[str], Path]:
    """The `decentrl run` command line for a config given as TOML text; the run dir is tmp_path/run."""
    config = tmp_path / "run.toml"
    config.write_text(text)
    run_dir = tmp_path / "run"
    return [sys.executable, "-m", "decentrl", "run", str(config), "--run-dir", str(run_dir)], run_dir


def run_config(tmp_path: Path, text: str) -> tuple[subprocess.CompletedProcess[str], Path]:
    """`decentrl run` on a config given as TOML text, to completion."""
    command, run_dir = decentrl_run_command(tmp_path, text)
    return subprocess.run(command, capture_output=True, text=True, timeout=600), run_dir


def processes_mentioning(text: str) -> list[int]:
    """PIDs whose command line mentions `text` (our run dir): none may outlive the run."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if text in cmdline and int(entry.name) != os.getpid():
                pids.append(int(entry.name))
    return pids


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("max_staleness", [1, 0])
def test_pipeline_trains_publishes_and_respects_staleness(tmp_path: Path, max_staleness: int) -> None:
    steps = 6 if max_staleness else 4
    result, run_dir = run_decentrl(tmp_path, steps=steps, max_staleness=max_staleness)
    assert result.returncode == 0, result.stdout + result.stderr

    # The run dir holds the resolved config, every role's log, metrics and the store.
    resolved = json.loads((run_dir / "config.json").read_text())
    assert resolved["store"]["url"] == str(run_dir / "checkpoints")
    logs = {p.name for p in (run_dir / "logs").iterdir()}
    assert logs == {"orchestrator.log", "trainer.log", "worker-0.log", "worker-1.log"}

    metrics = read_metrics(run_dir)
    required = {"step", "policy_version", "reward_mean", "loss", "trainer_busy_fraction",
                "rollouts_accepted", "stale_dropped", "staleness_histogram"}
    assert all(required <= record.keys() for record in metrics)
    # Versions advance one per step, and each step trains from the version before.
    assert [m["policy_version"] for m in metrics] == list(range(1, steps + 1))
    assert [m["trainer_version"] for m in metrics] == list(range(steps))
    # The staleness bound holds for every sample the trainer saw.
    for record in metrics:
        assert sum(record["staleness_histogram"].values()) == record["samples"] == 32
        assert all(0 <= int(lag) <= max_staleness for lag in record["staleness_histogram"])
    assert metrics[-1]["rollouts_accepted"] >= steps * 32

    # Every version is verified in the store; the newest loads with plain transformers.
    store = CheckpointStore(str(run_dir / "checkpoints"))
    assert store.latest() == steps
    assert 0 in store.versions()
    for version in store.versions():
        assert store.verify(version) == []
    cache = tmp_path / "pulled"
    first = load_file(Path(store.pull(0, str(cache))) / "model.safetensors")
    last_dir = store.pull(steps, str(cache))
    last = load_file(Path(last_dir) / "model.safetensors")
    model = AutoModelForCausalLM.from_pretrained(last_dir)
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trainable == set(first) == set(last)
    unchanged = [name for name in trainable if torch.equal(first[name], last[name])]
    assert unchanged == [], f"parameters not changed by training: {unchanged}"
    for name, param in model.named_parameters():
        assert torch.equal(param.detach(), last[name])

    assert "done in" in result.stdout
    assert processes_mentioning(str(run_dir)) == []
    # Each role says what it computes on and in (the tiny model's versions are fp32: fp32 everywhere).
    assert "versions in fp32; computing: trainer fp32 x 2 ranks" in result.stdout
    assert "computes in float32 (versions published in float32)" in (run_dir / "logs" / "worker-0.log").read_text()
    assert "computes in fp32 (mixed_precision auto" in (run_dir / "logs" / "trainer.log").read_text()


def wait_for(predicate, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.2)


def start_run(tmp_path: Path, steps: int) -> tuple[subprocess.Popen[str], Path]:
    text = pipeline_config(run_name="it", steps=steps, max_staleness=1, lr=3e-3)
    command, run_dir = decentrl_run_command(tmp_path, text)
    # SIGINT at its default, as from a terminal: a shell's background job (a CI runner's, `cmd &`)
    # starts with SIGINT ignored, and Python keeps it ignored, so Ctrl-C would never arrive.
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    return process, run_dir


def test_run_stops_everything_when_a_role_crashes(tmp_path: Path) -> None:
    process, run_dir = start_run(tmp_path, steps=10_000)
    wait_for(lambda: (run_dir / "metrics.jsonl").is_file(), timeout_s=180)
    workers = [pid for pid in processes_mentioning(str(run_dir)) if b"worker-0" in Path(f"/proc/{pid}/cmdline").read_bytes()]
    assert workers, "worker-0 is not running"
    os.kill(workers[0], signal.SIGKILL)
    output, _ = process.communicate(timeout=120)
    assert process.returncode == 1
    assert "worker-0 exited with code -9; stopping every role" in output
    assert processes_mentioning(str(run_dir)) == []


def test_run_stops_everything_on_ctrl_c(tmp_path: Path) -> None:
    process, run_dir = start_run(tmp_path, steps=10_000)
    wait_for(lambda: (run_dir / "metrics.jsonl").is_file(), timeout_s=180)
    process.send_signal(signal.SIGINT)
    output, _ = process.communicate(timeout=120)
    assert process.returncode == 130
    assert "interrupted: stopping every role" in output
    assert processes_mentioning(str(run_dir)) == []
