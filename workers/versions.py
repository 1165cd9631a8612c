"""How a worker learns of new versions: one GET /v1/version long-poll outstanding at a time.

The worker's `versions` thread runs `watch_versions` (workers/worker.py) and its swapper pulls what
it hears of; benchmarks/announce_latency.py runs the same loop to time the trainer's announcement
to the worker's notification. The orchestrator answers a waiting long-poll as soon as a newer
version is announced, so a worker hears of it half a round trip after the announcement is
committed, instead of up to a poll period later, and an idle worker costs one request per wait
instead of one per period. Lease answers carry the newest version too; `known()` includes them,
so a version heard there is not asked for again.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from decentrl.api.client import InvalidAnswer, OrchestratorClient, OrchestratorError

log = logging.getLogger("decentrl.worker")

# What an orchestrator without GET /v1/version (older than the route) answers it: 405 (POST
# /v1/version exists), or 404.
NO_ROUTE = (404, 405)


def watch_versions(
    client: OrchestratorClient, *, known: Callable[[], int | None], heard: Callable[[int | None], None],
    stop: threading.Event, wait_s: float, retry_s: float, long_poll: bool = True,
) -> None:
    """Until `stop` is set: ask for a version newer than `known()`, waiting up to `wait_s`, and hand
    every answer to `heard` (a version not newer than known, when the wait ran out: `heard` ignores it).

    An orchestrator unreachable for the client's `max_wait_s`, or an answer that is not the route's
    model, is logged and asked again `retry_s` later; any other error ends the watch (a revoked
    token: the worker stops). Against an
    orchestrator without the route (or with `long_poll` False, as before the route existed) it
    polls GET /v1/info every `retry_s` instead. `stop` is seen between answers: a long-poll in
    flight ends within `wait_s`."""
    while not stop.is_set():
        try:
            if long_poll:
                version = client.newer_version(known(), wait_s).policy_version
            else:
                version = client.info().policy_version
        except (ConnectionError, InvalidAnswer) as exc:
            log.warning("asking for new versions failed (%s); asking again in %.1fs", exc, retry_s)
            stop.wait(retry_s)
            continue
        except OrchestratorError as exc:
            if not long_poll or exc.status not in NO_ROUTE:
                raise
            log.warning("the orchestrator has no GET /v1/version (%s): polling /v1/info every %.1fs", exc.message, retry_s)
            long_poll = False
            continue
        heard(version)
        if not long_poll:
            stop.wait(retry_s)
