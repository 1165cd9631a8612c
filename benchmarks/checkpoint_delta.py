"""Delta versions on a model of realistic shape: bytes per version, publish, apply+verify, and a
100 Mbit/s link. Called by benchmarks/checkpoint_io.py (whose last stdout line holds these keys
too); run alone for just these figures:

    .venv/bin/python benchmarks/checkpoint_delta.py [--steps 3] [--link-mbit 100]

A Qwen2-shaped model (hidden 768, 12 layers, intermediate 3072, vocabulary 32000: 162M
parameters) is trained for real with AdamW on random tokens, float32 master weights, each
version published in bf16 (store.publish_dtype) as the trainer's publisher does: version 0 a key,
each later one a delta against the one before. Once at lr 1e-6, once at 1e-5 (RL learning rates).

  delta_ratio_lr*            stored delta bytes / full bf16 bytes, mean over the delta versions
  delta_publish_s, key_publish_s   CheckpointStore.publish of a delta version (XOR + zstd +
                             BLAKE3 of the full files) and of a key version, file:// store
  delta_apply_verify_s       a worker holding N-1 pulls N from file:// (copying): download the
                             delta, rebuild, BLAKE3 against the manifest, rename into the cache
  link_full_pull_s, link_delta_pull_s   pulls from the moto S3 server through a link shaped in
                             the client to --link-mbit (a token bucket on every read of the
                             store's filesystem, shared by the parallel downloads): a full
                             version into an empty cache vs. the delta version by a worker
                             holding the one before
  link_new_version_time_ratio_lr*    link_delta_pull_s / link_full_pull_s at that learning rate;
                             link_new_version_time_ratio: the lr 1e-5 one (the larger deltas)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from typing import Any

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from decentrl.store.checkpoints import CheckpointStore
from decentrl.store.weights import write_hf_dir

MB = 1e6


def start_moto() -> tuple[subprocess.Popen[bytes], str]:
    """moto's S3 server in its own process, so it does not share the benchmark's GIL (nor would S3)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=1)
            return server, endpoint
        except OSError:
            if time.monotonic() > deadline or server.poll() is not None:
                server.kill()
                raise RuntimeError("moto server did not start") from None
            time.sleep(0.2)


class Link:
    """A token bucket of `mbit` Mbit/s shared by every read through it: one home link."""

    def __init__(self, mbit: float) -> None:
        self.rate = mbit * 1e6 / 8
        self.lock = threading.Lock()
        self.free_at = time.monotonic()

    def take(self, n: int) -> None:
        with self.lock:
            start = max(self.free_at, time.monotonic())
            self.free_at = start + n / self.rate
            wait = self.free_at - time.monotonic()
        if wait > 0:
            time.sleep(wait)


class Throttled:
    """A file of the store's filesystem whose reads pass through `link`."""

    def __init__(self, inner: Any, link: Link) -> None:
        self.inner, self.link = inner, link

    def readinto(self, buffer: Any) -> int:
        n = self.inner.readinto(buffer)
        self.link.take(n)
        return n

    def read(self, size: int = -1) -> bytes:
        data = self.inner.read(size)
        self.link.take(len(data))
        return data

    def seek(self, *args: Any) -> int:
        return self.inner.seek(*args)

    def __enter__(self) -> Throttled:
        return self

    def __exit__(self, *exc: object) -> None:
        self.inner.close()


def shaped(store: CheckpointStore, mbit: float) -> CheckpointStore:
    """`store` with every file read through one `mbit` link (manifests and listings too)."""
    link, open_file, cat_file = Link(mbit), store.fs.open, store.fs.cat_file

    def throttled_open(path: str, mode: str = "rb", **kwargs: Any) -> Any:
        return Throttled(open_file(path, mode, **kwargs), link)

    def throttled_cat(path: str, *args: Any, **kwargs: Any) -> bytes:
        data = cat_file(path, *args, **kwargs)
        link.take(len(data))
        return data

    store.fs.open, store.fs.cat_file = throttled_open, throttled_cat  # type: ignore[method-assign]
    return store


def build_model() -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=32000, hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
        num_key_value_heads=12, max_position_embeddings=512, tie_word_embeddings=False,
    )
    return Qwen2ForCausalLM(config).float()


def train_versions(lr: float, steps: int, work: str, shard_mb: int) -> list[str]:
    """Directories of versions 0..steps as the publisher writes them (bf16), AdamW at `lr`."""
    model = build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    generator = torch.Generator().manual_seed(1)
    dirs = []
    for version in range(steps + 1):
        if version:
            ids = torch.randint(0, 32000, (2, 32), generator=generator)
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        directory = os.path.join(work, f"lr{lr:g}-v{version}")
        os.makedirs(directory)
        write_hf_dir(directory, model.state_dict(), model.config, directory, shard_mb * 2**20, dtype=torch.bfloat16)
        dirs.append(directory)
    return dirs


def weight_bytes(directory: str) -> int:
    return sum(os.path.getsize(os.path.join(directory, n)) for n in os.listdir(directory) if n.endswith(".safetensors"))


def publish_all(store: CheckpointStore, dirs: list[str]) -> tuple[list[float], list[float]]:
    """Publish dirs as versions 0.. (0 a key, the rest deltas): (seconds per publish, delta ratio per delta version)."""
    seconds, ratios = [], []
    for version, directory in enumerate(dirs):
        started = time.perf_counter()
        manifest = store.publish(version, directory, delta_from=(version - 1, dirs[version - 1]) if version else None)
        seconds.append(time.perf_counter() - started)
        if version:
            stored = sum(e.delta.size for e in manifest.files if e.delta is not None)
            assert stored > 0, "a delta version stores deltas"
            ratios.append(stored / weight_bytes(directory))
    return seconds, ratios


def delta_figures(
    work: str, *, steps: int, link_mbit: float, s3: tuple[str, dict[str, object]] | None, shard_mb: int = 128
) -> dict[str, float]:
    results: dict[str, float] = {
        "delta_params_m": round(sum(p.numel() for p in build_model().parameters()) / 1e6, 1),
        "link_mbit": link_mbit,
    }
    for label, lr in (("1e-6", 1e-6), ("1e-5", 1e-5)):
        dirs = train_versions(lr, steps, work, shard_mb)
        store = CheckpointStore(f"file://{work}/store-lr{lr:g}", link_local=False)
        seconds, ratios = publish_all(store, dirs)
        results[f"delta_ratio_lr{label}"] = round(sum(ratios) / len(ratios), 4)
        results[f"delta_ratio_max_lr{label}"] = round(max(ratios), 4)
        if s3 is not None:
            results |= {f"{key}_lr{label}": value for key, value in link_figures(dirs, s3, link_mbit, work, label).items()}
        if lr == 1e-5:  # the figures below from the larger (worse) deltas
            results["full_bf16_mb"] = round(weight_bytes(dirs[0]) / MB, 1)
            results["key_publish_s"] = round(seconds[0], 2)
            results["delta_publish_s"] = round(min(seconds[1:]), 2)
            cache = os.path.join(work, "cache-file")
            store.pull(steps - 1, cache)
            started = time.perf_counter()
            store.pull(steps, cache)
            results["delta_apply_verify_s"] = round(time.perf_counter() - started, 2)
        shutil.rmtree(f"{work}/store-lr{lr:g}")
        for directory in dirs:
            shutil.rmtree(directory)
    if s3 is not None:  # the key: the larger learning rate's (worse) figure
        results["link_new_version_time_ratio"] = results["link_new_version_time_ratio_lr1e-5"]
    return results


def link_figures(dirs: list[str], s3: tuple[str, dict[str, object]], link_mbit: float, work: str, label: str) -> dict[str, float]:
    url, options = s3[0] + f"-lr{label}", s3[1]
    publish_all(CheckpointStore(url, options), dirs[-2:])  # v0: the key (version N-1), v1: the delta
    full_cache, delta_cache = os.path.join(work, f"link-full-{label}"), os.path.join(work, f"link-delta-{label}")
    started = time.perf_counter()
    # Own filesystem instances (fsspec caches them per options): only these two are shaped.
    own = {**options, "skip_instance_cache": True}
    shaped(CheckpointStore(url, own), link_mbit).pull(0, full_cache)
    full_s = time.perf_counter() - started
    shutil.copytree(full_cache, delta_cache)  # a worker holding version N-1
    started = time.perf_counter()
    shaped(CheckpointStore(url, own), link_mbit).pull(1, delta_cache)
    delta_s = time.perf_counter() - started
    return {
        "link_full_pull_s": round(full_s, 2),
        "link_delta_pull_s": round(delta_s, 2),
        "link_new_version_time_ratio": round(delta_s / full_s, 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=3, help="Training steps (delta versions) per learning rate.")
    parser.add_argument("--link-mbit", type=float, default=100.0, help="Shaped link to the S3 server, Mbit/s.")
    args = parser.parse_args()
    from fsspec.core import url_to_fs

    work = tempfile.mkdtemp(prefix="decentrl-bench-delta-")
    server, endpoint = start_moto()
    try:
        options: dict[str, object] = {
            "key": "testing",
            "secret": "testing",
            "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"},
        }
        url_to_fs("s3://", key="testing", secret="testing", client_kwargs={"endpoint_url": endpoint})[0].mkdir("delta")
        results = {"load_avg_1m_start": round(os.getloadavg()[0], 2)}
        results |= delta_figures(work, steps=args.steps, link_mbit=args.link_mbit, s3=("s3://delta/store", options))
        results["load_avg_1m_end"] = round(os.getloadavg()[0], 2)
    finally:
        server.terminate()
        server.wait()
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
