"""`decentrl store ...` commands and the store section of the run config."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from decentrl.cli.main import app
from decentrl.config import ConfigError, StoreConfig, parse_config
from decentrl.store.checkpoints import CheckpointStore
from decentrl.store.signing import load_private_key, load_public_key

runner = CliRunner()


@pytest.fixture
def published(tmp_path: Path) -> Path:
    """A store holding versions 0 and 1 (unsigned)."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "model.safetensors").write_bytes(os.urandom(3000))
    (src / "config.json").write_text("{}")
    store = CheckpointStore(str(tmp_path / "store"))
    store.publish(0, str(src))
    store.publish(1, str(src), parent=0)
    return tmp_path / "store"


def test_ls_pull_and_verify_a_good_store(published: Path, tmp_path: Path) -> None:
    result = runner.invoke(app, ["store", "ls", str(published)])
    assert result.exit_code == 0
    assert "v000001  parent=0  files=2" in result.output and "unsigned" in result.output
    result = runner.invoke(app, ["store", "pull", f"file://{published}", "--dest", str(tmp_path / "dest")])
    assert result.exit_code == 0, result.output
    assert result.output.strip() == str(tmp_path / "dest" / "v000001")
    result = runner.invoke(app, ["store", "verify", str(published)])
    assert result.exit_code == 0 and "ok: 2 version(s) verified" in result.output


def test_verify_fails_naming_the_file(published: Path) -> None:
    path = published / "v000001" / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[7] ^= 1
    path.write_bytes(bytes(data))
    result = runner.invoke(app, ["store", "verify", str(published)])
    assert result.exit_code == 1
    assert "v000001/model.safetensors: blake3 mismatch" in result.output
    assert runner.invoke(app, ["store", "verify", str(published), "--version", "0"]).exit_code == 0
    result = runner.invoke(app, ["store", "verify", str(published), "--version", "5"])
    assert result.exit_code == 1 and "version 5 not found" in result.output


def test_keygen_then_unsigned_store_fails_verification(published: Path, tmp_path: Path) -> None:
    key, pub = tmp_path / "k", tmp_path / "k.pub"
    result = runner.invoke(app, ["store", "keygen", "--private-key", str(key), "--public-key", str(pub)])
    assert result.exit_code == 0, result.output
    load_private_key(str(key)), load_public_key(str(pub))
    again = runner.invoke(app, ["store", "keygen", "--private-key", str(key), "--public-key", str(pub)])
    assert again.exit_code == 2 and "already exists" in again.output

    result = runner.invoke(app, ["store", "verify", str(published), "--public-key", str(pub)])
    assert result.exit_code == 1
    assert "v000000/manifest.json: unsigned" in result.output
    result = runner.invoke(app, ["store", "pull", str(published), "--dest", str(tmp_path / "d"), "--public-key", str(pub)])
    assert result.exit_code == 1 and "v000001/manifest.json: unsigned" in result.output
    result = runner.invoke(app, ["store", "verify", str(published), "--public-key", str(tmp_path / "nope.pub")])
    assert result.exit_code == 2 and "cannot read public key" in result.output


def test_store_config_builds_s3_options() -> None:
    config = StoreConfig(
        url="s3://bucket/run", endpoint="http://minio:9000", region="eu-west-1",
        access_key_id="AK", secret_access_key="SK", storage_options={"client_kwargs": {"verify": False}, "anon": False},
    )
    assert config.fsspec_options() == {
        "anon": False,
        "client_kwargs": {"verify": False, "endpoint_url": "http://minio:9000", "region_name": "eu-west-1"},
        "key": "AK",
        "secret": "SK",
        # parallel_reads + download_concurrency; the stall bounds (stall_timeout_s, 3x for an answer)
        "config_kwargs": {"max_pool_connections": 36, "connect_timeout": 8.0, "read_timeout": 24.0},
    }
    # Unset fields leave the AWS environment in charge.
    assert StoreConfig(url="s3://bucket/run").fsspec_options() == {
        "config_kwargs": {"max_pool_connections": 36, "connect_timeout": 8.0, "read_timeout": 24.0},
    }


@pytest.mark.parametrize(
    ("store", "message"),
    [
        ({"url": "/tmp/x", "endpoint": "http://minio:9000"}, "endpoint apply to s3:// URLs only"),
        ({"url": "s3://b", "access_key_id": "AK"}, "access_key_id and secret_access_key together"),
        ({"shard_size_mb": 0}, "store.shard_size_mb"),
        ({"cache_max_gb": 0}, "store.cache_max_gb"),
    ],
)
def test_bad_store_config_is_refused(store: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_config({"store": store})


def test_store_from_config_loads_the_keys(tmp_path: Path) -> None:
    runner.invoke(app, ["store", "keygen", "--private-key", str(tmp_path / "k"), "--public-key", str(tmp_path / "k.pub")])
    config = StoreConfig(
        url=str(tmp_path / "store"), signing_key=str(tmp_path / "k"), public_key=str(tmp_path / "k.pub"),
        cache_max_gb=0.5, retention_grace_s=7, download_concurrency=3,
    )
    store = CheckpointStore.from_config(config)
    assert store.signing_key is not None and store.public_key is not None
    assert (store.cache_max_bytes, store.retention_grace_s, store.download_concurrency) == (2**29, 7, 3)


def test_verify_reads_older_sha256_versions_and_says_which_digest(tmp_path: Path) -> None:
    """Versions published before BLAKE3 list sha256 digests: still pulled and verified, and
    `store verify` names the digest of each version."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "model.safetensors").write_bytes(os.urandom(3000))
    CheckpointStore(str(tmp_path / "store"), digest="sha256").publish(0, str(src))
    CheckpointStore(str(tmp_path / "store")).publish(1, str(src), parent=0)
    reader = CheckpointStore(str(tmp_path / "store"), link_local=False)
    assert [entry.algorithm for entry in reader.manifest(0).files] == ["sha256"]
    assert [entry.algorithm for entry in reader.manifest(1).files] == ["blake3"]
    assert (Path(reader.pull(0, str(tmp_path / "cache"))) / "model.safetensors").read_bytes() == (src / "model.safetensors").read_bytes()
    result = runner.invoke(app, ["store", "verify", str(tmp_path / "store")])
    assert result.exit_code == 0, result.output
    assert "v000000  ok  (sha256)" in result.output and "v000001  ok  (blake3)" in result.output
    path = tmp_path / "store" / "v000000" / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[100] ^= 1
    path.write_bytes(bytes(data))
    result = runner.invoke(app, ["store", "verify", str(tmp_path / "store"), "--version", "0"])
    assert result.exit_code == 1 and "v000000/model.safetensors: sha256 mismatch" in result.output


def test_a_manifest_entry_needs_exactly_one_digest() -> None:
    from pydantic import ValidationError

    from decentrl.store.manifest import ManifestFile

    with pytest.raises(ValidationError, match="exactly one of blake3 and sha256"):
        ManifestFile(path="a", size=1)
    with pytest.raises(ValidationError, match="exactly one of blake3 and sha256"):
        ManifestFile(path="a", size=1, sha256="0" * 64, blake3="0" * 64)
