"""The pull side of the store: resumed downloads, the capped cache, shared caches, caches that\nanother store filled, retention grace."""

from __future__ import annotations

import errno
import os
import threading
from pathlib import Path
from typing import BinaryIO

import blake3
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from decentrl.store import cache as cache_mod
from decentrl.store import checkpoints as store_mod
from decentrl.store.checkpoints import MANIFEST_NAME, CheckpointStore, SignatureError, StoreError

SIZE = 3 * 1024 * 1024 + 17  # several streaming chunks, not a multiple of one


@pytest.fixture(autouse=True)
def no_retry_sleep(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(store_mod, "_RETRY_DELAYS", (0.0, 0.0))


@pytest.fixture
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> CheckpointStore:
    # Streaming pulls, as from a remote store: the faults below are staged in fs.open, which a
    # local store's pull never calls (a hard link, tests/core/test_store.py, or a kernel copy,
    # below); without copy_file_range (as on macOS) a local store's copies stream too.
    monkeypatch.delattr(os, "copy_file_range", raising=False)
    return CheckpointStore(str(tmp_path / "store"), link_local=False)


def test_a_kernel_copy_resumes_where_the_copy_stopped_and_hashes_what_landed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cache_mod, "RANGE_CHUNK", 64 * 1024 + 3)  # many chunks, unaligned offsets
    data = os.urandom(SIZE)
    (tmp_path / "src").write_bytes(data)
    have = 100_001  # a partial copy kept from an interrupted pull, already hashed
    (tmp_path / "dst").write_bytes(data[:have])
    digest = blake3.blake3()
    digest.update(data[:have])
    src, dst = os.open(tmp_path / "src", os.O_RDONLY), os.open(tmp_path / "dst", os.O_RDWR)
    try:
        size = cache_mod.copy_range_hashing(src, dst, digest, have, limit=SIZE + 1)
    finally:
        os.close(src)
        os.close(dst)
    assert size == SIZE and (tmp_path / "dst").read_bytes() == data
    assert digest.hexdigest() == blake3.blake3(data).hexdigest()


def test_a_local_store_the_kernel_cannot_copy_from_is_streamed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = CheckpointStore(str(tmp_path / "store"), link_local=False)
    src = make_ckpt(tmp_path, "a")
    store.publish(1, str(src))
    tried: list[int] = []

    def across_filesystems(*args: object) -> int:
        tried.append(1)
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(os, "copy_file_range", across_filesystems)
    out = Path(store.pull(1, str(tmp_path / "cache")))
    assert tried  # it tried the kernel first
    assert (out / "model.safetensors").read_bytes() == (src / "model.safetensors").read_bytes()


def make_ckpt(root: Path, name: str, size: int = SIZE) -> Path:
    d = root / "src" / name
    d.mkdir(parents=True)
    (d / "model.safetensors").write_bytes(os.urandom(size))
    (d / "config.json").write_text(f'{{"name": "{name}"}}')
    return d


class CutConnection:
    """A remote file that delivers `budget[0]` more bytes in all, then resets like a dropped link."""

    def __init__(self, src: BinaryIO, budget: list[int], offsets: list[int]) -> None:
        self.src, self.budget, self.offsets = src, budget, offsets

    def __enter__(self) -> CutConnection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.src.close()

    def seek(self, offset: int) -> int:
        self.offsets.append(offset)
        return self.src.seek(offset)

    def readinto(self, buffer: memoryview) -> int:
        if self.budget[0] <= 0:
            raise ConnectionResetError("connection reset by peer")
        n = self.src.readinto(memoryview(buffer)[: self.budget[0]])
        self.budget[0] -= n
        return n


def cut_after(store: CheckpointStore, monkeypatch: pytest.MonkeyPatch, nbytes: int) -> tuple[list[int], list[int]]:
    """Let reads of model.safetensors deliver `nbytes` in total; returns (remaining budget, seek offsets)."""
    budget, offsets = [nbytes], []
    real_open = store.fs.open

    def open_(path: str, mode: str = "rb", **kwargs: object):  # noqa: ANN202 - a file-like
        f = real_open(path, mode, **kwargs)
        return CutConnection(f, budget, offsets) if path.endswith("model.safetensors") else f

    monkeypatch.setattr(store.fs, "open", open_)
    return budget, offsets


def test_interrupted_pull_is_resumed_not_restarted(
    store: CheckpointStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = make_ckpt(tmp_path, "a")
    store.publish(1, str(src))
    cache = tmp_path / "cache"
    cut = 1_300_000
    with monkeypatch.context() as patch:
        cut_after(store, patch, cut)
        with pytest.raises(StoreError, match=r"v000001/model\.safetensors: download failed \(connection reset"):
            store.pull(1, str(cache))
    partial = cache / ".v000001.partial" / "model.safetensors"
    assert partial.stat().st_size == cut  # what arrived is kept
    assert not (cache / "v000001").exists()

    budget, offsets = cut_after(store, monkeypatch, 2 * SIZE)
    out = Path(store.pull(1, str(cache)))
    assert offsets == [cut]  # continued where the link dropped
    assert 2 * SIZE - budget[0] == SIZE - cut  # and fetched only the rest
    assert (out / "model.safetensors").read_bytes() == (src / "model.safetensors").read_bytes()
    assert sorted(os.listdir(cache)) == ["v000001"]


def test_corrupt_partial_is_detected_and_downloaded_again(
    store: CheckpointStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = make_ckpt(tmp_path, "a")
    store.publish(1, str(src))
    cache = tmp_path / "cache"
    with monkeypatch.context() as patch:
        cut_after(store, patch, 500_000)
        with pytest.raises(StoreError):
            store.pull(1, str(cache))
    partial = cache / ".v000001.partial" / "model.safetensors"
    data = bytearray(partial.read_bytes())
    data[10] ^= 0xFF  # the local disk flipped a bit in what was kept
    partial.write_bytes(bytes(data))
    out = Path(store.pull(1, str(cache)))  # resume fails the hash, the retry starts over
    assert (out / "model.safetensors").read_bytes() == (src / "model.safetensors").read_bytes()


def test_partial_of_a_republished_version_is_discarded(store: CheckpointStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store.publish(1, str(make_ckpt(tmp_path, "old")))
    cache = tmp_path / "cache"
    with monkeypatch.context() as patch:
        cut_after(store, patch, 1_000_000)
        with pytest.raises(StoreError):
            store.pull(1, str(cache))
    store.delete(1)
    new = make_ckpt(tmp_path, "new")
    store.publish(1, str(new))
    _, offsets = cut_after(store, monkeypatch, 2 * SIZE)
    out = Path(store.pull(1, str(cache)))
    assert offsets == []  # nothing of the old bytes was reused
    assert (out / "model.safetensors").read_bytes() == (new / "model.safetensors").read_bytes()


def test_cache_cap_evicts_oldest_versions(tmp_path: Path) -> None:
    store = CheckpointStore(str(tmp_path / "store"), cache_max_bytes=int(2.5 * SIZE))
    for v in range(5):
        store.publish(v, str(make_ckpt(tmp_path, f"c{v}")))
    cache = tmp_path / "cache"
    store.pull(1, str(cache))
    store.pull(0, str(cache))
    assert sorted(os.listdir(cache)) == ["v000000", "v000001"]
    store.pull(3, str(cache))  # three versions exceed the cap: the oldest goes
    assert sorted(os.listdir(cache)) == ["v000001", "v000003"]
    store.pull(2, str(cache))  # an older version just pulled is kept all the same
    assert sorted(os.listdir(cache)) == ["v000002", "v000003"]
    store.pull(4, str(cache))
    assert sorted(os.listdir(cache)) == ["v000003", "v000004"]


def test_a_version_bigger_than_the_cap_is_still_pulled(tmp_path: Path) -> None:
    store = CheckpointStore(str(tmp_path / "store"), cache_max_bytes=1000)
    store.publish(0, str(make_ckpt(tmp_path, "a")))
    store.publish(1, str(make_ckpt(tmp_path, "b")))
    cache = tmp_path / "cache"
    store.pull(0, str(cache))
    out = store.pull(1, str(cache))
    assert sorted(os.listdir(cache)) == ["v000001"]
    assert store.verify(1) == [] and Path(out, MANIFEST_NAME).is_file()


def test_eviction_skips_a_version_another_process_is_pulling(tmp_path: Path) -> None:
    store = CheckpointStore(str(tmp_path / "store"), cache_max_bytes=1000)
    cache = tmp_path / "cache"
    partial = cache / ".v000001.partial"
    partial.mkdir(parents=True)
    (partial / "model.safetensors").write_bytes(os.urandom(5000))
    store.publish(2, str(make_ckpt(tmp_path, "b")))
    with cache_mod.locked(str(cache / ".v000001.lock")):
        store.pull(2, str(cache))
        assert partial.is_dir()  # locked by its puller: left alone
    store.evict(str(cache), keep=2)
    assert sorted(os.listdir(cache)) == ["v000002"]


def test_concurrent_pulls_into_one_cache_agree(store: CheckpointStore, tmp_path: Path) -> None:
    src = make_ckpt(tmp_path, "a")
    store.publish(1, str(src))
    cache = str(tmp_path / "cache")
    results: list[str] = []
    errors: list[BaseException] = []

    def pull() -> None:
        try:
            # Each thread its own store object, as separate workers sharing a disk would be.
            results.append(CheckpointStore(store.url).pull(1, cache))
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=pull) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert errors == []
    assert results == [os.path.join(cache, "v000001")] * 4
    assert sorted(os.listdir(cache)) == ["v000001"]
    assert Path(results[0], "model.safetensors").read_bytes() == (src / "model.safetensors").read_bytes()


def test_retention_waits_out_the_grace_period(store: CheckpointStore, tmp_path: Path) -> None:
    store.retention_grace_s = 100.0
    for v in range(4):
        store.publish(v, str(make_ckpt(tmp_path, f"c{v}")))
    published = {v: store.manifest(v).created_at for v in range(4)}
    # Every older version was superseded moments ago: a worker may still be pulling it.
    assert store.retain(keep_last=1) == []
    # Grace counts from when the next version appeared, not from the version's own publish.
    assert store.retain(keep_last=1, now=published[2] + 100.0 - 1e-3) == [0]
    assert store.retain(keep_last=1, now=published[3] + 100.0) == [1, 2]
    assert store.versions() == [3]



def test_a_cached_version_of_another_store_is_replaced(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # Default local stores: pulls hard-link, so run A's cached files share inodes with A's store.
    run_a, run_b = CheckpointStore(str(tmp_path / "a")), CheckpointStore(str(tmp_path / "b"))
    src_a, src_b = make_ckpt(tmp_path, "a"), make_ckpt(tmp_path, "b")
    run_a.publish(3, str(src_a))
    run_b.publish(3, str(src_b))
    cache = str(tmp_path / "cache")
    assert Path(run_a.pull(3, cache), "model.safetensors").stat().st_nlink == 2
    with caplog.at_level("WARNING", logger="decentrl.store.checkpoints"):
        out = Path(run_b.pull(3, cache))
    assert (out / "model.safetensors").read_bytes() == (src_b / "model.safetensors").read_bytes()
    assert (out / MANIFEST_NAME).read_bytes() == run_b.fs.cat_file(f"{run_b.root}/v000003/{MANIFEST_NAME}")
    assert sorted(os.listdir(cache)) == ["v000003"]
    assert [r.getMessage() for r in caplog.records if "is not that version" in r.getMessage()] != []
    assert str(tmp_path / "b") in caplog.text
    # Replacing the cached copy only dropped its names: run A's store is whole.
    stored_a = tmp_path / "a" / "v000003" / "model.safetensors"
    assert stored_a.stat().st_nlink == 1
    assert run_a.verify(3) == []
    assert Path(run_a.pull(3, cache), "model.safetensors").read_bytes() == (src_a / "model.safetensors").read_bytes()


def test_a_cached_version_whose_files_changed_is_pulled_again_saying_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = CheckpointStore(str(tmp_path / "store"))
    src = make_ckpt(tmp_path, "a")
    store.publish(0, str(src))
    cached = Path(store.pull(0, str(tmp_path / "cache")), "model.safetensors")
    cached.unlink()  # a new inode: the store's hard-linked file is left whole
    cached.write_bytes(b"damaged")
    with caplog.at_level("WARNING", logger="decentrl.store.checkpoints"):
        out = Path(store.pull(0, str(tmp_path / "cache")))
    assert (out / "model.safetensors").read_bytes() == (src / "model.safetensors").read_bytes()
    warned = [r.getMessage() for r in caplog.records if "pulling it again" in r.getMessage()]
    # Said once, naming the file: not as a version of another store (its manifest is the store's).
    assert len(warned) == 1 and "no longer matches its manifest (model.safetensors:" in warned[0], warned


def test_a_restarted_run_at_the_same_url_is_pulled_again(store: CheckpointStore, tmp_path: Path) -> None:
    store.publish(0, str(make_ckpt(tmp_path, "first-run")))
    cache = str(tmp_path / "cache")
    store.pull(0, cache)
    store.fs.rm(store.root, recursive=True)  # the run starts over from scratch at the same URL
    fresh = make_ckpt(tmp_path, "second-run")
    CheckpointStore(store.url).publish(0, str(fresh))
    out = Path(store.pull(0, cache))
    assert (out / "model.safetensors").read_bytes() == (fresh / "model.safetensors").read_bytes()
    assert (out / "config.json").read_text() == '{"name": "second-run"}'


def test_a_cached_version_is_served_while_the_store_cannot_be_read(
    store: CheckpointStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = make_ckpt(tmp_path, "a")
    store.publish(1, str(src))
    store.publish(2, str(make_ckpt(tmp_path, "b")))
    cache = str(tmp_path / "cache")
    first = store.pull(1, cache)
    os.rename(tmp_path / "store", tmp_path / "store.away")  # a local store gone
    assert store.pull(1, cache) == first
    with pytest.raises(StoreError, match="version 2 not found"):
        store.pull(2, cache)
    os.rename(tmp_path / "store.away", tmp_path / "store")

    from botocore.exceptions import EndpointConnectionError  # what s3fs raises, and no OSError

    def down(path: str, *args: object, **kwargs: object) -> bytes:
        raise EndpointConnectionError(endpoint_url=f"http://down/{path}")

    monkeypatch.setattr(store.fs, "cat_file", down)
    assert store.pull(1, cache) == first
    assert Path(first, "model.safetensors").read_bytes() == (src / "model.safetensors").read_bytes()
    with pytest.raises(StoreError, match=r"v000002/manifest\.json from .* failed \(EndpointConnectionError.*check the store is reachable"):
        store.pull(2, cache)


def test_a_cache_hit_checks_the_signature(tmp_path: Path) -> None:
    key = Ed25519PrivateKey.generate()
    unsigned = CheckpointStore(str(tmp_path / "unsigned"))
    unsigned.publish(1, str(make_ckpt(tmp_path, "a")))
    cache = str(tmp_path / "cache")
    unsigned.pull(1, cache)
    with pytest.raises(SignatureError, match="unsigned"):  # cached, but not by the trainer's key
        CheckpointStore(unsigned.url, public_key=key.public_key()).pull(1, cache)
    src = make_ckpt(tmp_path, "b")
    CheckpointStore(str(tmp_path / "signed"), signing_key=key).publish(1, str(src))
    out = Path(CheckpointStore(str(tmp_path / "signed"), public_key=key.public_key()).pull(1, cache))
    assert (out / "model.safetensors").read_bytes() == (src / "model.safetensors").read_bytes()


def test_the_cached_base_of_an_adapter_must_be_the_stores_too(tmp_path: Path) -> None:
    run_a, run_b = CheckpointStore(str(tmp_path / "a")), CheckpointStore(str(tmp_path / "b"))
    run_a.publish(0, str(make_ckpt(tmp_path, "base-a")))
    base_b = make_ckpt(tmp_path, "base-b")
    run_b.publish(0, str(base_b))
    run_b.publish(1, str(make_ckpt(tmp_path, "adapter-b")), parent=0, base_version=0)
    cache = tmp_path / "cache"
    run_a.pull(0, str(cache))
    run_b.pull(1, str(cache))
    assert (cache / "v000000" / "model.safetensors").read_bytes() == (base_b / "model.safetensors").read_bytes()
