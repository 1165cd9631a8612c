"""The checkpoint store against a real S3-protocol server (moto's, on 127.0.0.1) through s3fs.

Covers what only an object store shows: listings that s3fs caches, ranged reads for resumes,
multipart uploads, and the same guarantees as on disk - verified, atomic, signed, retained safely.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import blake3
import pytest

from decentrl.store import checkpoints as store_mod
from decentrl.store import signing
from decentrl.store.checkpoints import (
    MANIFEST_NAME,
    CheckpointStore,
    SignatureError,
    StoreError,
    VerificationError,
    signed_payload,
)
from decentrl.store.signing import load_private_key, load_public_key, write_keypair

pytestmark = pytest.mark.integration  # a real S3 protocol server (moto) on loopback

SHARD = 2 * 1024 * 1024 + 5


@pytest.fixture(scope="module")
def endpoint() -> Iterator[str]:
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
def options(endpoint: str) -> dict[str, object]:
    return {"key": "testing", "secret": "testing", "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"}}


def new_bucket_url(endpoint: str) -> str:
    import boto3

    bucket = f"ckpt-{uuid.uuid4().hex[:12]}"
    client = boto3.client(
        "s3", endpoint_url=endpoint, aws_access_key_id="testing", aws_secret_access_key="testing", region_name="us-east-1"
    )
    client.create_bucket(Bucket=bucket)
    return f"s3://{bucket}/run"


def unreachable(url: str, options: dict[str, object]) -> CheckpointStore:
    """`url` through an endpoint nothing listens on (one attempt, 1 s connect timeout)."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{probe.getsockname()[1]}"
    return CheckpointStore(
        url,
        {**options, "client_kwargs": {"endpoint_url": dead, "region_name": "us-east-1"},
         "config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 1}},
    )


@pytest.fixture
def url(endpoint: str) -> str:
    return new_bucket_url(endpoint)


@pytest.fixture
def store(url: str, options: dict[str, object]) -> CheckpointStore:
    return CheckpointStore(url, options)


@pytest.fixture(autouse=True)
def no_retry_sleep(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(store_mod, "_RETRY_DELAYS", (0.0, 0.0))


@pytest.fixture
def keys(tmp_path: Path) -> tuple[str, str]:
    write_keypair(str(tmp_path / "trainer.key"), str(tmp_path / "trainer.pub"))
    return str(tmp_path / "trainer.key"), str(tmp_path / "trainer.pub")


def make_ckpt(tmp_path: Path, name: str, shards: int = 3, shard_bytes: int = SHARD) -> Path:
    d = tmp_path / "src" / name
    d.mkdir(parents=True)
    for i in range(1, shards + 1):
        (d / f"model-{i:05d}-of-{shards:05d}.safetensors").write_bytes(os.urandom(shard_bytes))
    (d / "model.safetensors.index.json").write_text(json.dumps({"shards": shards}))
    (d / "config.json").write_text(json.dumps({"name": name}))
    return d


def same_files(a: Path, b: Path) -> bool:
    names = sorted(p.name for p in a.iterdir() if p.name != MANIFEST_NAME)
    return names == sorted(p.name for p in b.iterdir() if p.name != MANIFEST_NAME) and all(
        (a / n).read_bytes() == (b / n).read_bytes() for n in names
    )


def test_publish_pull_verify(store: CheckpointStore, tmp_path: Path) -> None:
    src = make_ckpt(tmp_path, "a")
    manifest = store.publish(0, str(src))
    store.publish(1, str(make_ckpt(tmp_path, "b")), parent=0)
    assert store.versions() == [0, 1] and store.latest() == 1
    assert len(manifest.files) == 5
    for entry in manifest.files:
        assert entry.blake3 == blake3.blake3((src / entry.path).read_bytes()).hexdigest()
    assert store.verify(0) == [] and store.verify(1) == []
    out = Path(store.pull(0, str(tmp_path / "cache")))
    assert same_files(out, src)
    assert json.loads((out / MANIFEST_NAME).read_text())["version"] == 0


def test_flipped_byte_is_caught(store: CheckpointStore, tmp_path: Path) -> None:
    store.publish(3, str(make_ckpt(tmp_path, "a")))
    path = f"{store.root}/v000003/model-00002-of-00003.safetensors"
    data = bytearray(store.fs.cat_file(path))
    data[SHARD // 2] ^= 0x01
    store.fs.pipe_file(path, bytes(data))
    with pytest.raises(VerificationError, match=r"v000003/model-00002-of-00003\.safetensors: blake3 mismatch"):
        store.pull(3, str(tmp_path / "cache"))
    assert not (tmp_path / "cache" / "v000003").exists()
    problems = store.verify(3)
    assert len(problems) == 1 and problems[0].startswith("v000003/model-00002-of-00003.safetensors: blake3 mismatch")


def test_missing_shard_is_caught(store: CheckpointStore, tmp_path: Path) -> None:
    store.publish(2, str(make_ckpt(tmp_path, "a")))
    store.fs.rm(f"{store.root}/v000002/model-00003-of-00003.safetensors")
    with pytest.raises(VerificationError, match=r"v000002/model-00003-of-00003\.safetensors: missing from store"):
        store.pull(2, str(tmp_path / "cache"))
    assert not (tmp_path / "cache" / "v000002").exists()
    assert store.verify(2) == ["v000002/model-00003-of-00003.safetensors: missing from store"]


def test_version_without_manifest_does_not_exist(
    store: CheckpointStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = make_ckpt(tmp_path, "a")
    store.publish(0, str(src))
    # An upload that died before its manifest: every file there, no manifest.
    for f in src.iterdir():
        store.fs.put_file(str(f), f"{store.root}/v000001/{f.name}")
    assert store.versions() == [0]
    with pytest.raises(StoreError, match=r"version 1 not found .*published versions: \[0\]"):
        store.pull(1, str(tmp_path / "cache"))
    assert not (tmp_path / "cache").exists()

    # And publish writes the manifest only once every file is in place.
    present_at_manifest: list[bool] = []
    real_pipe = store.fs.pipe_file

    def pipe_file(path: str, data: bytes, **kwargs: object) -> None:
        if path.endswith(MANIFEST_NAME):
            store.fs.invalidate_cache()
            present_at_manifest.extend(store.fs.exists(f"{store.root}/v000002/{f.name}") for f in src.iterdir())
        real_pipe(path, data, **kwargs)

    monkeypatch.setattr(store.fs, "pipe_file", pipe_file)
    store.publish(2, str(src))
    assert present_at_manifest == [True] * 5


def test_retention_never_deletes_a_version_being_pulled(
    url: str, options: dict[str, object], tmp_path: Path
) -> None:
    trainer = CheckpointStore(url, options, retention_grace_s=60.0)
    worker = CheckpointStore(url, options, download_concurrency=1)
    srcs = {v: make_ckpt(tmp_path, f"c{v}") for v in range(4)}
    trainer.publish(0, str(srcs[0]))

    # The worker starts pulling version 0 and stalls after its first file (a slow link).
    downloading, resume = threading.Event(), threading.Event()
    real_download = worker._download

    def slow_download(*args: object) -> None:
        real_download(*args)
        downloading.set()
        assert resume.wait(timeout=60)

    worker._download = slow_download  # type: ignore[method-assign]
    outcome: dict[str, object] = {}

    def pull() -> None:
        try:
            outcome["path"] = worker.pull(0, str(tmp_path / "cache"))
        except StoreError as exc:
            outcome["error"] = exc

    puller = threading.Thread(target=pull)
    puller.start()
    try:
        assert downloading.wait(timeout=60)
        # Meanwhile the trainer publishes newer versions and applies retention after each.
        deleted = []
        for v in (1, 2, 3):
            trainer.publish(v, str(srcs[v]), parent=v - 1)
            deleted += trainer.retain(keep_last=1)
    finally:
        resume.set()
        puller.join(timeout=120)
    assert deleted == [] and trainer.versions() == [0, 1, 2, 3]  # all superseded < 60 s ago
    assert "error" not in outcome
    assert same_files(Path(str(outcome["path"])), srcs[0])

    # Once the grace period has passed, the superseded versions go.
    assert trainer.retain(keep_last=1, now=time.time() + 61) == [0, 1, 2]
    assert trainer.versions() == [3]


def test_without_grace_a_puller_fails_cleanly_and_never_sees_a_partial_version(
    url: str, options: dict[str, object], tmp_path: Path
) -> None:
    trainer = CheckpointStore(url, options, retention_grace_s=0.0)
    worker = CheckpointStore(url, options, download_concurrency=1)
    trainer.publish(0, str(make_ckpt(tmp_path, "a")))
    real_download = worker._download
    calls = []

    def download_then_retention_runs(*args: object) -> None:
        real_download(*args)
        if not calls:  # after the first file, the trainer moves on and deletes version 0
            trainer.publish(1, str(make_ckpt(tmp_path, "b")), parent=0)
            assert trainer.retain(keep_last=1) == [0]
        calls.append(args)

    worker._download = download_then_retention_runs  # type: ignore[method-assign]
    with pytest.raises(VerificationError, match="missing from store"):
        worker.pull(0, str(tmp_path / "cache"))
    assert not (tmp_path / "cache" / "v000000").exists()


def test_signatures_on_s3(url: str, options: dict[str, object], keys: tuple[str, str], tmp_path: Path) -> None:
    trainer = CheckpointStore(url, options, signing_key=load_private_key(keys[0]))
    worker = CheckpointStore(url, options, public_key=load_public_key(keys[1]))
    unsigned = CheckpointStore(url, options)
    src = make_ckpt(tmp_path, "a")
    trainer.publish(0, str(src))
    assert worker.verify(0) == []
    assert same_files(Path(worker.pull(0, str(tmp_path / "cache"))), src)

    unsigned.publish(1, str(src))  # write access to the bucket, but not the key
    with pytest.raises(SignatureError, match=r"v000001/manifest\.json: unsigned"):
        worker.pull(1, str(tmp_path / "cache"))

    # A bad signature: the signed manifest of version 0, its signature mangled.
    manifest = json.loads(trainer.fs.cat_file(f"{trainer.root}/v000000/{MANIFEST_NAME}"))
    manifest["signature"] = manifest["signature"][:-10] + "AAAAAAAA=="  # well formed, wrong bytes
    trainer.fs.pipe_file(f"{trainer.root}/v000000/{MANIFEST_NAME}", json.dumps(manifest).encode())
    assert "signature does not match" in worker.verify(0)[0]

    # A forged version: new weights with the right digest in the manifest, signed by another key.
    trainer.publish(2, str(src))
    forged = os.urandom(SHARD)
    name = "model-00001-of-00003.safetensors"
    trainer.fs.pipe_file(f"{trainer.root}/v000002/{name}", forged)
    manifest = json.loads(trainer.fs.cat_file(f"{trainer.root}/v000002/{MANIFEST_NAME}"))
    for entry in manifest["files"]:
        if entry["path"] == name:
            entry["blake3"] = blake3.blake3(forged).hexdigest()
    write_keypair(str(tmp_path / "attacker.key"), str(tmp_path / "attacker.pub"))
    manifest["signature"] = signing.sign(load_private_key(str(tmp_path / "attacker.key")), signed_payload(manifest))
    trainer.fs.pipe_file(f"{trainer.root}/v000002/{MANIFEST_NAME}", json.dumps(manifest).encode())
    assert unsigned.verify(2) == []  # every hash matches: only the signature gives it away
    with pytest.raises(SignatureError, match="does not match the configured public key"):
        worker.pull(2, str(tmp_path / "cache"))
    assert sorted(p for p in os.listdir(tmp_path / "cache") if not p.startswith(".")) == ["v000000"]


def test_interrupted_download_resumes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A file the whole-file stream carries: a remote store's other than S3, 256 KiB or less (every
    # file of S3, and larger ones elsewhere, go by ranges, whose resume tests/core/test_store_ranges.py covers).
    store = CheckpointStore(f"memory://stream-{uuid.uuid4().hex[:8]}/run")
    small = 200_000
    src = make_ckpt(tmp_path, "a", shards=1, shard_bytes=small)
    store.publish(0, str(src))
    name = "model-00001-of-00001.safetensors"
    real_open = store.fs.open
    budget, seeks = [small // 3], []

    class Dropping:
        """The S3 file, but the connection drops once `budget` bytes have come through."""

        def __init__(self, f) -> None:  # noqa: ANN001 - an s3fs file
            self.f = f

        def __enter__(self) -> Dropping:
            return self

        def __exit__(self, *exc: object) -> None:
            self.f.close()

        def seek(self, offset: int) -> int:
            seeks.append(offset)
            return self.f.seek(offset)

        def readinto(self, buffer: memoryview) -> int:
            if budget[0] <= 0:
                raise ConnectionResetError("connection reset by peer")
            n = self.f.readinto(memoryview(buffer)[: budget[0]])
            budget[0] -= n
            return n

    def open_(path: str, mode: str = "rb", **kwargs: object):  # noqa: ANN202 - a file-like
        f = real_open(path, mode, **kwargs)
        return Dropping(f) if path.endswith(name) else f

    monkeypatch.setattr(store.fs, "open", open_)
    with pytest.raises(StoreError, match="download failed"):
        store.pull(0, str(tmp_path / "cache"))
    partial = tmp_path / "cache" / ".v000000.partial" / name
    assert partial.stat().st_size == small // 3

    budget[0] = 10 * small  # the link is back
    out = Path(store.pull(0, str(tmp_path / "cache")))
    assert seeks[-1] == small // 3  # a ranged read from where it stopped
    assert 10 * small - budget[0] == small - small // 3
    assert same_files(out, src)


def test_cache_cap_evicts_oldest(url: str, options: dict[str, object], tmp_path: Path) -> None:
    store = CheckpointStore(url, options, cache_max_bytes=int(2.5 * 3 * SHARD))
    for v in range(4):
        store.publish(v, str(make_ckpt(tmp_path, f"c{v}")))
    cache = tmp_path / "cache"
    for v in range(4):
        store.pull(v, str(cache))
    assert sorted(os.listdir(cache)) == ["v000002", "v000003"]


def test_cache_of_another_bucket_is_replaced_and_served_while_s3_is_down(
    endpoint: str, options: dict[str, object], tmp_path: Path
) -> None:
    run_a, run_b = (CheckpointStore(new_bucket_url(endpoint), options) for _ in range(2))
    src_a, src_b = make_ckpt(tmp_path, "a"), make_ckpt(tmp_path, "b")
    run_a.publish(2, str(src_a))
    run_b.publish(2, str(src_b))
    cache = str(tmp_path / "cache")
    assert same_files(Path(run_a.pull(2, cache)), src_a)
    out = run_b.pull(2, cache)  # same number, another run: not A's weights
    assert same_files(Path(out), src_b)
    down = unreachable(run_b.url, options)
    assert down.pull(2, cache) == out  # kept generating with the cached version
    assert same_files(Path(out), src_b)
    with pytest.raises(StoreError, match="check the store is reachable"):
        down.pull(3, cache)  # botocore's connection error, reported as a StoreError


def test_cli_verify_exit_code_names_the_file(store: CheckpointStore, endpoint: str, tmp_path: Path) -> None:
    store.publish(0, str(make_ckpt(tmp_path, "a")))
    # The CLI takes s3 settings from the usual AWS environment.
    env = os.environ | {
        "AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    command = [sys.executable, "-m", "decentrl", "store", "verify", store.url]
    ok = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert "ok: 1 version(s) verified" in ok.stdout
    path = f"{store.root}/v000000/model-00001-of-00003.safetensors"
    store.fs.pipe_file(path, store.fs.cat_file(path)[:-1])
    bad = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1
    assert "v000000/model-00001-of-00003.safetensors: size mismatch" in bad.stderr


def test_s3_outage_mid_pull_and_listing_are_store_errors(
    store: CheckpointStore, options: dict[str, object], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Callers catch StoreError (the worker's swapper retries on it), never botocore's own errors."""
    from botocore.exceptions import EndpointConnectionError

    store.publish(1, str(make_ckpt(tmp_path, "a")))
    down = unreachable(store.url, options)
    with pytest.raises(StoreError, match=f"listing versions in {store.url} failed.*check the store is reachable"):
        down.versions()
    # The manifest arrives, then the endpoint goes away while the files stream: s3fs raises
    # botocore's EndpointConnectionError there, which is not an OSError.
    attempts = []

    def endpoint_gone(remote: str, local_path: str, expected_size: int, algorithm: str) -> tuple[int, str]:
        attempts.append(remote)
        raise EndpointConnectionError(endpoint_url="http://127.0.0.1:1")

    monkeypatch.setattr(store, "_fetch_resuming", endpoint_gone)
    with pytest.raises(StoreError, match="download failed .*check the store is reachable"):
        store.pull(1, str(tmp_path / "cache"))
    tries = {remote: attempts.count(remote) for remote in attempts}  # files are fetched in parallel
    assert set(tries.values()) == {len(store_mod._RETRY_DELAYS) + 1}  # each retried, then reported
