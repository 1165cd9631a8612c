"""Signed manifests: a configured public key refuses unsigned, wrongly signed and forged versions."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import blake3
import pytest

from decentrl.store import signing
from decentrl.store.checkpoints import (
    MANIFEST_NAME,
    CheckpointStore,
    SignatureError,
    VerificationError,
    signed_payload,
    version_dirname,
)
from decentrl.store.signing import SigningKeyError, load_private_key, load_public_key, write_keypair


@pytest.fixture
def keys(tmp_path: Path) -> tuple[str, str]:
    write_keypair(str(tmp_path / "trainer.key"), str(tmp_path / "trainer.pub"))
    return str(tmp_path / "trainer.key"), str(tmp_path / "trainer.pub")


@pytest.fixture
def other_keys(tmp_path: Path) -> tuple[str, str]:
    write_keypair(str(tmp_path / "attacker.key"), str(tmp_path / "attacker.pub"))
    return str(tmp_path / "attacker.key"), str(tmp_path / "attacker.pub")


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    d = tmp_path / "ckpt"
    d.mkdir()
    (d / "model.safetensors").write_bytes(os.urandom(4000))
    (d / "config.json").write_text('{"hidden_size": 16}')
    return d


def stores(root: Path, keys: tuple[str, str]) -> tuple[CheckpointStore, CheckpointStore]:
    """(trainer, worker): the trainer signs with the private key, the worker checks with the public one."""
    trainer = CheckpointStore(str(root), signing_key=load_private_key(keys[0]))
    worker = CheckpointStore(str(root), public_key=load_public_key(keys[1]))
    return trainer, worker


def test_keygen_writes_a_private_key_only_its_owner_reads(keys: tuple[str, str]) -> None:
    assert stat.S_IMODE(os.stat(keys[0]).st_mode) == 0o600
    assert b"PRIVATE KEY" in Path(keys[0]).read_bytes()
    assert b"PUBLIC KEY" in Path(keys[1]).read_bytes()
    with pytest.raises(SigningKeyError, match="already exists"):
        write_keypair(keys[0], keys[1] + ".new")


def test_bad_key_files_name_the_file(tmp_path: Path, keys: tuple[str, str]) -> None:
    with pytest.raises(SigningKeyError, match="cannot read public key .*missing.pub"):
        load_public_key(str(tmp_path / "missing.pub"))
    (tmp_path / "junk.pub").write_text("not a key")
    with pytest.raises(SigningKeyError, match="junk.pub: not a PEM public key"):
        load_public_key(str(tmp_path / "junk.pub"))
    with pytest.raises(SigningKeyError, match="not a PEM private key"):
        load_private_key(keys[1])  # the public half where the private key belongs


def test_signed_version_pulls_and_verifies(tmp_path: Path, keys: tuple[str, str], ckpt: Path) -> None:
    trainer, worker = stores(tmp_path / "store", keys)
    published = trainer.publish(1, str(ckpt))
    assert published.signature is not None and published.signature.startswith("ed25519:")
    assert worker.manifest(1) == published
    assert worker.verify(1) == []
    out = Path(worker.pull(1, str(tmp_path / "cache")))
    assert (out / "model.safetensors").read_bytes() == (ckpt / "model.safetensors").read_bytes()


def test_unsigned_version_is_refused_when_a_key_is_configured(
    tmp_path: Path, keys: tuple[str, str], ckpt: Path
) -> None:
    CheckpointStore(str(tmp_path / "store")).publish(1, str(ckpt))
    _, worker = stores(tmp_path / "store", keys)
    with pytest.raises(SignatureError, match=r"v000001/manifest\.json: unsigned"):
        worker.pull(1, str(tmp_path / "cache"))
    assert not (tmp_path / "cache" / "v000001").exists()
    assert worker.verify(1) == [
        "v000001/manifest.json: unsigned, and a public key is configured; refusing the version"
    ]
    # Without a key, unsigned stores keep working.
    assert CheckpointStore(str(tmp_path / "store")).verify(1) == []


def test_version_signed_by_another_key_is_refused(
    tmp_path: Path, keys: tuple[str, str], other_keys: tuple[str, str], ckpt: Path
) -> None:
    attacker, _ = stores(tmp_path / "store", other_keys)
    attacker.publish(1, str(ckpt))
    _, worker = stores(tmp_path / "store", keys)
    with pytest.raises(SignatureError, match="does not match the configured public key"):
        worker.pull(1, str(tmp_path / "cache"))
    assert not (tmp_path / "cache" / "v000001").exists()


def forge(store_root: Path, version: int, new_weights: bytes) -> dict[str, object]:
    """Bucket write access only: swap the weights and fix their size and digest in the manifest."""
    vdir = store_root / version_dirname(version)
    (vdir / "model.safetensors").write_bytes(new_weights)
    manifest = json.loads((vdir / MANIFEST_NAME).read_text())
    for entry in manifest["files"]:
        if entry["path"] == "model.safetensors":
            entry.update(size=len(new_weights), blake3=blake3.blake3(new_weights).hexdigest())
    (vdir / MANIFEST_NAME).write_text(json.dumps(manifest))
    return manifest


def test_forged_manifest_is_refused(tmp_path: Path, keys: tuple[str, str], other_keys: tuple[str, str], ckpt: Path) -> None:
    root = tmp_path / "store"
    trainer, worker = stores(root, keys)
    trainer.publish(1, str(ckpt))
    forged = os.urandom(4000)
    manifest = forge(root, 1, forged)  # keeps the trainer's signature of the old content
    # Every digest matches the forged bytes: without a key the forgery would pass.
    assert CheckpointStore(str(root)).verify(1) == []
    with pytest.raises(SignatureError, match="does not match"):
        worker.pull(1, str(tmp_path / "cache"))

    # Re-signing the forged manifest needs the trainer's key; another key does not do.
    manifest["signature"] = signing.sign(load_private_key(other_keys[0]), signed_payload(manifest))
    (root / "v000001" / MANIFEST_NAME).write_text(json.dumps(manifest))
    with pytest.raises(SignatureError, match="does not match"):
        worker.pull(1, str(tmp_path / "cache"))
    manifest["signature"] = "ed25519:not-base64!"
    (root / "v000001" / MANIFEST_NAME).write_text(json.dumps(manifest))
    assert "signature: String should match pattern" in worker.verify(1)[0]  # malformed: refused at parse
    assert not (tmp_path / "cache" / "v000001").exists()


def test_signed_manifest_replayed_under_another_version_is_refused(
    tmp_path: Path, keys: tuple[str, str], ckpt: Path
) -> None:
    root = tmp_path / "store"
    trainer, worker = stores(root, keys)
    trainer.publish(1, str(ckpt))
    # An attacker copies the old, validly signed version 1 in as "version 7".
    (root / "v000007").mkdir()
    for f in (root / "v000001").iterdir():
        (root / "v000007" / f.name).write_bytes(f.read_bytes())
    with pytest.raises(VerificationError, match=r"v000007/manifest\.json: describes version 1, not 7"):
        worker.pull(7, str(tmp_path / "cache"))


def test_corrupt_manifest_is_a_verification_error(tmp_path: Path, ckpt: Path) -> None:
    store = CheckpointStore(str(tmp_path / "store"))
    store.publish(2, str(ckpt))
    (tmp_path / "store" / "v000002" / MANIFEST_NAME).write_text('{"version": 2, "files": "oops"')
    with pytest.raises(VerificationError, match=r"v000002/manifest\.json: not a valid manifest"):
        store.pull(2, str(tmp_path / "cache"))
    assert store.verify(2)[0].startswith("v000002/manifest.json: not a valid manifest")
