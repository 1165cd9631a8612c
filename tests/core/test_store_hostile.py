"""The store and the pull cache against hostile bytes: manifests, oversize objects, symlinks
planted in the cache, cached versions tampered with or from another run, and weight files
planted beside a version's own."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from safetensors.torch import save_file

from decentrl.config import TinyModelConfig
from decentrl.model.build import build_model, build_tiny_tokenizer
from decentrl.store import cache as cache_mod
from decentrl.store import signing
from decentrl.store.checkpoints import (
    MANIFEST_NAME,
    CheckpointStore,
    SignatureError,
    VerificationError,
    signed_payload,
)
from decentrl.store.weights import CheckpointError, write_hf_dir
from workers.backends.hf import HFBackend

TINY = TinyModelConfig(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64)


def make_ckpt(tmp_path: Path, name: str, size: int = 5000) -> Path:
    directory = tmp_path / f"ckpt-{name}"
    directory.mkdir()
    (directory / "model.safetensors").write_bytes(os.urandom(size))
    (directory / "config.json").write_text(json.dumps({"name": name}))
    return directory


def manifest_path(root: Path, version: int) -> Path:
    return root / f"v{version:06d}" / MANIFEST_NAME


@pytest.mark.parametrize(
    ("raw", "detail"),
    [
        (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
        (b"\xff\xfe not utf-8", "not a valid manifest"),
        (b'{"version": 1, "parent": 0, "created_at": 1, "files": [' + b'{"path": "a", "size": 1, "sha256": "' + b"0" * 64 + b'"}]'
         + b', "signature": "ed25519:' + "é".encode() * 86 + b'=="}', "signature"),
        (json.dumps({"version": True, "parent": 0, "created_at": 1, "files": []}).encode(), "version"),
        (json.dumps({"version": 1, "parent": 0, "created_at": 1, "files": []}).encode(), "files"),
        (json.dumps({"version": 1, "parent": 0, "created_at": 1,
                     "files": [{"path": "model\x00.safetensors", "size": 1, "sha256": "0" * 64}]}).encode(), "files.0.path"),
        (json.dumps({"version": 1, "parent": 0, "created_at": 1,
                     "files": [{"path": "a", "size": "1", "sha256": "0" * 64}]}).encode(), "files.0.size"),
        (json.dumps({"version": 1, "parent": 0, "created_at": 1,
                     "files": [{"path": "manifest.json", "size": 1, "sha256": "0" * 64}]}).encode(), "cannot be one"),
        (json.dumps({"version": 1, "parent": 0, "created_at": 1, "files": [
            {"path": "a", "size": 1, "sha256": "0" * 64}, {"path": "a", "size": 1, "sha256": "0" * 64}]}).encode(), "twice"),
        (b'{"version": 1, "parent": 0, "created_at": 1, "files": [], "x": ' + b"9" * 5000 + b"}", "not a valid manifest"),
        (b'["a list"]', "not a valid manifest"),
        (b" " * (1024 * 1024 + 10) + b"{}", "larger than"),
    ],
    ids=["deep", "utf8", "signature", "bool", "no-files", "nul", "str-size", "self", "twice", "bigint", "list", "oversize"],
)
def test_any_bad_manifest_is_a_verification_error_naming_the_file(tmp_path: Path, raw: bytes, detail: str) -> None:
    store = CheckpointStore(str(tmp_path / "store"))
    store.publish(1, str(make_ckpt(tmp_path, "a")))
    manifest_path(tmp_path / "store", 1).write_bytes(raw)
    for reader in (store, CheckpointStore(store.url, public_key=Ed25519PrivateKey.generate().public_key())):
        with pytest.raises(VerificationError, match=r"v000001/manifest\.json: .*") as caught:
            reader.pull(1, str(tmp_path / "cache"))
        assert detail in str(caught.value)
        assert reader.verify(1)[0].startswith("v000001/manifest.json")


def test_signatures_bind_the_run(tmp_path: Path) -> None:
    key = Ed25519PrivateKey.generate()
    CheckpointStore(str(tmp_path / "a"), signing_key=key, run_name="run-a").publish(1, str(make_ckpt(tmp_path, "a")))
    bound = CheckpointStore(str(tmp_path / "a"), public_key=key.public_key(), run_name="run-b")
    with pytest.raises(SignatureError, match="signed for run 'run-a', not for run 'run-b'"):
        bound.pull(1, str(tmp_path / "cache"))
    assert CheckpointStore(str(tmp_path / "a"), public_key=key.public_key(), run_name="run-a").manifest(1).run == "run-a"
    # The run is signed: rewriting it breaks the signature.
    path = manifest_path(tmp_path / "a", 1)
    path.write_text(json.dumps({**json.loads(path.read_text()), "run": "run-b"}))
    with pytest.raises(SignatureError, match="does not match"):
        bound.pull(1, str(tmp_path / "cache"))


def test_manifests_signed_before_runs_were_named_verify_only_for_a_reader_without_a_run(tmp_path: Path) -> None:
    key = Ed25519PrivateKey.generate()
    store = CheckpointStore(str(tmp_path / "s"))
    store.publish(1, str(make_ckpt(tmp_path, "a")))
    path = manifest_path(tmp_path / "s", 1)
    old = json.loads(path.read_text())
    del old["run"]  # the earlier format: no run field, the signature over the rest
    old["signature"] = signing.sign(key, signed_payload(old))
    path.write_text(json.dumps(old))
    assert CheckpointStore(store.url, public_key=key.public_key()).verify(1) == []
    with pytest.raises(SignatureError, match="signed for no run"):
        CheckpointStore(store.url, public_key=key.public_key(), run_name="demo").pull(1, str(tmp_path / "cache"))


def test_a_cached_version_is_served_through_an_outage_only_once_verified_again(tmp_path: Path) -> None:
    """The issue's case: a cache holding another run's unsigned v150 was loaded as v150 while the
    store could not answer. Now the cached manifest's signature, run and files are checked."""
    key = Ed25519PrivateKey.generate()
    cache = str(tmp_path / "cache")
    CheckpointStore(str(tmp_path / "other")).publish(150, str(make_ckpt(tmp_path, "other")))
    CheckpointStore(str(tmp_path / "other")).pull(150, cache)
    worker = CheckpointStore(str(tmp_path / "gone"), public_key=key.public_key(), run_name="ours")
    with pytest.raises(SignatureError, match=r"cached .*v000150/manifest\.json: unsigned"):
        worker.pull(150, cache)

    signed_other_run = CheckpointStore(str(tmp_path / "other2"), signing_key=key, run_name="theirs")
    signed_other_run.publish(151, str(make_ckpt(tmp_path, "other2")))
    signed_other_run.pull(151, cache)
    with pytest.raises(SignatureError, match="signed for run 'theirs'"):
        worker.pull(151, cache)

    ours = CheckpointStore(str(tmp_path / "ours"), signing_key=key, run_name="ours")
    src = make_ckpt(tmp_path, "ours")
    ours.publish(152, str(src))
    reader = CheckpointStore(str(tmp_path / "ours"), public_key=key.public_key(), run_name="ours")
    out = Path(reader.pull(152, cache))
    os.rename(tmp_path / "ours", tmp_path / "ours.away")  # the store cannot answer
    assert reader.pull(152, cache) == str(out)
    data = bytearray((out / "model.safetensors").read_bytes())
    data[0] ^= 1
    (out / "model.safetensors").write_bytes(bytes(data))  # corrupted in the cache after a good pull
    with pytest.raises(VerificationError, match="blake3 mismatch.*store cannot be read"):
        reader.pull(152, cache)
    os.rename(tmp_path / "ours.away", tmp_path / "ours")
    assert (Path(reader.pull(152, cache)) / "model.safetensors").read_bytes() == (src / "model.safetensors").read_bytes()


def test_a_cache_hit_rehashes_only_files_whose_identity_moved(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = CheckpointStore(str(tmp_path / "store"), link_local=False)
    store.publish(1, str(make_ckpt(tmp_path, "a")))
    cache = str(tmp_path / "cache")
    out = Path(store.pull(1, cache))
    hashed: list[int] = []
    real = cache_mod.copy_hashing
    monkeypatch.setattr(cache_mod, "copy_hashing", lambda *a, **k: hashed.append(1) or real(*a, **k))
    store.pull(1, cache)
    assert hashed == []  # verified by this process when it was written: identity unchanged
    CheckpointStore(store.url).pull(1, cache)  # another process (a restart) knows nothing: hashes all
    assert len(hashed) == 2
    hashed.clear()
    os.utime(out / "model.safetensors", ns=(0, 0))  # mtime set back; ctime moves regardless
    store.pull(1, cache)
    assert len(hashed) == 1


def test_the_cache_never_follows_a_symlink_it_did_not_make(tmp_path: Path) -> None:
    store = CheckpointStore(str(tmp_path / "store"), link_local=False)
    src = make_ckpt(tmp_path, "a")
    store.publish(1, str(src))
    cache = tmp_path / "cache"
    cache.mkdir()
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    victim_dir = tmp_path / "victim-dir"
    victim_dir.mkdir()
    # A resumed partial whose file is a symlink, and the lock file a symlink too.
    partial = cache / ".v000001.partial"
    partial.mkdir()
    (partial / MANIFEST_NAME).write_bytes(manifest_path(tmp_path / "store", 1).read_bytes())
    (partial / "model.safetensors").symlink_to(victim)
    (cache / ".v000001.lock").symlink_to(victim)
    out = Path(store.pull(1, str(cache)))
    assert victim.read_bytes() == b"precious"
    assert (out / "model.safetensors").read_bytes() == (src / "model.safetensors").read_bytes()
    assert not (out / "model.safetensors").is_symlink()
    # A partial directory that is a symlink, and a "cached version" that is a symlink to a foreign directory.
    store.publish(2, str(make_ckpt(tmp_path, "b")))
    (cache / ".v000002.partial").symlink_to(victim_dir)
    out = Path(store.pull(2, str(cache)))
    assert os.listdir(victim_dir) == [] and not out.is_symlink()
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    store.publish(3, str(make_ckpt(tmp_path, "c")))
    (foreign / MANIFEST_NAME).write_bytes(manifest_path(tmp_path / "store", 3).read_bytes())
    (foreign / "model.safetensors").write_bytes(b"forged")
    (cache / "v000003").symlink_to(foreign)
    out = Path(store.pull(3, str(cache)))
    assert not out.is_symlink() and (out / "model.safetensors").read_bytes() != b"forged"
    assert (foreign / "model.safetensors").read_bytes() == b"forged"


@pytest.mark.parametrize("copy", ["kernel", "stream"])
def test_a_download_stops_at_the_declared_size(copy: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("decentrl.store.checkpoints._RETRY_DELAYS", (0.0, 0.0))
    if copy == "stream":  # a local store where the kernel cannot copy streams through fs.open
        monkeypatch.delattr(os, "copy_file_range", raising=False)
    store = CheckpointStore(str(tmp_path / "store"), link_local=False)
    store.publish(1, str(make_ckpt(tmp_path, "a", size=4096)))
    (tmp_path / "store" / "v000001" / "model.safetensors").write_bytes(os.urandom(26 * 1024 * 1024))
    read: list[int] = []

    def counting(name: str) -> Callable[..., object]:
        real = getattr(cache_mod, name)

        def count(*args: object, **kwargs: object) -> object:
            result = real(*args, **kwargs)
            read.append(result if isinstance(result, int) else result[0])
            return result

        return count

    monkeypatch.setattr("decentrl.store.checkpoints.copy_hashing", counting("copy_hashing"))
    monkeypatch.setattr("decentrl.store.checkpoints.copy_range_hashing", counting("copy_range_hashing"))
    with pytest.raises(VerificationError, match="size mismatch \\(expected 4096, got more than 4096\\)"):
        store.pull(1, str(tmp_path / "cache"))
    assert read and max(read) == 4097  # each of the 3 attempts read one byte past the declared size
    assert store.verify(1) == ["v000001/model.safetensors: size mismatch (expected 4096, got more than 4096)"]


def write_version(directory: Path, model: torch.nn.Module) -> str:
    directory.mkdir()
    build_tiny_tokenizer().save_pretrained(directory)
    model.generation_config.save_pretrained(directory)
    write_hf_dir(str(directory), model.state_dict(), model.config, extras_from=str(directory))
    return str(directory)


def test_only_the_manifests_files_are_loaded_and_a_failed_load_changes_nothing(tmp_path: Path) -> None:
    store = CheckpointStore(str(tmp_path / "store"))
    first, second = build_model(TINY.model_copy(update={"seed": 0})), build_model(TINY.model_copy(update={"seed": 1}))
    store.publish(0, write_version(tmp_path / "v0", first))
    store.publish(1, write_version(tmp_path / "v1", second))
    backend = HFBackend(seed=0)
    backend.load(store.pull(0, str(tmp_path / "cache")), 0)
    pulled = Path(store.pull(1, str(tmp_path / "cache")))
    # A file planted beside the version's own, holding every tensor of another model: never read.
    save_file({k: v.contiguous() for k, v in first.state_dict().items()}, str(pulled / "zz-planted.safetensors"))
    backend.load(str(pulled), 1)
    assert all(torch.equal(backend.model.state_dict()[k], v) for k, v in second.state_dict().items())  # type: ignore[union-attr]
    # A version that does not fit is refused before any tensor is copied.
    state = {k: v.clone() for k, v in first.state_dict().items()}
    last = sorted(state)[-1]
    state[last] = torch.zeros(3, 3)
    save_file(state, str(pulled / "model.safetensors"))
    with pytest.raises(CheckpointError, match=f"wrong shape or dtype {last}"):
        backend.load(str(pulled), 2)
    assert backend.version == 1
    assert all(torch.equal(backend.model.state_dict()[k], v) for k, v in second.state_dict().items())  # type: ignore[union-attr]

