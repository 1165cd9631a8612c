"""Recovery time of the orchestrator: from kill -9 to serving again, by journal size.

    .venv/bin/python benchmarks/recovery.py                      # 10k, 100k and 1M rollouts
    .venv/bin/python benchmarks/recovery.py --sizes 10000        # one size

For each size N, a run directory's journal is filled with N acknowledged rollouts through the
orchestrator's own code, in this process: RunState grants leases, ingests complete groups of
16 samples (checked, scored, journaled exactly as POST /v1/rollouts does, without HTTP) and a
trainer-like loop takes batches, so the journal holds what a long run leaves: every rollout id
within the dedupe window (`dedupe_window_s` is a day here, so all N are remembered for
idempotent resends), served leases, a full buffer and open leases. Then the real service runs
on it (`python -m decentrl orchestrator CONFIG --run-dir DIR`), is killed with SIGKILL once it
serves, and is started again at once: `recovery_s` is the time from the kill to the first 200
of an authenticated GET /v1/status (the recovered state answering). Also reported, per size:
`startup_s` (a fresh process to serving with an empty journal: interpreter and imports),
`recovery_cpu_s` (the CPU time the recovering process spent until it served: on a shared
machine the wall time is this stretched by the load, so compare this one across loads),
`state_load_s` (in this process: Journal.load plus RunState's rebuild, the part that grows with
N) and the journal's size on disk.

The service runs with bytecode caching on (PYTHONDONTWRITEBYTECODE is dropped from its
environment), as an installed orchestrator does: the first start compiles the project's
modules into __pycache__, later starts load them.

The last line of stdout is one JSON object: recovery_s_10k, recovery_s_100k, recovery_s_1m
(for the sizes run), and the breakdown. Figures and the date they were taken: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

GROUP = 16  # 1M rollouts in 62.5k groups: fewer than the task's 100k prompts (each is leased once)
CONFIG = f"""
run_name = "recovery"
max_staleness = 1024
group_size = {GROUP}
trainer_ranks = 1
[model]
type = "tiny"
hidden_size = 32
num_layers = 1
num_heads = 2
intermediate_size = 64
[task]
type = "sorting"
num_digits = 4
num_prompts = 100000
[sampling]
temperature = 1.0
max_tokens = 8
[orchestrator]
lease_timeout_s = 86400.0
dedupe_window_s = 86400.0
max_buffer_groups = 4096
journal_sync = "normal"
[trainer]
groups_per_step = 64
"""
LABELS = {10_000: "10k", 100_000: "100k", 1_000_000: "1m"}


def fill(run_dir: Path, rollouts: int) -> float:
    """Write `rollouts` acknowledged rollouts into RUN_DIR/journal.sqlite; returns seconds taken."""
    from decentrl.api.wire import Rollout
    from decentrl.config import load_config
    from decentrl.model.build import load_tokenizer
    from decentrl.tasks import build_task
    from orchestrator.journal import Journal
    from orchestrator.state import RunState

    config = load_config(str(run_dir / "run.toml"))
    journal = Journal(str(run_dir / "journal.sqlite"), run_name=config.run_name, sync="normal")
    state = RunState(config=config, task=build_task(config.task), tokenizer=load_tokenizer(config.model), journal=journal)
    state.announce(0)
    ids = state.tokenizer.encode("1234")[1:] + [state.tokenizer.eos_token_id]  # a sorted answer (after <s>), its end
    started, holder, done = time.perf_counter(), "bench/w0", 0
    while done < rollouts:
        leases = state.grant_leases(holder, 64)
        if not leases and not state.ready:
            raise RuntimeError(f"no lease granted after {done} rollouts: the task's prompts ran out")
        for lease in leases:
            batch = [
                Rollout.model_construct(
                    rollout_id=f"{lease.lease_id}-{i}", run_name=config.run_name, lease_id=lease.lease_id,
                    prompt_id=lease.prompt_id, worker_id="w0", policy_version=0, token_versions=None,
                    prompt_token_ids=lease.prompt_token_ids, completion_token_ids=ids, logprobs=[-0.5] * len(ids),
                    finish_reason="stop", sampling=state.sampling, sampling_mask=None, expert_routing=None,
                    claimed_reward=None, loss_mask=None,
                )
                for i in range(GROUP if done + GROUP <= rollouts else rollouts - done)
            ]
            done += state.ingest(batch, holder).accepted
            if done >= rollouts:
                break
        while len(state.ready) >= 3000:  # the trainer: keeps the buffer below its bound
            state.take_batch(0)
        journal.flush()
    journal.flush()
    journal.close()
    return time.perf_counter() - started


def start(run_dir: Path, port: int) -> subprocess.Popen[bytes]:
    log = open(run_dir / "orchestrator.log", "ab")
    env = {key: value for key, value in os.environ.items() if key != "PYTHONDONTWRITEBYTECODE"}
    return subprocess.Popen(
        [sys.executable, "-m", "decentrl", "orchestrator", str(run_dir / "run.toml"), "--run-dir", str(run_dir),
         "--port", str(port)],
        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        env={**env, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"},
    )


def cpu_s(pid: int) -> float:
    """User plus system CPU seconds a live process has used (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def until_serving(port: int, token: str, process: subprocess.Popen[bytes], timeout_s: float = 600) -> float:
    """Poll GET /v1/status every 5 ms; the monotonic time of its first 200."""
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/status", headers={"Authorization": f"Bearer {token}"})
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(request, timeout=5) as response:
                if response.status == 200:
                    return time.monotonic()
        except OSError:
            pass
        if process.poll() is not None:
            raise RuntimeError(f"the orchestrator exited with {process.returncode}")
        time.sleep(0.005)
    raise TimeoutError("the orchestrator did not serve in time")


def measure(rollouts: int, work: Path) -> dict[str, float]:
    from decentrl.cli.launch import free_port
    from orchestrator.auth import add_token

    run_dir = work / f"run-{rollouts}"
    run_dir.mkdir()
    (run_dir / "run.toml").write_text(CONFIG)
    token = add_token(str(run_dir / "tokens.json"), name="trainer", role="trainer")
    fill_s = fill(run_dir, rollouts)
    figures = {"fill_s": round(fill_s, 1), "journal_mb": round(sum(
        f.stat().st_size for f in run_dir.glob("journal.sqlite*")) / 2**20, 1)}

    # The part that grows with N, alone: read the journal and rebuild the state in this process.
    from decentrl.config import load_config
    from decentrl.model.build import load_tokenizer
    from decentrl.tasks import build_task
    from orchestrator.journal import Journal
    from orchestrator.state import RunState

    config = load_config(str(run_dir / "run.toml"))
    tokenizer, task = load_tokenizer(config.model), build_task(config.task)
    started = time.perf_counter()
    journal = Journal(str(run_dir / "journal.sqlite"), run_name=config.run_name, sync="normal")
    state = RunState(config=config, task=task, tokenizer=tokenizer, journal=journal)
    figures["state_load_s"] = round(time.perf_counter() - started, 3)
    assert state.rollouts_accepted == rollouts, (state.rollouts_accepted, rollouts)
    journal.close()

    port = free_port()
    process = start(run_dir, port)
    until_serving(port, token, process)
    killed_at = time.monotonic()
    process.send_signal(signal.SIGKILL)
    process.wait()
    process = start(run_dir, port)
    try:
        figures["recovery_s"] = round(until_serving(port, token, process) - killed_at, 3)
        figures["recovery_cpu_s"] = round(cpu_s(process.pid), 2)
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait()
    return figures


def startup_s(work: Path) -> float:
    """A fresh `decentrl orchestrator` on an empty run dir: from the exec to the first 200."""
    from decentrl.cli.launch import free_port
    from orchestrator.auth import add_token

    run_dir = work / "empty"
    run_dir.mkdir()
    (run_dir / "run.toml").write_text(CONFIG)
    token = add_token(str(run_dir / "tokens.json"), name="trainer", role="trainer")
    port = free_port()
    started = time.monotonic()
    process = start(run_dir, port)
    try:
        return round(until_serving(port, token, process) - started, 3)
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="10000,100000,1000000", help="Acknowledged rollouts per journal.")
    args = parser.parse_args()
    result: dict[str, object] = {}
    with tempfile.TemporaryDirectory(prefix="decentrl-recovery-") as tmp:
        work = Path(tmp)
        result["startup_s"] = startup_s(work)
        for size in (int(s) for s in args.sizes.split(",")):
            figures = measure(size, work)
            label = LABELS.get(size, str(size))
            result[f"recovery_s_{label}"] = figures.pop("recovery_s")
            result[f"detail_{label}"] = figures
            print(json.dumps({label: figures, "recovery_s": result[f"recovery_s_{label}"]}), flush=True)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
