"""A worker process whose backend never finishes a generation (no torch, so it starts in a second
or two): tests/workers/test_worker_renewal.py starts it, waits until it has renewed its lease, and
kills it with SIGKILL.

    python -m tests.workers.hanging_worker URL TOKEN CACHE_DIR
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

from decentrl.api.client import OrchestratorClient
from decentrl.api.wire import SamplingParams
from decentrl.config import WorkerConfig
from workers.backends import Completion, never
from workers.worker import Worker


class Hanging:
    """Loads any version; a generation never ends."""

    version: int | None = None
    records_routes = False
    plays_trees = False
    compute_dtype: str | None = None

    def load(self, checkpoint_dir: str, version: int) -> None:
        self.version = version

    def generate(
        self, prompts: list[list[int]], sampling: SamplingParams, should_stop: Callable[[], bool] = never
    ) -> list[Completion]:
        time.sleep(3600)
        raise AssertionError("killed long before")


if __name__ == "__main__":
    url, token, cache_dir = sys.argv[1:4]
    Worker(
        WorkerConfig(groups_per_request=1), worker_id="doomed", cache_dir=cache_dir,
        client=OrchestratorClient(url, token, max_wait_s=1.0), backend=Hanging(),
    ).run()
