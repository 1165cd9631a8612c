"""decentrl/exit.py: a role's process ends as the interpreter would end it, less the teardown of
its modules - its status kept, its output flushed, its threads joined and its atexit handlers run;
and what `decentrl run` says went wrong reaches stderr."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest


def run(code: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    script = textwrap.dedent(f"""
        import atexit, sys, threading, time
        from pathlib import Path
        from decentrl.exit import exit_now
        out = Path({str(tmp_path)!r})
        def late():  # a non-daemon thread still working when the main thread exits
            time.sleep(0.3)
            (out / "thread").write_text("joined")
        threading.Thread(target=late).start()
        atexit.register(lambda: (out / "atexit").write_text("ran"))
        sys.stdout.write("unflushed")  # no newline: still in the pipe's buffer
    """) + code
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize(("code", "status"), [(None, 0), (0, 0), (3, 3)])
def test_the_status_output_threads_and_atexit_handlers_are_kept(tmp_path: Path, code: int | None, status: int) -> None:
    done = run(f"exit_now({code!r})", tmp_path)
    assert done.returncode == status, done.stderr
    assert done.stdout == "unflushed"
    assert (tmp_path / "thread").read_text() == "joined"
    assert (tmp_path / "atexit").read_text() == "ran"


def test_a_message_goes_to_stderr_with_status_1(tmp_path: Path) -> None:
    done = run("exit_now('error: the config names no model')", tmp_path)
    assert done.returncode == 1 and done.stderr.strip() == "error: the config names no model"
    assert done.stdout == "unflushed" and (tmp_path / "atexit").exists()


def test_the_cli_exits_with_its_commands_status(tmp_path: Path) -> None:
    """`python -m decentrl` (every role): a command's error status and message come through."""
    done = subprocess.run([sys.executable, "-m", "decentrl", "run", str(tmp_path / "missing.toml")],
                          capture_output=True, text=True, timeout=120, cwd=Path(__file__).parents[2])
    assert done.returncode == 2 and "no such config file" in done.stderr + done.stdout


def test_the_launchers_errors_go_to_stderr(tmp_path: Path) -> None:
    """`decentrl run` says what went wrong on stderr, where a benchmark that keeps only stdout's
    progress lines (or discards them) still finds it."""
    (tmp_path / "metrics.jsonl").write_text("")
    repo = Path(__file__).parents[2]
    done = subprocess.run([sys.executable, "-m", "decentrl", "run", "configs/local.toml", "--run-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=120, cwd=repo)
    assert done.returncode == 2 and done.stdout == ""
    assert "already holds a run; pass another --run-dir" in done.stderr
