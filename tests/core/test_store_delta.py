"""Delta versions (decentrl/store/delta.py through CheckpointStore): published as deltas against the
version before, rebuilt and verified on pull, chained down to a key version, kept by retention,
and refused - naming the file, loading nothing - when a delta is truncated, forged or has no base.
On file:// (hard-linking and copying pulls) and on a real S3 protocol server (moto)."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import blake3
import numpy as np
import pytest
import zstandard

from decentrl.store import checkpoints as store_mod
from decentrl.store import signing
from decentrl.store.checkpoints import MANIFEST_NAME, CheckpointStore, SignatureError, VerificationError, signed_payload
from decentrl.store.delta import DELTA_SUFFIX, apply
from decentrl.store.manifest import ManifestFile
from decentrl.store.signing import load_private_key, load_public_key, write_keypair
from tests.core.test_store_s3 import endpoint  # noqa: F401 - the moto S3 server fixture

SHARD = 1024 * 1024 + 13
SHARDS = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]


@pytest.fixture(params=["local", "local-copy", pytest.param("s3", marks=pytest.mark.integration)])
def location(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, dict[str, object], bool]:
    """(url, storage options, link_local) of an empty store."""
    if request.param != "s3":
        return str(tmp_path / "store"), {}, request.param == "local"
    from tests.core.test_store_s3 import new_bucket_url

    server = request.getfixturevalue("endpoint")
    options = {"key": "testing", "secret": "testing", "client_kwargs": {"endpoint_url": server, "region_name": "us-east-1"}}
    return new_bucket_url(server), options, False


def open_store(location: tuple[str, dict[str, object], bool], **kwargs: object) -> CheckpointStore:
    url, options, link = location
    return CheckpointStore(url, options, link_local=link, **kwargs)  # type: ignore[arg-type]


@pytest.fixture(autouse=True)
def no_retry_sleep(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(store_mod, "_RETRY_DELAYS", (0.0, 0.0))


def versions_like_training(root: Path, count: int) -> list[Path]:
    """`count` checkpoint dirs: random shards, then each version changing ~1% of the bytes of the one before."""
    rng = np.random.default_rng(0)
    dirs = []
    for version in range(count):
        d = root / f"src{version}"
        d.mkdir(parents=True)
        for name in SHARDS:
            if version == 0:
                data = rng.integers(0, 256, SHARD, dtype=np.uint8)
            else:
                data = np.fromfile(dirs[-1] / name, dtype=np.uint8)
                where = rng.integers(0, SHARD, SHARD // 100)
                data[where] ^= rng.integers(1, 256, len(where), dtype=np.uint8)
            data.tofile(d / name)
        (d / "config.json").write_text(json.dumps({"version": version}))
        dirs.append(d)
    return dirs


def publish_chain(store: CheckpointStore, dirs: list[Path], full_every: int = 100, *, whole_keys: bool = False) -> None:
    """A delta against the version before, a key every `full_every`; with `whole_keys`, as the
    trainer's publisher does, each key after v0 stored whole and as deltas."""
    for version, d in enumerate(dirs):
        key = version % full_every == 0
        delta_from = None if version == 0 or (key and not whole_keys) else (version - 1, str(dirs[version - 1]))
        store.publish(version, str(d), parent=version - 1 if version else None, delta_from=delta_from, whole=key)


def same_files(pulled: str, source: Path) -> bool:
    names = sorted(p.name for p in source.iterdir())
    return sorted(n for n in os.listdir(pulled) if n != MANIFEST_NAME) == names and all(
        Path(pulled, n).read_bytes() == (source / n).read_bytes() for n in names
    )


def stored(store: CheckpointStore, version: int, name: str) -> str:
    return f"{store.root}/v{version:06d}/{name}"


def test_deltas_are_published_small_and_pulled_by_a_worker_holding_the_version_before(location, tmp_path: Path) -> None:
    store = open_store(location)
    dirs = versions_like_training(tmp_path, 4)
    publish_chain(store, dirs)
    assert store.manifest(0).delta_base is None
    for version in (1, 2, 3):
        manifest = store.manifest(version)
        assert manifest.delta_base == version - 1
        for entry in manifest.files:
            if entry.path in SHARDS:
                # The manifest lists the full file's size and digest, and the delta's own.
                assert entry.delta is not None and entry.size == SHARD
                assert entry.digest == blake3.blake3((dirs[version] / entry.path).read_bytes()).hexdigest()
                assert entry.delta.size < SHARD * 0.05
                assert not store.fs.exists(stored(store, version, entry.path))
                assert store.fs.size(stored(store, version, entry.path + DELTA_SUFFIX)) == entry.delta.size
            else:  # config.json, unchanged: a delta of a few bytes
                assert entry.delta is not None and entry.delta.size < 64
                assert entry.digest == blake3.blake3((dirs[version] / entry.path).read_bytes()).hexdigest()
        assert store.verify(version) == []
    worker = open_store(location)
    cache = tmp_path / "cache"
    for version, d in enumerate(dirs):
        assert same_files(worker.pull(version, str(cache)), d)
    assert sorted(os.listdir(cache)) == [f"v{v:06d}" for v in range(4)]  # no .delta, no partial left


def test_a_late_joining_worker_pulls_the_key_version_then_the_deltas(location, tmp_path: Path) -> None:
    store = open_store(location)
    dirs = versions_like_training(tmp_path, 6)
    publish_chain(store, dirs, full_every=3)  # keys: v0, v3
    assert [store.manifest(v).delta_base for v in range(6)] == [None, 0, 1, None, 3, 4]
    late = open_store(location)
    cache = tmp_path / "late"
    assert same_files(late.pull(5, str(cache)), dirs[5])
    # Its chain only: key v3, then v4, then v5 rebuilt from it; nothing of the older chain.
    assert sorted(os.listdir(cache)) == ["v000003", "v000004", "v000005"]


def test_a_chains_files_download_at_once_and_apply_in_order(location, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A late joiner's chain (key v0, deltas v1-v4): every version's files are in flight together
    (download_concurrency bounds them), each delta is applied only after its base is in the cache."""
    import threading

    store = open_store(location)
    dirs = versions_like_training(tmp_path, 5)
    publish_chain(store, dirs)
    late = open_store(location, download_concurrency=16)
    cache = tmp_path / "late"
    lock, flight, most, applied = threading.Lock(), [0], [0], []
    all_in = threading.Condition(lock)
    real_download, real_apply = late._download, store_mod.apply

    def download(version: int, entry: ManifestFile, local_path: str) -> None:
        with lock:
            flight[0] += 1
            most[0] = max(most[0], flight[0])
            all_in.notify_all()
            # A slow link: each download waits (up to 10 s, whatever the host's load) for the
            # chain's others, which come only if the pull submits every version's files at once.
            all_in.wait_for(lambda: most[0] >= 15, timeout=10.0)
        try:
            real_download(version, entry, local_path)
        finally:
            with lock:
                flight[0] -= 1

    def apply_(base: str, delta: bytes, entry: ManifestFile, out: str, where: str) -> object:
        assert os.path.isdir(os.path.dirname(base)), f"{where} applied before its base was in the cache"
        applied.append(where.split("/")[0])
        return real_apply(base, delta, entry, out, where)

    monkeypatch.setattr(late, "_download", download)
    monkeypatch.setattr(store_mod, "apply", apply_)
    assert same_files(late.pull(4, str(cache)), dirs[4])
    # 5 versions of 3 files each (every one a delta above v0): all in flight at once, not a version at a time.
    assert most[0] == 15, most[0]
    assert applied == sorted(applied) and list(dict.fromkeys(applied)) == ["v000001", "v000002", "v000003", "v000004"]
    assert len(applied) == 4 * 3


def test_a_corrupted_cache_falls_back_to_the_key_version(location, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = open_store(location)
    dirs = versions_like_training(tmp_path, 4)
    publish_chain(store, dirs)
    cache = tmp_path / "cache"
    for version in range(3):
        open_store(location).pull(version, str(cache))
    for version in range(3):  # every cached version of the chain damaged (a new worker process reads them)
        path = cache / f"v{version:06d}" / SHARDS[0]
        path.chmod(0o644)
        data = bytearray(path.read_bytes())
        data[1000] ^= 0xFF
        path.unlink()  # a new inode: a hard-linked store file is not touched
        path.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="decentrl.store.checkpoints"):
        assert same_files(open_store(location).pull(3, str(cache)), dirs[3])
    warned = {r.getMessage().split()[1] for r in caplog.records if "no longer matches its manifest" in r.getMessage()}
    assert warned == {str(cache / f"v{version:06d}") for version in range(3)}  # down to the key version v0
    for version in range(3):
        assert same_files(str(cache / f"v{version:06d}"), dirs[version])


def test_a_truncated_delta_is_refused_naming_the_file(location, tmp_path: Path) -> None:
    store = open_store(location)
    dirs = versions_like_training(tmp_path, 3)
    publish_chain(store, dirs)
    name = SHARDS[1] + DELTA_SUFFIX
    data = store.fs.cat_file(stored(store, 2, name))
    store.fs.rm(stored(store, 2, name))
    store.fs.pipe_file(stored(store, 2, name), data[: len(data) // 2])
    cache = tmp_path / "cache"
    with pytest.raises(VerificationError, match=rf"v000002/{SHARDS[1]}\.delta: size mismatch"):
        open_store(location).pull(2, str(cache))
    assert not (cache / "v000002").exists()  # nothing unverified in the cache
    assert [p for p in store.verify(2)] == [f"v000002/{name}: size mismatch (expected {len(data)}, got {len(data) // 2})"]
    assert same_files(open_store(location).pull(1, str(cache)), dirs[1])  # the versions before still pull


def test_a_delta_whose_base_is_missing_is_refused_naming_the_file(location, tmp_path: Path) -> None:
    store = open_store(location)
    dirs = versions_like_training(tmp_path, 3)
    publish_chain(store, dirs)
    store.delete(1)
    with pytest.raises(VerificationError, match=r"v000002/[\w.-]+: stored as a delta against v1, which is in neither"):
        open_store(location).pull(2, str(tmp_path / "cache"))
    assert not (tmp_path / "cache" / "v000002").exists()
    # The trainer's next version, whose base (v2) is still there, stays a delta; with v1 gone as
    # the base it would have had, the store publishes a key version instead.
    more = versions_like_training(tmp_path / "more", 1)[0]
    assert store.publish(3, str(more), parent=2, delta_from=(1, str(dirs[1]))).delta_base is None


def test_a_rebuilt_file_that_does_not_match_the_manifest_is_refused(location, tmp_path: Path) -> None:
    """A delta of the right size and digest for the manifest (an unsigned store: whoever can
    write it rewrote both) whose reconstruction is not the file the manifest lists."""
    store = open_store(location)
    dirs = versions_like_training(tmp_path, 2)
    publish_chain(store, dirs)
    other = zstandard.ZstdCompressor().compress(os.urandom(SHARD))
    manifest = json.loads(store.fs.cat_file(stored(store, 1, MANIFEST_NAME)))
    for entry in manifest["files"]:
        if entry["path"] == SHARDS[0]:
            entry["delta"] = {"size": len(other), "blake3": blake3.blake3(other).hexdigest()}
    store.fs.rm(stored(store, 1, SHARDS[0] + DELTA_SUFFIX))
    store.fs.pipe_file(stored(store, 1, SHARDS[0] + DELTA_SUFFIX), other)
    store.fs.pipe_file(stored(store, 1, MANIFEST_NAME), json.dumps(manifest).encode())
    with pytest.raises(VerificationError, match=rf"v000001/{SHARDS[0]}: rebuilt from its delta, the file does not match"):
        open_store(location).pull(1, str(tmp_path / "cache"))
    assert not (tmp_path / "cache" / "v000001").exists()


def test_a_forged_delta_is_refused_by_the_signature(location, tmp_path: Path) -> None:
    write_keypair(str(tmp_path / "k"), str(tmp_path / "k.pub"))
    trainer = open_store(location, signing_key=load_private_key(str(tmp_path / "k")), run_name="r")
    dirs = versions_like_training(tmp_path, 2)
    publish_chain(trainer, dirs)
    worker = open_store(location, public_key=load_public_key(str(tmp_path / "k.pub")), run_name="r")
    assert same_files(worker.pull(1, str(tmp_path / "good")), dirs[1])  # signed deltas pull
    # Bucket write access: a delta of other weights, with its size and digest fixed in the manifest.
    forged = zstandard.ZstdCompressor().compress(os.urandom(SHARD))
    manifest = json.loads(trainer.fs.cat_file(stored(trainer, 1, MANIFEST_NAME)))
    for entry in manifest["files"]:
        if entry["path"] == SHARDS[0]:
            entry["delta"] = {"size": len(forged), "blake3": blake3.blake3(forged).hexdigest()}
    write_keypair(str(tmp_path / "evil"), str(tmp_path / "evil.pub"))
    manifest["signature"] = signing.sign(load_private_key(str(tmp_path / "evil")), signed_payload(manifest))
    trainer.fs.rm(stored(trainer, 1, SHARDS[0] + DELTA_SUFFIX))
    trainer.fs.pipe_file(stored(trainer, 1, SHARDS[0] + DELTA_SUFFIX), forged)
    trainer.fs.pipe_file(stored(trainer, 1, MANIFEST_NAME), json.dumps(manifest).encode())
    cache = tmp_path / "fresh"
    with pytest.raises(SignatureError, match="v000001/manifest.json: signature does not match"):
        open_store(location, public_key=load_public_key(str(tmp_path / "k.pub")), run_name="r").pull(1, str(cache))
    assert not (cache / "v000001").exists()


def test_retention_keeps_every_version_a_chain_needs(location, tmp_path: Path) -> None:
    store = open_store(location, retention_grace_s=0)
    dirs = versions_like_training(tmp_path, 7)
    publish_chain(store, dirs, full_every=4)  # keys v0, v4; v5, v6 chain to v4
    assert store.retain(keep_last=1, now=1e12) == [0, 1, 2, 3]
    assert store.versions() == [4, 5, 6]
    assert same_files(open_store(location).pull(6, str(tmp_path / "cache")), dirs[6])


def fetched_names(store: CheckpointStore, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The stored names `store`'s pulls download (vNNNNNN/name), in order."""
    names: list[str] = []
    real = store._download

    def download(version: int, entry: ManifestFile, local_path: str) -> None:
        names.append(f"v{version:06d}/{entry.path}")
        real(version, entry, local_path)

    monkeypatch.setattr(store, "_download", download)
    return names


def holding(location, cache: Path, version: int, monkeypatch: pytest.MonkeyPatch) -> tuple[CheckpointStore, list[str]]:
    """A worker's store whose cache holds `version`, and the stored names its pulls fetch from then on."""
    store = open_store(location)
    store.pull(version, str(cache))
    return store, fetched_names(store, monkeypatch)


def test_a_whole_key_version_is_its_deltas_to_a_holder_and_whole_to_a_late_joiner(
    location, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A key version stored both ways (the trainer's, `whole`): a worker holding the version
    before fetches only its deltas; a late joiner fetches its whole files, nothing older; the
    chain after it ends at it."""
    store = open_store(location)
    dirs = versions_like_training(tmp_path, 6)
    publish_chain(store, dirs, full_every=3, whole_keys=True)  # keys v0 (alone), v3 (whole and deltas)
    assert [(store.manifest(v).delta_base, store.manifest(v).whole) for v in range(6)] == [
        (None, False), (0, False), (1, False), (2, True), (3, False), (4, False),
    ]
    for name in SHARDS:
        assert store.fs.size(stored(store, 3, name)) == SHARD
        assert store.fs.size(stored(store, 3, name + DELTA_SUFFIX)) < SHARD * 0.05
    assert store.verify(3) == []
    holder = open_store(location)
    cache = tmp_path / "holder"
    for version in range(3):
        holder.pull(version, str(cache))
    fetched = fetched_names(holder, monkeypatch)
    assert same_files(holder.pull(3, str(cache)), dirs[3])
    assert sorted(fetched) == sorted(f"v000003/{n}{DELTA_SUFFIX}" for n in [*SHARDS, "config.json"])
    late = open_store(location)
    fetched = fetched_names(late, monkeypatch)
    assert same_files(late.pull(5, str(tmp_path / "late")), dirs[5])
    assert sorted(n for n in fetched if n.startswith("v000003/")) == sorted(f"v000003/{n}" for n in [*SHARDS, "config.json"])
    assert sorted(os.listdir(tmp_path / "late")) == ["v000003", "v000004", "v000005"]
    assert all(not n.startswith(("v000000", "v000001", "v000002")) for n in fetched)


def test_a_holder_whose_cached_base_is_damaged_fetches_the_whole_key_version(location, tmp_path: Path) -> None:
    store = open_store(location)
    dirs = versions_like_training(tmp_path, 4)
    publish_chain(store, dirs, full_every=3, whole_keys=True)
    cache = tmp_path / "cache"
    open_store(location).pull(2, str(cache))
    path = cache / "v000002" / SHARDS[0]
    path.chmod(0o644)
    data = bytearray(path.read_bytes())
    data[10] ^= 0xFF
    path.unlink()
    path.write_bytes(bytes(data))
    assert same_files(open_store(location).pull(3, str(cache)), dirs[3])


def test_retention_lets_a_whole_key_versions_base_go(location, tmp_path: Path) -> None:
    store = open_store(location, retention_grace_s=0)
    dirs = versions_like_training(tmp_path, 7)
    publish_chain(store, dirs, full_every=4, whole_keys=True)  # v4 whole (delta base v3); v5, v6 chain to v4
    assert store.retain(keep_last=1, now=1e12) == [0, 1, 2, 3]
    assert same_files(open_store(location).pull(6, str(tmp_path / "cache")), dirs[6])


def test_a_damaged_whole_file_of_a_key_version_is_reported_and_refused(location, tmp_path: Path) -> None:
    store = open_store(location)
    dirs = versions_like_training(tmp_path, 4)
    publish_chain(store, dirs, full_every=3, whole_keys=True)
    data = store.fs.cat_file(stored(store, 3, SHARDS[1]))
    store.fs.rm(stored(store, 3, SHARDS[1]))
    store.fs.pipe_file(stored(store, 3, SHARDS[1]), data[:-1] + bytes([data[-1] ^ 1]))
    assert len(store.verify(3)) == 1 and store.verify(3)[0].startswith(f"v000003/{SHARDS[1]}: ")
    with pytest.raises(VerificationError, match=rf"v000003/{SHARDS[1]}"):
        open_store(location).pull(3, str(tmp_path / "late"))  # a late joiner fetches it whole
    holder = tmp_path / "holder"
    open_store(location).pull(2, str(holder))
    assert same_files(open_store(location).pull(3, str(holder)), dirs[3])  # a holder goes by the deltas


def test_a_manifest_marked_whole_without_deltas_is_refused() -> None:
    from decentrl.store.manifest import parse_manifest

    entry = {"path": "m.safetensors", "size": 3, "blake3": "0" * 64}
    raw = json.dumps({"version": 4, "parent": 3, "created_at": 1.0, "files": [entry], "whole": True}).encode()
    with pytest.raises(VerificationError, match="whole: .*set only where files are stored as deltas too"):
        parse_manifest(raw, "v000004/manifest.json")
    raw = json.dumps({"version": 4, "parent": 3, "created_at": 1.0, "files": [entry], "whole": "yes"}).encode()
    with pytest.raises(VerificationError, match="whole: Input should be a valid boolean"):
        parse_manifest(raw, "v000004/manifest.json")


def test_apply_refuses_a_delta_that_would_decompress_past_the_file(tmp_path: Path) -> None:
    base = tmp_path / "base"
    base.write_bytes(bytes(1000))
    entry = ManifestFile(path="m.safetensors", size=1000, blake3=blake3.blake3(bytes(1000)).hexdigest())
    bomb = zstandard.ZstdCompressor().compress(bytes(10**7))
    with pytest.raises(VerificationError, match="m.safetensors: the delta decompresses to more than 1000 bytes"):
        apply(str(base), bomb, entry, str(tmp_path / "out"), "v000001/m.safetensors")
    with pytest.raises(VerificationError, match="m.safetensors: the delta does not decompress"):
        apply(str(base), b"not zstd" * 10, entry, str(tmp_path / "out"), "v000001/m.safetensors")
    with pytest.raises(VerificationError, match="not 1000"):
        apply(str(base), zstandard.ZstdCompressor().compress(bytes(999)), entry, str(tmp_path / "out"), "v000001/m.safetensors")
    assert not (tmp_path / "out").exists()
    apply(str(base), zstandard.ZstdCompressor().compress(bytes(1000)), entry, str(tmp_path / "out"), "v1/m")
    assert (tmp_path / "out").read_bytes() == bytes(1000)



def test_a_worker_behind_a_key_version_fetches_the_deltas_from_what_it_holds(
    location, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker that fell behind across a key version (it holds v2, the newest is v5, v4 the key):
    v3's, v4's and v5's deltas are fewer bytes than v4's whole files, so those are what it fetches."""
    store = open_store(location)
    dirs = versions_like_training(tmp_path, 6)
    publish_chain(store, dirs, full_every=4, whole_keys=True)  # v4 whole and as deltas against v3
    behind, fetched = holding(location, tmp_path / "behind", 2, monkeypatch)
    assert same_files(behind.pull(5, str(tmp_path / "behind")), dirs[5])
    assert sorted(fetched) == sorted(f"v{v:06d}/{n}{DELTA_SUFFIX}" for v in (3, 4, 5) for n in [*SHARDS, "config.json"])


def test_a_chain_of_deltas_dearer_than_the_whole_key_version_is_not_taken(
    location, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = np.random.default_rng(1)
    dirs = []
    for version in range(5):  # every byte new each version: a delta is as large as its file
        d = tmp_path / f"src{version}"
        d.mkdir()
        for name in SHARDS:
            rng.integers(0, 256, SHARD, dtype=np.uint8).tofile(d / name)
        (d / "config.json").write_text(json.dumps({"version": version}))
        dirs.append(d)
    store = open_store(location)
    publish_chain(store, dirs, full_every=4, whole_keys=True)
    behind, fetched = holding(location, tmp_path / "behind", 2, monkeypatch)
    assert same_files(behind.pull(4, str(tmp_path / "behind")), dirs[4])
    assert sorted(fetched) == sorted(f"v000004/{n}" for n in [*SHARDS, "config.json"])


def test_a_chain_that_fails_falls_back_to_the_whole_key_version(
    location, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The chain was a choice: a link that fails (v3's delta damaged in the store) is a store error to
    retry, never a refusal of the key version, and the retry fetches the key version's whole files."""
    store = open_store(location)
    dirs = versions_like_training(tmp_path, 5)
    publish_chain(store, dirs, full_every=4, whole_keys=True)
    path = stored(store, 3, SHARDS[0] + DELTA_SUFFIX)
    damaged = bytearray(store.fs.cat_file(path))
    damaged[100] ^= 0xFF
    store.fs.rm(path)
    store.fs.pipe_file(path, bytes(damaged))
    behind, fetched = holding(location, tmp_path / "behind", 2, monkeypatch)
    with pytest.raises(store_mod.StoreError, match="v000004: its chain of deltas failed .* whole files are fetched next") as failed:
        behind.pull(4, str(tmp_path / "behind"))
    assert not isinstance(failed.value, VerificationError)
    fetched.clear()  # the retry's alone
    assert same_files(behind.pull(4, str(tmp_path / "behind")), dirs[4])
    assert sorted(fetched) == sorted(f"v000004/{n}" for n in [*SHARDS, "config.json"])


def test_a_late_joiners_chain_of_manifests_is_read_at_once(location, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A chain of 6 links below the version asked for: their manifests are read together, not one
    answer after another (each read here takes 50 ms)."""
    import threading
    import time

    store = open_store(location)
    dirs = versions_like_training(tmp_path, 7)
    publish_chain(store, dirs)  # v0 a key, v1-v6 deltas
    late = open_store(location)
    real, lock, reading, most = late._read_manifest_bytes, threading.Lock(), [0], [0]

    def slow_read(version: int) -> bytes:
        with lock:
            reading[0] += 1
            most[0] = max(most[0], reading[0])
        time.sleep(0.05)
        try:
            return real(version)
        finally:
            with lock:
                reading[0] -= 1

    monkeypatch.setattr(late, "_read_manifest_bytes", slow_read)
    assert same_files(late.pull(6, str(tmp_path / "late")), dirs[6])
    assert most[0] >= 5, most[0]  # v5 down to v0 at once (v6's read first, alone)


def test_files_a_version_shares_with_its_base_are_copied_not_fetched(
    location, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker holding the version before fetches only the files that changed: the tokenizer (the
    same bytes in every version) is copied from its cached base and checked, not asked of the store."""
    dirs = versions_like_training(tmp_path, 3)
    for d in dirs:
        (d / "tokenizer.json").write_text('{"model": "the same in every version"}')
    store = open_store(location)
    publish_chain(store, dirs)
    holder, fetched = holding(location, tmp_path / "holder", 1, monkeypatch)
    assert same_files(holder.pull(2, str(tmp_path / "holder")), dirs[2])
    assert sorted(fetched) == sorted(f"v000002/{n}{DELTA_SUFFIX}" for n in [*SHARDS, "config.json"])


def test_a_shared_file_whose_copy_does_not_match_is_fetched_as_its_delta(
    location, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    store = open_store(location)
    dirs = versions_like_training(tmp_path, 3)
    publish_chain(store, dirs)
    holder, fetched = holding(location, tmp_path / "holder", 1, monkeypatch)
    config = next(e for e in holder.manifest(2).files if e.path == "config.json")
    monkeypatch.setattr(holder, "_same_as_base", lambda manifest, cache_dir: [config])  # it differs from v1's
    with caplog.at_level(logging.WARNING):
        assert same_files(holder.pull(2, str(tmp_path / "holder")), dirs[2])
    assert "v2 config.json: not as its base's copy" in caplog.text
    assert sorted(fetched) == sorted(f"v000002/{n}{DELTA_SUFFIX}" for n in [*SHARDS, "config.json"])


def test_retention_reads_each_manifest_once_per_process(location, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Retention runs after every publish: it reads a version's manifest once (the publisher's own it
    knows), not every kept version's again each time; a version deleted by another process is forgotten."""
    store = open_store(location, retention_grace_s=3600)
    dirs = versions_like_training(tmp_path, 6)
    publish_chain(store, dirs[:4], full_every=3, whole_keys=True)  # v3 a key version, whole and as deltas
    reads: list[int] = []
    real = store._manifest_bytes
    monkeypatch.setattr(store, "_manifest_bytes", lambda version: reads.append(version) or real(version))
    assert store.retain(keep_last=1) == []  # within the grace: every version kept
    assert reads == []  # the four this process published
    other = open_store(location)
    other.publish(4, str(dirs[4]), parent=3, delta_from=(3, str(dirs[3])))
    assert store.retain(keep_last=1) == [] and reads == [4]
    assert store.retain(keep_last=1) == [] and reads == [4]
    assert store.retain(keep_last=1, now=1e12) == [0, 1, 2]  # past the grace; v4's chain ends at v3, whole
    assert reads == [4] and sorted(store._retention_read) == [3, 4]
