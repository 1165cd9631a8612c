"""torchrun for the trainer's ranks (`decentrl run` starts the trainer with it), stopping cleanly.

torchrun answers SIGTERM by passing it to its ranks, waiting for them, and then raising
SignalException, whose traceback ends the trainer's log (tests/pipeline/test_pipeline_sigterm.py).
Here that stop is one line and the exit status 128 + the signal, as a process killed by it reports.
A rank that failed (its own log lines say why, above) ends torchrun with ChildFailedError, whose
traceback and table would follow: here it is one line per failed rank and exit status 1. Every other
argument and outcome is torchrun's own (`python -m decentrl.trainer.torchrun` takes
`python -m torch.distributed.run`'s arguments).

One outcome is not: torchrun's agent on a node that lost the rendezvous host (the other node's, cut
off) sits in its store calls, 60 s at a time, and never looks at its rank that stopped (issue 46,
F8: still up 210 s after its rank had said why). A rank it leaves unreaped for
`UNREAPED_GRACE_S` after an error is the sign: `watch_ranks` then ends this node (its other ranks
told to stop), exit status 1, in one line.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator

UNREAPED_GRACE_S = 15.0  # torchrun's agent notices a failed rank within its monitor interval (0.1-5 s)


def failed_children(parent: int) -> Iterator[tuple[int, int]]:
    """(pid, exit status) of each child of `parent` that exited with an error and is not reaped
    yet (a zombie: Linux keeps its status in /proc/PID/stat, field 52, as waitpid reports it)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()  # fields[0] is field 3 (state)
        except OSError:
            continue
        if fields[0] == "Z" and int(fields[1]) == parent and len(fields) > 49 and (status := int(fields[49])):
            yield int(entry), os.waitstatus_to_exitcode(status)


def watch_ranks(grace_s: float = UNREAPED_GRACE_S, poll_s: float = 1.0) -> None:
    """A daemon thread's loop: ends this process when a rank stays unreaped `grace_s` after it
    failed (torchrun's agent is stuck), after telling its other ranks to stop."""
    me, seen = os.getpid(), {}
    while True:
        now = time.monotonic()
        for pid, code in failed_children(me):
            if now - seen.setdefault(pid, now) >= grace_s:
                print(f"trainer: rank process {pid} exited with code {code} {grace_s:.0f} s ago and torchrun's agent "
                      "has not ended (its rendezvous host is unreachable); stopping this node", file=sys.stderr, flush=True)
                for child in _children(me):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(child, signal.SIGTERM)
                os._exit(1)
        time.sleep(poll_s)


def _children(parent: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    if int(stat.read().rsplit(")", 1)[1].split()[1]) == parent:
                        found.append(int(entry))
            except OSError:
                continue
    return found


def main(argv: list[str]) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    if sys.platform == "linux":
        threading.Thread(target=watch_ranks, name="watch-ranks", daemon=True).start()
    try:
        torchrun(argv)
    except SignalException as exc:
        print(f"trainer: stopped by {exc.sigval.name}; its ranks were told to stop first", file=sys.stderr, flush=True)
        return 128 + int(exc.sigval)
    except ChildFailedError as exc:
        for rank, failure in sorted(exc.failures.items()):
            print(f"trainer: rank {rank} exited with code {failure.exitcode}; its log above says why", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    from decentrl.exit import exit_now

    exit_now(main(sys.argv[1:]))
