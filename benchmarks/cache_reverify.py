"""What re-verifying a cached version costs a pull (decentrl/store/cache.py), against the pull itself.

A cached version is served again only once its files match its manifest: files this process
verified and whose identity (device, inode, size, mtime, ctime) is unchanged are not hashed
again; any other file (after a restart, or one whose identity moved) is hashed in full. Builds a
checkpoint of --size-mb random bytes in --files files in a file:// store (link_local off, as
with a public key), then times, best of --repeats:

  cache_hit_known_s      a pull of a version this process pulled: identity checks only
  cache_hit_rehash_s     the same pull by a fresh store object (a restarted worker): every file hashed
  download_pull_s        a pull into an empty cache (copy + sha256), for scale

Last stdout line, one JSON object: those three, rehash_mb_s, size_mb, load_avg_1m.

    .venv/bin/python benchmarks/cache_reverify.py [--size-mb 256] [--files 4] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable

from decentrl.store.checkpoints import CheckpointStore


def best(repeats: int, prepare: Callable[[], None], run: Callable[[], object]) -> float:
    times = []
    for _ in range(repeats):
        prepare()
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=int, default=256)
    parser.add_argument("--files", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="decentrl-reverify-") as tmp:
        src = os.path.join(tmp, "src")
        os.makedirs(src)
        per_file = args.size_mb * 10**6 // args.files
        for i in range(args.files):
            with open(os.path.join(src, f"model-{i:05d}.safetensors"), "wb") as f:
                f.write(os.urandom(per_file))
        url = os.path.join(tmp, "store")
        CheckpointStore(url).publish(0, src)
        cache = os.path.join(tmp, "cache")
        store = CheckpointStore(url, link_local=False)

        def clear() -> None:
            shutil.rmtree(cache, ignore_errors=True)

        download = best(args.repeats, clear, lambda: store.pull(0, cache))
        known = best(args.repeats, lambda: None, lambda: store.pull(0, cache))
        rehash = best(args.repeats, lambda: None, lambda: CheckpointStore(url, link_local=False).pull(0, cache))
    size_mb = per_file * args.files / 10**6
    print(json.dumps({
        "cache_hit_known_s": round(known, 5),
        "cache_hit_rehash_s": round(rehash, 4),
        "download_pull_s": round(download, 4),
        "rehash_mb_s": round(size_mb / rehash, 1),
        "size_mb": size_mb,
        "load_avg_1m": os.getloadavg()[0],
    }))


if __name__ == "__main__":
    main()
