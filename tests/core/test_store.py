"""Unit tests for decentrl.store.checkpoints: publish/pull/verify/retain on local and memory:// stores."""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import blake3
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from pydantic import ValidationError

from decentrl.store import checkpoints as store_mod
from decentrl.store.checkpoints import (
    MANIFEST_NAME,
    CheckpointStore,
    ManifestFile,
    StoreError,
    VerificationError,
    version_dirname,
)

MakeCkpt = Callable[[str], Path]


@pytest.fixture(autouse=True)
def no_retry_sleep(monkeypatch: pytest.MonkeyPatch) -> None:
    # Keep the 3 attempts, drop the backoff so failing-path tests stay fast.
    monkeypatch.setattr(store_mod, "_RETRY_DELAYS", (0.0, 0.0))


@pytest.fixture(params=["local", "local-copy", "memory"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[CheckpointStore]:
    if request.param.startswith("local"):
        # local: pulls hard-link into the cache (the default); local-copy: they copy.
        yield CheckpointStore(str(tmp_path / "store"), link_local=request.param == "local")
        return
    # The memory filesystem is process-global: give each test its own root.
    url = f"memory://store-{uuid.uuid4().hex}"
    s = CheckpointStore(url)
    yield s
    if s.fs.exists(s.root):
        s.fs.rm(s.root, recursive=True)


@pytest.fixture
def make_ckpt(tmp_path: Path) -> MakeCkpt:
    """Write a small checkpoint dir of random bytes; returns its path."""

    def make(name: str) -> Path:
        d = tmp_path / "src" / name
        d.mkdir(parents=True)
        (d / "model.safetensors").write_bytes(os.urandom(5000))
        (d / "config.json").write_text(json.dumps({"name": name, "pad": os.urandom(8).hex()}))
        return d

    return make


def remote(store: CheckpointStore, version: int, name: str) -> str:
    return f"{store.root}/{version_dirname(version)}/{name}"


def cache_entries(cache: Path) -> list[str]:
    return sorted(os.listdir(cache)) if cache.exists() else []


def test_version_dirname() -> None:
    assert version_dirname(42) == "v000042"
    assert version_dirname(1234567) == "v1234567"


def test_empty_store_has_no_versions(store: CheckpointStore) -> None:
    assert store.versions() == []
    assert store.latest() is None


def test_publish_then_list_and_read_manifest(store: CheckpointStore, make_ckpt: MakeCkpt) -> None:
    store.publish(0, str(make_ckpt("a")))
    published = store.publish(1, str(make_ckpt("b")), parent=0)
    assert store.versions() == [0, 1]
    assert store.latest() == 1
    m = store.manifest(1)
    assert m == published
    assert (m.version, m.parent) == (1, 0)
    assert sorted(f.path for f in m.files) == ["config.json", "model.safetensors"]
    assert store.manifest(0).parent is None


def test_pull_gives_identical_bytes_and_correct_hashes(
    store: CheckpointStore, make_ckpt: MakeCkpt, tmp_path: Path
) -> None:
    src = make_ckpt("a")
    store.publish(3, str(src))
    out = Path(store.pull(3, str(tmp_path / "cache")))
    assert out == tmp_path / "cache" / "v000003"
    assert sorted(os.listdir(out)) == ["config.json", MANIFEST_NAME, "model.safetensors"]
    for entry in store.manifest(3).files:
        data = (src / entry.path).read_bytes()
        assert (out / entry.path).read_bytes() == data
        assert entry.algorithm == "blake3" and entry.digest == blake3.blake3(data).hexdigest()
        assert entry.size == len(data)
    assert store.verify(3) == []
    assert cache_entries(tmp_path / "cache") == ["v000003"]  # no partial dir left


def test_version_without_manifest_is_invisible(
    store: CheckpointStore, make_ckpt: MakeCkpt, tmp_path: Path
) -> None:
    store.publish(1, str(make_ckpt("a")))
    store.fs.rm(remote(store, 1, MANIFEST_NAME))
    store.fs.makedirs(f"{store.root}/v000009.old", exist_ok=True)
    store.fs.pipe_file(f"{store.root}/v000009.old/{MANIFEST_NAME}", b"{}")
    assert store.versions() == []
    with pytest.raises(StoreError, match="version 1 not found"):
        store.manifest(1)
    with pytest.raises(StoreError, match="version 1 not found"):
        store.pull(1, str(tmp_path / "cache"))
    assert cache_entries(tmp_path / "cache") == []


def test_flipped_byte_fails_pull_and_verify(
    store: CheckpointStore, make_ckpt: MakeCkpt, tmp_path: Path
) -> None:
    store.publish(3, str(make_ckpt("a")))
    path = remote(store, 3, "model.safetensors")
    data = bytearray(store.fs.cat_file(path))
    data[100] ^= 0xFF
    store.fs.pipe_file(path, bytes(data))

    cache = tmp_path / "cache"
    with pytest.raises(VerificationError, match=r"v000003/model\.safetensors: blake3 mismatch"):
        store.pull(3, str(cache))
    assert "v000003" not in cache_entries(cache)
    # The good file is kept for a resumed pull; the bad bytes are not.
    assert sorted(os.listdir(cache / ".v000003.partial")) == ["config.json", MANIFEST_NAME]
    problems = store.verify(3)
    assert len(problems) == 1
    assert "model.safetensors" in problems[0] and "blake3 mismatch" in problems[0]


def test_truncated_file_reports_size_mismatch(store: CheckpointStore, make_ckpt: MakeCkpt) -> None:
    store.publish(3, str(make_ckpt("a")))
    store.fs.pipe_file(remote(store, 3, "config.json"), b"{}")
    assert store.verify(3) == [
        f"v000003/config.json: size mismatch (expected {store.manifest(3).files[0].size}, got 2)"
    ]


def test_missing_file_fails_pull_and_verify(
    store: CheckpointStore, make_ckpt: MakeCkpt, tmp_path: Path
) -> None:
    store.publish(2, str(make_ckpt("a")))
    store.fs.rm(remote(store, 2, "config.json"))
    cache = tmp_path / "cache"
    with pytest.raises(VerificationError, match=r"v000002/config\.json: missing from store"):
        store.pull(2, str(cache))
    assert "v000002" not in cache_entries(cache)
    assert store.verify(2) == ["v000002/config.json: missing from store"]


def test_pull_retries_a_transient_mismatch(
    store: CheckpointStore, make_ckpt: MakeCkpt, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store.link_local = False  # the rewrite is staged in fs.open, which a hard link does not call,
    monkeypatch.delattr(os, "copy_file_range", raising=False)  # nor a local store's kernel copy
    src = make_ckpt("a")
    store.publish(1, str(src))
    good = store.fs.cat_file(remote(store, 1, "model.safetensors"))
    store.fs.pipe_file(remote(store, 1, "model.safetensors"), b"half-written")
    real_open = store.fs.open
    opens = []

    def open_and_repair(path: str, mode: str = "rb", **kw: object):
        # The first read sees a rewrite in progress; the writer finishes before the retry.
        if path.endswith("model.safetensors") and mode == "rb":
            opens.append(path)
            if len(opens) == 2:
                store.fs.pipe_file(path, good)
        return real_open(path, mode, **kw)

    monkeypatch.setattr(store.fs, "open", open_and_repair)
    out = Path(store.pull(1, str(tmp_path / "cache")))
    assert len(opens) == 2
    assert (out / "model.safetensors").read_bytes() == (src / "model.safetensors").read_bytes()


def test_a_clients_index_error_mid_read_is_a_read_error_tried_again(
    store: CheckpointStore, make_ckpt: MakeCkpt, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """s3fs raises IndexError for a read timed out on its whole-file path (issue 46, F3): the pull
    takes it as a read error, fetches again from the bytes it has, and loads the version verified."""
    src = make_ckpt("a")
    store.publish(1, str(src))
    store.link_local = False  # streamed through fs.open, as from a remote store
    monkeypatch.delattr(os, "copy_file_range", raising=False)
    real_open = store.fs.open
    failed: list[str] = []

    def open_timing_out(path: str, mode: str = "rb", **kw: object) -> Any:
        handle = real_open(path, mode, **kw)
        if path.endswith("model.safetensors") and mode == "rb":
            read = handle.readinto

            def readinto(buffer: Any) -> int:
                if not failed:  # the first read timed out
                    failed.append("once")
                    raise IndexError("list index out of range")
                return read(buffer)

            handle.readinto = readinto
        return handle

    monkeypatch.setattr(store.fs, "open", open_timing_out)
    out = Path(store.pull(1, str(tmp_path / "cache")))
    assert failed == ["once"]
    assert (out / "model.safetensors").read_bytes() == (src / "model.safetensors").read_bytes()


def test_publish_existing_version_raises(store: CheckpointStore, make_ckpt: MakeCkpt) -> None:
    store.publish(1, str(make_ckpt("a")))
    first = store.manifest(1)
    with pytest.raises(StoreError, match="already published"):
        store.publish(1, str(make_ckpt("b")))
    assert store.manifest(1) == first
    assert store.verify(1) == []


def test_publish_overwrites_leftovers_of_failed_publish(
    store: CheckpointStore, make_ckpt: MakeCkpt, tmp_path: Path
) -> None:
    store.fs.makedirs(f"{store.root}/v000001", exist_ok=True)
    store.fs.pipe_file(remote(store, 1, "model.safetensors"), b"partial upload")
    src = make_ckpt("a")
    store.publish(1, str(src))
    out = Path(store.pull(1, str(tmp_path / "cache")))
    assert (out / "model.safetensors").read_bytes() == (src / "model.safetensors").read_bytes()


def test_republishing_a_pulled_dir_skips_its_manifest(
    store: CheckpointStore, make_ckpt: MakeCkpt, tmp_path: Path
) -> None:
    store.publish(1, str(make_ckpt("a")))
    pulled = store.pull(1, str(tmp_path / "cache"))
    other = CheckpointStore(str(tmp_path / "other"))
    m = other.publish(7, pulled, parent=1)
    assert MANIFEST_NAME not in [f.path for f in m.files]
    assert m.files == store.manifest(1).files
    assert other.verify(7) == []


def test_publish_empty_dir_raises(store: CheckpointStore, tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(StoreError, match="no files"):
        store.publish(0, str(tmp_path / "empty"))
    assert store.versions() == []


def test_delete_removes_version(store: CheckpointStore, make_ckpt: MakeCkpt) -> None:
    store.publish(1, str(make_ckpt("a")))
    store.publish(2, str(make_ckpt("b")))
    store.delete(1)
    assert store.versions() == [2]
    assert not store.fs.exists(f"{store.root}/v000001")
    with pytest.raises(StoreError, match="not found"):
        store.delete(1)


def test_retain_keeps_newest_and_protected(store: CheckpointStore, make_ckpt: MakeCkpt) -> None:
    for v in range(6):
        store.publish(v, str(make_ckpt(f"c{v}")))
    store.retention_grace_s = 0.0
    assert store.retain(keep_last=2, protect={1}) == [0, 2, 3]
    assert store.versions() == [1, 4, 5]
    assert store.retain(keep_last=5) == []
    with pytest.raises(ValueError):
        store.retain(keep_last=0)


def test_plain_path_and_file_url_are_the_same_store(
    make_ckpt: MakeCkpt, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "store"
    CheckpointStore(str(root)).publish(5, str(make_ckpt("a")))
    by_url = CheckpointStore(f"file://{root}/")
    assert by_url.url == f"file://{root}"
    assert by_url.versions() == [5]
    monkeypatch.chdir(tmp_path)
    relative = CheckpointStore("store")
    assert relative.versions() == [5]
    assert relative.verify(5) == []
    assert Path(relative.pull(5, str(tmp_path / "cache"))).is_dir()


def test_second_pull_uses_cache(store: CheckpointStore, make_ckpt: MakeCkpt, tmp_path: Path) -> None:
    src = make_ckpt("a")
    store.publish(4, str(src))
    cache = str(tmp_path / "cache")
    first = store.pull(4, cache)
    store.delete(4)
    assert store.pull(4, cache) == first
    assert Path(first, "model.safetensors").read_bytes() == (src / "model.safetensors").read_bytes()


def test_pull_loses_race_gracefully(
    store: CheckpointStore, make_ckpt: MakeCkpt, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store.publish(1, str(make_ckpt("a")))
    cache = tmp_path / "cache"
    real_download = store._download

    def download_while_other_process_finishes(version: int, entry: ManifestFile, path: str) -> None:
        winner = cache / "v000001"
        if not winner.exists():
            winner.mkdir(exist_ok=True)  # files download in parallel: both may get here
            (winner / "marker").write_text("other process")
        real_download(version, entry, path)

    monkeypatch.setattr(store, "_download", download_while_other_process_finishes)
    out = Path(store.pull(1, str(cache)))
    assert (out / "marker").read_text() == "other process"
    assert cache_entries(cache) == ["v000001"]


@pytest.mark.parametrize("bad", ["../escape", "sub/dir.bin", "..", ".", ""])
def test_manifest_file_path_must_be_a_flat_name(bad: str) -> None:
    with pytest.raises(ValidationError):
        ManifestFile(path=bad, size=1, sha256="0" * 64)


def test_local_pull_links_the_verified_files_and_outlives_the_store(make_ckpt: MakeCkpt, tmp_path: Path) -> None:
    store = CheckpointStore(str(tmp_path / "store"))
    src = make_ckpt("a")
    store.publish(1, str(src))
    out = Path(store.pull(1, str(tmp_path / "cache")))
    stored = Path(remote(store, 1, "model.safetensors"))
    assert (out / "model.safetensors").stat().st_ino == stored.stat().st_ino  # zero copy
    store.delete(1)  # retention: the cache keeps the bytes it verified
    assert (out / "model.safetensors").read_bytes() == (src / "model.safetensors").read_bytes()


def test_local_pull_copies_across_filesystems(
    make_ckpt: MakeCkpt, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def cross_device(src: str, dst: str) -> None:
        raise OSError(18, "Invalid cross-device link")  # EXDEV

    monkeypatch.setattr(store_mod.os, "link", cross_device)
    store = CheckpointStore(str(tmp_path / "store"))
    store.publish(1, str(make_ckpt("a")))
    out = Path(store.pull(1, str(tmp_path / "cache")))
    assert not store.link_local
    assert (out / "model.safetensors").stat().st_ino != Path(remote(store, 1, "model.safetensors")).stat().st_ino
    assert store.verify(1) == []


def test_local_pull_with_a_public_key_copies(make_ckpt: MakeCkpt, tmp_path: Path) -> None:
    # Whoever can write a store that needs signatures is not trusted with an inode the cache shares.
    key = Ed25519PrivateKey.generate()
    CheckpointStore(str(tmp_path / "store"), signing_key=key).publish(1, str(make_ckpt("a")))
    reader = CheckpointStore(str(tmp_path / "store"), public_key=key.public_key())
    assert not reader.link_local
    out = Path(reader.pull(1, str(tmp_path / "cache")))
    assert (out / "model.safetensors").stat().st_ino != Path(remote(reader, 1, "model.safetensors")).stat().st_ino


def test_handed_over_files_are_linked_into_a_local_store(make_ckpt: MakeCkpt, tmp_path: Path) -> None:
    store = CheckpointStore(str(tmp_path / "store"))
    src = make_ckpt("a")
    store.publish(1, str(src), hand_over=True)
    assert Path(remote(store, 1, "model.safetensors")).stat().st_ino == (src / "model.safetensors").stat().st_ino
    store.publish(2, str(make_ckpt("b")))  # not handed over: copied
    assert Path(remote(store, 2, "model.safetensors")).stat().st_nlink == 1
    assert store.verify(1) == [] and store.verify(2) == []
