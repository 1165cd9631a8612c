"""Background publishing of new versions, so the next optimizer step never waits on uploads.

Rank 0 of the trainer hands each new full state dict to `Publisher.submit`; a thread writes an
HF-loadable directory (sharded safetensors, decentrl/store/weights.py `write_hf_dir`), publishes it to
the store (files in parallel, manifest last), tells the orchestrator, and applies retention. In
LoRA runs (`lora` given) the state dict holds only the adapter and the directory is a peft
adapter on version 0 (decentrl/trainer/lora.py).

Policy when uploads fall behind: the queue is one slot. `submit` never blocks; if a version is
still waiting when a newer one arrives, the newer one replaces it and the older one is never
published (its number is recorded in `skipped`). At most one version is uploading and one
waiting, so memory stays at two state dicts however slow the store is, and workers skip straight
to the newest weights - a skipped version would only have been stale on arrival.

When the store fails (unreachable, 503 SlowDown, a cut upload), the upload is tried again with a
jittered back-off for `retry_s`; only then does the failure reach the training loop. A retry is
safe: files are uploaded again whole (a local store links new files, never writing into old ones),
the manifest goes last, and a manifest already there listing these very files is the earlier
attempt's (CheckpointStore.publish returns it). Retention failing is logged and tried again after
the next version: it never stops training.

The files being published are written under `scratch_dir` (the trainer's is `<run_dir>/trainer/scratch`,
emptied at its start by `clear_scratch`: a trainer killed with SIGKILL leaves its temporary
directories behind, a model's size each), or the system's temporary directory when none is given.
"""

from __future__ import annotations

import itertools
import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable
from typing import TypeVar

import torch
from transformers import PretrainedConfig

from decentrl.config import LoRAConfig
from decentrl.store.cache import remove_path
from decentrl.store.checkpoints import CheckpointStore
from decentrl.store.manifest import StoreError
from decentrl.store.ranges import backoff, read_errors
from decentrl.store.weights import DEFAULT_SHARD_BYTES, write_hf_dir
from decentrl.trainer.lora import BASE_VERSION, write_adapter_dir

log = logging.getLogger("decentrl.trainer.publisher")

T = TypeVar("T")


def clear_scratch(directory: str) -> str:
    """`directory`, emptied of what an earlier trainer of this run dir left there, and made if absent.
    Rank 0 at start: only it publishes, and a trainer of another policy has a state dir of its own."""
    remove_path(directory)  # a symlink there is removed, never its target
    os.makedirs(directory)
    return directory


class Publisher:
    def __init__(
        self,
        *,
        store: CheckpointStore,
        model_config: PretrainedConfig,
        extras_from: str,
        keep_last: int,
        on_published: Callable[[int], None],
        max_shard_bytes: int = DEFAULT_SHARD_BYTES,
        lora: LoRAConfig | None = None,
        dtype: torch.dtype | None = None,
        full_every: int = 1,
        retry_s: float = 900.0,
        scratch_dir: str | None = None,
    ) -> None:
        self.store = store
        self.scratch_dir = scratch_dir  # None: the system's temporary directory
        self.lora = lora
        self.dtype = dtype  # of the published weights (store.publish_dtype); the trainer's stay float32
        self.full_every = full_every  # store.full_every: a key version after full_every - 1 deltas
        self.retry_s = retry_s  # store.publish_retry_s
        self.retries = 0  # store failures ridden out, over all versions
        # The last full-model version published and its local files: the next one's delta base.
        self._previous: tuple[int, tempfile.TemporaryDirectory[str]] | None = None
        self._deltas_in_row = 0
        self.max_shard_bytes = max_shard_bytes
        self.model_config = model_config
        self.extras_from = extras_from
        self.keep_last = keep_last
        self.on_published = on_published
        self._pending: tuple[int, dict[str, torch.Tensor]] | None = None
        self._busy = False
        self._closed = False
        self._error: BaseException | None = None
        self._cond = threading.Condition()
        self.skipped: list[int] = []
        self.publish_seconds: list[float] = []  # each version's publish, its retention after included
        self.announce_seconds: list[float] = []  # ... until it was announced (workers could pull it)
        self._thread = threading.Thread(target=self._run, name="publisher", daemon=True)
        self._thread.start()

    def submit(self, version: int, state: dict[str, torch.Tensor]) -> None:
        """Queue `version` for publishing; returns at once. Raises a failure of an earlier publish."""
        with self._cond:
            self._raise_if_failed()
            if self._pending is not None:
                self.skipped.append(self._pending[0])
            self._pending = (version, state)
            self._cond.notify_all()

    def wait_idle(self, timeout_s: float | None = None) -> bool:
        """Block until everything submitted is published (used at the end of training), at most
        `timeout_s`: whether it is."""
        with self._cond:
            idle = self._cond.wait_for(lambda: (self._pending is None and not self._busy) or self._error is not None, timeout_s)
            self._raise_if_failed()
            return idle

    def close(self) -> None:
        self.wait_idle()
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join()
        if self._previous is not None:
            self._previous[1].cleanup()

    def check(self) -> None:
        """Raise the error that stopped a publish, if one did (the training loop asks while it waits)."""
        self._raise_if_failed()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"publishing a checkpoint failed: {self._error}") from self._error

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._pending is None and not self._closed:
                    self._cond.wait()
                if self._pending is None:
                    return
                version, state = self._pending
                self._pending, self._busy = None, True
            try:
                self._publish(version, state)
            except BaseException as exc:  # surfaced to the training loop on its next submit
                log.exception("publishing version %d failed", version)
                with self._cond:
                    self._error = exc
            with self._cond:
                self._busy = False
                self._cond.notify_all()

    def _publish(self, version: int, state: dict[str, torch.Tensor]) -> None:
        started = time.perf_counter()
        parent = version - 1 if version > 0 else None
        if self.lora is None:
            self._publish_full(version, state, parent)
        else:
            with tempfile.TemporaryDirectory(prefix=f"decentrl-v{version}-", dir=self.scratch_dir) as directory:
                write_adapter_dir(directory, state, self.lora)
                self._retrying(version, lambda: self.store.publish(
                    version, directory, parent=parent, base_version=BASE_VERSION, hand_over=True, scratch_dir=self.scratch_dir
                ))
        self.on_published(version)
        self.announce_seconds.append(time.perf_counter() - started)
        try:
            self.store.retain(self.keep_last, protect={0})
        except (StoreError, *read_errors()) as exc:
            log.warning("retention after version %d failed (%s); it runs again after the next version", version, exc)
        self.publish_seconds.append(time.perf_counter() - started)
        log.info(
            "published version %d in %.2fs (announced after %.2fs, then retention)",
            version, self.publish_seconds[-1], self.announce_seconds[-1],
        )

    def _publish_full(self, version: int, state: dict[str, torch.Tensor], parent: int | None) -> None:
        """A full-model version: a delta against the last one published (kept on local disk for
        that), or a key version every `full_every` versions, stored whole and as deltas too (a
        worker holding the last version fetches its deltas, a late joiner its whole files); the
        store makes it a key version alone when the last one is no longer in the store."""
        directory = tempfile.TemporaryDirectory(prefix=f"decentrl-v{version}-", dir=self.scratch_dir)
        try:
            write_hf_dir(directory.name, state, self.model_config, self.extras_from, self.max_shard_bytes, dtype=self.dtype)
            delta_from = None if self._previous is None or self.full_every == 1 else (self._previous[0], self._previous[1].name)
            key = self._deltas_in_row + 1 >= self.full_every
            manifest = self._retrying(version, lambda: self.store.publish(
                version, directory.name, parent=parent, hand_over=True, delta_from=delta_from, whole=key,
                scratch_dir=self.scratch_dir,
            ))
        except BaseException:
            directory.cleanup()
            raise
        self._deltas_in_row = 0 if manifest.delta_base is None or manifest.whole else self._deltas_in_row + 1
        if self._previous is not None:
            self._previous[1].cleanup()
        self._previous = (version, directory)

    def _retrying(self, version: int, upload: Callable[[], T]) -> T:
        """`upload()`, tried again while the store fails, for at most `retry_s`; one line a failure."""
        started = time.monotonic()
        for failures in itertools.count(1):
            try:
                return upload()
            except read_errors() as exc:
                waited = time.monotonic() - started
                if waited >= self.retry_s:
                    raise StoreError(
                        f"the store failed every upload of version {version} for {waited:.0f} s "
                        f"(store.publish_retry_s = {self.retry_s:g}), the last with {exc!r}; check the store is reachable"
                    ) from exc
                delay = min(backoff(failures), self.retry_s - waited)
                self.retries += 1
                log.warning("publishing version %d: the store failed (%r); trying again in %.1f s", version, exc, delay)
                time.sleep(delay)
        raise AssertionError("unreachable")
