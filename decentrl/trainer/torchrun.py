"""torchrun for the trainer's ranks (`decentrl run` starts the trainer with it), stopping cleanly.

torchrun answers SIGTERM by passing it to its ranks, waiting for them, and then raising
SignalException, whose traceback ends the trainer's log (tests/pipeline/test_pipeline_sigterm.py).
Here that stop is one line and the exit status 128 + the signal, as a process killed by it reports.
A rank that failed (its own log lines say why, above) ends torchrun with ChildFailedError, whose
traceback and table would follow: here it is one line per failed rank and exit status 1. Every other
argument and outcome is torchrun's own (`python -m decentrl.trainer.torchrun` takes
`python -m torch.distributed.run`'s arguments).
"""

from __future__ import annotations

import sys


def main(argv: list[str]) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

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
    sys.exit(main(sys.argv[1:]))
