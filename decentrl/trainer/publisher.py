"""Background publishing of new versions, so the next optimizer step never waits on uploads.

Rank 0 of the trainer hands each new full state dict to `Publisher.submit`; a thread writes an
HF-loadable directory (sharded safetensors), publishes it to the store (files in parallel,
manifest last), tells the orchestrator, and applies retention. In LoRA runs (`lora` given) the
state dict holds only the adapter and the directory is a peft adapter on version 0
(decentrl/trainer/lora.py).

Policy when uploads fall behind: the queue is one slot. `submit` never blocks; if a version is
still waiting when a newer one arrives, the newer one replaces it and the older one is never
published (its number is recorded in `skipped`). At most one version is uploading and one
waiting, so memory stays at two state dicts however slow the store is, and workers skip straight
to the newest weights - a skipped version would only have been stale on arrival.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch
from huggingface_hub import split_torch_state_dict_into_shards
from safetensors.torch import save_file
from transformers import PretrainedConfig

from decentrl.config import LoRAConfig, StoreConfig
from decentrl.store import CheckpointStore
from decentrl.trainer.lora import BASE_VERSION, write_adapter_dir

log = logging.getLogger("decentrl.trainer.publisher")

TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json", "chat_template.jinja"
)
DEFAULT_SHARD_BYTES = StoreConfig.model_fields["shard_size_mb"].default * 2**20
INDEX_NAME = "model.safetensors.index.json"  # transformers' SAFE_WEIGHTS_INDEX_NAME


def write_hf_dir(
    directory: str,
    state: dict[str, torch.Tensor],
    model_config: PretrainedConfig,
    extras_from: str,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> None:
    """An HF-loadable checkpoint: config.json, tokenizer files copied from `extras_from`, and the
    weights as `model.safetensors` when they fit one shard, else `model-00001-of-0000N.safetensors`
    ... plus `model.safetensors.index.json`, the layout `from_pretrained` reads."""
    model_config.save_pretrained(directory)
    split = split_torch_state_dict_into_shards(state, max_shard_size=max_shard_bytes)
    for filename, names in split.filename_to_tensors.items():
        shard = {name: state[name].contiguous() for name in names}
        save_file(shard, os.path.join(directory, filename), metadata={"format": "pt"})
    if split.is_sharded:
        index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
        Path(directory, INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True))
    for name in TOKENIZER_FILES:
        source = Path(extras_from) / name
        if source.is_file() and source.resolve() != (Path(directory) / name).resolve():
            shutil.copy(source, Path(directory) / name)


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
    ) -> None:
        self.store = store
        self.lora = lora
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
        self.publish_seconds: list[float] = []
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

    def wait_idle(self) -> None:
        """Block until everything submitted is published (used at the end of training)."""
        with self._cond:
            while (self._pending is not None or self._busy) and self._error is None:
                self._cond.wait()
            self._raise_if_failed()

    def close(self) -> None:
        self.wait_idle()
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join()

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
        with tempfile.TemporaryDirectory(prefix=f"decentrl-v{version}-") as directory:
            parent = version - 1 if version > 0 else None
            if self.lora is None:
                write_hf_dir(directory, state, self.model_config, self.extras_from, self.max_shard_bytes)
                self.store.publish(version, directory, parent=parent, hand_over=True)
            else:
                write_adapter_dir(directory, state, self.lora)
                self.store.publish(version, directory, parent=parent, base_version=BASE_VERSION, hand_over=True)
        self.on_published(version)
        self.store.retain(self.keep_last, protect={0})
        self.publish_seconds.append(time.perf_counter() - started)
        log.info("published version %d in %.2fs", version, self.publish_seconds[-1])
