"""Checkpoint store throughput: verified publish and pull against a raw fsspec copy of the same bytes.

Builds a real checkpoint of about --size-mb (random float32 weights written by the trainer's
`write_hf_dir`, sharded at --shard-mb), then on a file:// store and on a local moto S3 server
(a separate process, standing in for a bucket) times, best of --repeats rounds:

  raw publish   fsspec `put` of the checkpoint files (what a plain copy costs)
  publish       CheckpointStore.publish as the trainer calls it (hand_over): parallel upload +
                digest (BLAKE3) of every file + manifest; a local store takes the files by hard link
  publish copy  file:// only: the same with hand_over=False (the files are copied)
  raw pull      fsspec `get` of the same files
  pull          CheckpointStore.pull: parallel download, BLAKE3 while streaming, atomic rename;
                on file:// (link_local, the default) a hard link of each file, then its digest
  pull copy     file:// only: the pull with link_local = false (copy + BLAKE3 while streaming)
  stream pull   the store's download path (parallel fsspec reads) without the digest
  verify        CheckpointStore.verify: re-read and hash the stored version (no local copy)

Every figure comes from this run. The last stdout line is one JSON object:
  publish_mb_s_*, pull_mb_s_*, raw_*_mb_s_*  throughputs (MB = 1e6 bytes)
  pull_vs_raw_*, publish_vs_raw_*           raw time / store time (1.0 = as fast as a raw copy)
  pull_copy_vs_raw_file, publish_copy_vs_raw_file   the same for the copying variants
  verify_overhead_*                         copying pull time / stream pull time - 1 (what hashing adds)
  verify_mb_s_*, sha256_mb_s, blake3_mb_s   hashing-only throughputs, for scale (blake3: the manifest digest)
  load_avg_1m_*                             how busy the machine was (figures are noisy when high)
  lora_adapter_vs_full_bytes                LoRA runs: bytes of one adapter version / bytes of the full
                                            model (version 0), both written as the trainer writes them,
                                            for a ~500 MB float32 Qwen2-shaped model, rank 16 on q,k,v,o

  delta_*, link_*           delta versions of a 162M-parameter bf16 model trained at lr 1e-6 and
                            1e-5, and a 100 Mbit/s link: see benchmarks/checkpoint_delta.py

    .venv/bin/python benchmarks/checkpoint_io.py [--size-mb 500] [--shard-mb N] [--repeats 5] [--delta-steps 3]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch
from checkpoint_delta import delta_figures, start_moto  # this script's folder is on sys.path
from fsspec import AbstractFileSystem
from fsspec.core import url_to_fs
from transformers import Qwen2Config

from decentrl.config import LoRAConfig, StoreConfig
from decentrl.store.checkpoints import CheckpointStore
from decentrl.store.manifest import new_hasher
from decentrl.store.weights import write_hf_dir
from decentrl.trainer.lora import add_adapters, write_adapter_dir

MB = 1e6


def make_checkpoint(directory: str, size_mb: int, shard_mb: int) -> int:
    """Random float32 weights of about size_mb in layer-sized tensors; returns the bytes on disk."""
    generator = torch.Generator().manual_seed(0)
    tensor_elems = 16 * 2**20 // 4  # 16 MiB tensors, like the matrices of a ~1B model
    count = max(1, int(size_mb * MB) // (tensor_elems * 4))
    state = {f"model.layers.{i}.weight": torch.randn(tensor_elems, generator=generator) for i in range(count)}
    write_hf_dir(directory, state, Qwen2Config(), extras_from=directory, max_shard_bytes=shard_mb * 2**20)
    return sum(entry.stat().st_size for entry in os.scandir(directory))


def lora_sizes(work: str) -> dict[str, float]:
    """Bytes on disk of a full version and of one LoRA adapter version of the same model."""
    from transformers import Qwen2ForCausalLM

    # ~126M parameters: 12 layers of width 768 (a GPT-2-small-sized Qwen2), 503 MB in float32.
    config = Qwen2Config(
        vocab_size=8192, hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
        num_attention_heads=12, num_key_value_heads=12, tie_word_embeddings=False,
    )
    model = Qwen2ForCausalLM(config).float()
    full_dir, adapter_dir = os.path.join(work, "lora-full"), os.path.join(work, "lora-adapter")
    write_hf_dir(full_dir, model.state_dict(), config, extras_from=full_dir)
    lora = LoRAConfig(rank=16, alpha=32.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    write_adapter_dir(adapter_dir, add_adapters(model, lora).state_dict(), lora)
    full, adapter = (sum(entry.stat().st_size for entry in os.scandir(d)) for d in (full_dir, adapter_dir))
    shutil.rmtree(full_dir)
    shutil.rmtree(adapter_dir)
    return {
        "lora_full_mb": round(full / MB, 1),
        "lora_adapter_mb": round(adapter / MB, 2),
        "lora_adapter_vs_full_bytes": round(adapter / full, 5),
    }


def stream_copy(fs: AbstractFileSystem, remote: list[str], local_dir: str, concurrency: int) -> None:
    """The store's own download path minus the sha256: what verification adds is pull - this."""

    def copy(path: str) -> None:
        buffer = memoryview(bytearray(2**20))
        with fs.open(path, "rb", block_size=64 * 2**20) as src, open(os.path.join(local_dir, path.split("/")[-1]), "wb") as dst:
            while n := src.readinto(buffer):
                dst.write(buffer[:n])

    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(copy, remote))


def measure(
    url: str, options: dict[str, object], ckpt: str, work: str, repeats: int, concurrency: int,
    summary: Callable[[list[float]], float] = min,
) -> dict[str, float]:
    """Seconds of raw copies and store operations of the checkpoint under `url`: `summary` (the best,
    unless told) of `repeats` rounds.

    Each round runs every operation once, so raw and store figures share the machine's moods
    (other processes, page cache) instead of one of them getting a quiet minute.
    """
    store = CheckpointStore(url, options, upload_concurrency=concurrency, download_concurrency=concurrency)
    copying = CheckpointStore(url, options, upload_concurrency=concurrency, download_concurrency=concurrency, link_local=False)
    fs, root = store.fs, store.root
    names = sorted(os.listdir(ckpt))
    local = [os.path.join(ckpt, name) for name in names]
    raw_dir, cache = f"{root}/raw", os.path.join(work, "cache")
    raw_remote, stored = [f"{raw_dir}/{n}" for n in names], [f"{root}/v000000/{n}" for n in names]

    def clear_local() -> None:
        shutil.rmtree(cache, ignore_errors=True)
        os.makedirs(cache)

    def raw_publish() -> None:
        if fs.exists(raw_dir):
            fs.rm(raw_dir, recursive=True)
        fs.makedirs(raw_dir, exist_ok=True)
        fs.put(local, raw_remote)

    def publish(hand_over: bool) -> None:
        if store.versions():
            store.delete(0)
        store.publish(0, ckpt, hand_over=hand_over)

    operations: dict[str, tuple[Callable[[], None], Callable[[], object]]] = {
        "raw_publish": (lambda: None, raw_publish),
        "publish_copy": (lambda: None, lambda: publish(False)),
        "publish": (lambda: None, lambda: publish(True)),  # last: the pulls below read this one
        "raw_pull": (clear_local, lambda: fs.get(raw_remote, [os.path.join(cache, n) for n in names])),
        "stream_pull": (clear_local, lambda: stream_copy(fs, stored, cache, concurrency)),
        "pull_copy": (clear_local, lambda: copying.pull(0, cache)),
        "pull": (clear_local, lambda: store.pull(0, cache)),
        "verify": (lambda: None, lambda: store.verify(0)),
    }
    if not store.link_local:  # a remote store: both pulls and both publishes copy
        for name in ("publish_copy", "pull_copy"):
            del operations[name]
    rounds: dict[str, list[float]] = {name: [] for name in operations}
    for _ in range(repeats):
        for name, (setup, action) in operations.items():
            setup()
            fs.invalidate_cache()
            started = time.perf_counter()
            action()
            rounds[name].append(time.perf_counter() - started)
    store.delete(0)
    fs.rm(raw_dir, recursive=True)
    return {name: summary(seconds) for name, seconds in rounds.items()}


def sha256_mb_s() -> float:
    data = os.urandom(64 * 2**20)
    started = time.perf_counter()
    hashlib.sha256(data).hexdigest()
    return len(data) / MB / (time.perf_counter() - started)


def blake3_mb_s() -> float:
    """The manifest digest as the store runs it (decentrl.store.manifest.new_hasher: all cores)."""
    data = os.urandom(64 * 2**20)
    digest = new_hasher("blake3")
    started = time.perf_counter()
    digest.update(data)
    digest.hexdigest()
    return len(data) / MB / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size-mb", type=int, default=500, help="Checkpoint size (default 500).")
    shard_mb = StoreConfig.model_fields["shard_size_mb"].default
    parser.add_argument("--shard-mb", type=int, default=shard_mb, help=f"safetensors shard size (default {shard_mb}, the config's).")
    parser.add_argument("--repeats", type=int, default=5, help="Rounds; each figure is the best round (default 5).")
    concurrency = StoreConfig.model_fields["download_concurrency"].default
    parser.add_argument("--concurrency", type=int, default=concurrency, help=f"Parallel uploads/downloads (default {concurrency}).")
    parser.add_argument("--delta-steps", type=int, default=3, help="Delta versions per learning rate (0: skip the delta figures).")
    parser.add_argument("--link-mbit", type=float, default=100.0, help="Shaped link for the delta figures, Mbit/s.")
    args = parser.parse_args()
    logging.getLogger("werkzeug").setLevel(logging.ERROR)

    work = tempfile.mkdtemp(prefix="decentrl-bench-io-")
    server = None
    try:
        ckpt = os.path.join(work, "ckpt")
        os.makedirs(ckpt)
        total = make_checkpoint(ckpt, args.size_mb, args.shard_mb)
        files = len(os.listdir(ckpt))
        print(f"checkpoint: {total / MB:.0f} MB in {files} files", flush=True)

        results: dict[str, float | int | str] = {
            "checkpoint_mb": round(total / MB, 1), "files": files, "shard_mb": args.shard_mb,
            "concurrency": args.concurrency, "repeats": args.repeats, "cpus": os.cpu_count() or 0,
            "load_avg_1m_start": round(os.getloadavg()[0], 2),  # other processes sharing the CPUs
        }
        server, endpoint = start_moto()
        s3_options = {"key": "testing", "secret": "testing", "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"}}
        # s3fs would send LocationConstraint=us-east-1, which S3 rejects: create the bucket without a region.
        url_to_fs("s3://", key="testing", secret="testing", client_kwargs={"endpoint_url": endpoint})[0].mkdir("bench")
        targets = {"file": (f"file://{work}/store", {}), "s3": ("s3://bench/store", s3_options)}
        for label, (url, options) in targets.items():
            scratch = os.path.join(work, label)
            os.makedirs(scratch)
            t = measure(url, options, ckpt, scratch, args.repeats, args.concurrency)
            print(f"{label}: " + ", ".join(f"{k} {total / MB / v:.0f} MB/s" for k, v in t.items()), flush=True)
            results |= {
                f"publish_mb_s_{label}": round(total / MB / t["publish"], 1),
                f"raw_publish_mb_s_{label}": round(total / MB / t["raw_publish"], 1),
                f"pull_mb_s_{label}": round(total / MB / t["pull"], 1),
                f"raw_pull_mb_s_{label}": round(total / MB / t["raw_pull"], 1),
                f"verify_mb_s_{label}": round(total / MB / t["verify"], 1),
                f"publish_vs_raw_{label}": round(t["raw_publish"] / t["publish"], 3),
                f"pull_vs_raw_{label}": round(t["raw_pull"] / t["pull"], 3),
                f"stream_pull_mb_s_{label}": round(total / MB / t["stream_pull"], 1),
                f"verify_overhead_{label}": round(t["pull_copy" if "pull_copy" in t else "pull"] / t["stream_pull"] - 1, 3),
            }
            if "pull_copy" in t:  # local: the default pull links, this one copies (link_local = false)
                results |= {
                    f"pull_copy_vs_raw_{label}": round(t["raw_pull"] / t["pull_copy"], 3),
                    f"publish_copy_vs_raw_{label}": round(t["raw_publish"] / t["publish_copy"], 3),
                }
        results["sha256_mb_s"] = round(sha256_mb_s(), 1)
        results["blake3_mb_s"] = round(blake3_mb_s(), 1)
        results |= lora_sizes(work)
        if args.delta_steps:
            results |= delta_figures(work, steps=args.delta_steps, link_mbit=args.link_mbit, s3=("s3://bench/delta", s3_options))
        results["load_avg_1m_end"] = round(os.getloadavg()[0], 2)
    finally:
        if server is not None:
            server.terminate()
            server.wait()
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
