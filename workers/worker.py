"""The worker loop: lease prompts, make sure the newest version is loaded, generate, post.

Called by `decentrl worker`. The worker only needs the orchestrator URL and a token: the run
name, group size, store URL and sampling come from the orchestrator.

`concurrency` slots each run lease -> generate -> post; a lock makes generation and weight swaps
exclusive, so a swap waits for the generation in flight and every sample of a group comes
from one version. With a simulated latency (workers/latency.py) the slots overlap their
delays the way concurrent requests overlap on an inference server.
"""

from __future__ import annotations

import logging
import os
import random
import signal
import threading
import time
import uuid
from dataclasses import dataclass

from decentrl.client import OrchestratorClient
from decentrl.signing import load_public_key
from decentrl.store import CheckpointStore
from decentrl.wire import Lease, LeaseRequest, Rollout, RolloutBatch, RunInfo, SamplingParams
from workers.backends import Backend, Completion
from workers.latency import LatencyModel

log = logging.getLogger("decentrl.worker")


@dataclass(frozen=True)
class WorkerOptions:
    worker_id: str
    cache_dir: str
    groups_per_request: int
    store_url: str | None = None  # overrides the URL the orchestrator announces
    storage_options: dict[str, object] | None = None
    public_key: str | None = None  # ed25519 public key file: refuse versions not signed by the trainer
    cache_max_bytes: int | None = None  # evict the oldest pulled versions beyond this
    concurrency: int = 1  # slots with a lease in flight at once
    latency: LatencyModel = LatencyModel()
    seed: int = 0


class Worker:
    def __init__(self, *, options: WorkerOptions, client: OrchestratorClient, backend: Backend) -> None:
        self.options = options
        self.client = client
        self.backend = backend
        self.info: RunInfo = client.info()
        self.store = CheckpointStore(
            options.store_url or self.info.store_url,
            options.storage_options,
            public_key=load_public_key(options.public_key) if options.public_key else None,
            cache_max_bytes=options.cache_max_bytes,
        )
        self.stopping = False
        self.rollouts_posted = 0
        self._lock = threading.Lock()  # generation and weight swaps never overlap
        self._stats_lock = threading.Lock()

    def request_stop(self, *_: object) -> None:
        """SIGTERM/SIGINT: every slot finishes the generation in flight, posts it, then exits."""
        self.stopping = True

    def run(self, max_iterations: int | None = None) -> None:
        signal.signal(signal.SIGTERM, self.request_stop)
        slots = [
            threading.Thread(target=self._slot, args=(i, max_iterations), name=f"slot-{i}", daemon=True)
            for i in range(self.options.concurrency)
        ]
        for slot in slots:
            slot.start()
        while any(slot.is_alive() for slot in slots):
            for slot in slots:
                slot.join(timeout=0.5)  # short joins keep the main thread responsive to signals
        log.info("worker %s stopping after %d rollouts", self.options.worker_id, self.rollouts_posted)

    def _slot(self, index: int, max_iterations: int | None) -> None:
        rng = random.Random(f"{self.options.seed}/{self.options.worker_id}/{index}")
        iterations = 0
        while not self.stopping and (max_iterations is None or iterations < max_iterations):
            iterations += 1
            response = self.client.lease(
                LeaseRequest(worker_id=self.options.worker_id, max_groups=self.options.groups_per_request)
            )
            with self._lock:
                if response.policy_version is not None and response.policy_version != self.backend.version:
                    self._swap(response.policy_version)
                if not response.leases:
                    version = None
                else:
                    started = time.perf_counter()
                    prompts = [lease.prompt_token_ids for lease in response.leases for _ in range(lease.group_size)]
                    completions = self.backend.generate(prompts, response.sampling)
                    version, generation_s = self.backend.version, time.perf_counter() - started
            if version is None:
                time.sleep(response.retry_after_s)
                continue
            time.sleep(self.options.latency.extra_delay(rng, generation_s))
            self._post(response.leases, completions, version, response.sampling)

    def _swap(self, version: int) -> None:
        started = time.perf_counter()
        path = self.store.pull(version, self.options.cache_dir)
        self.backend.load(path, version)
        log.info("loaded version %d in %.2fs", version, time.perf_counter() - started)

    def _post(self, leases: list[Lease], completions: list[Completion], version: int, sampling: SamplingParams) -> None:
        owners = [lease for lease in leases for _ in range(lease.group_size)]
        rollouts = [
            Rollout(
                rollout_id=uuid.uuid4().hex,
                run_name=self.info.run_name,
                lease_id=lease.lease_id,
                prompt_id=lease.prompt_id,
                worker_id=self.options.worker_id,
                policy_version=version,
                prompt_token_ids=lease.prompt_token_ids,
                completion_token_ids=completion.token_ids,
                logprobs=completion.logprobs,
                finish_reason=completion.finish_reason,
                sampling=sampling,
            )
            for lease, completion in zip(owners, completions, strict=True)
        ]
        result = self.client.post_rollouts(RolloutBatch(rollouts=rollouts))
        with self._stats_lock:
            self.rollouts_posted += result.accepted
        if result.rejected:
            reasons: dict[str, int] = {}
            for rejection in result.rejected:
                reasons[rejection.reason] = reasons.get(rejection.reason, 0) + 1
            log.info("orchestrator rejected %d rollouts: %s", len(result.rejected), reasons)


def default_worker_id() -> str:
    return f"{os.uname().nodename}-{os.getpid()}"
