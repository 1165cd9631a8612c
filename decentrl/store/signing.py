"""Ed25519 signatures of checkpoint manifests, so bucket write access alone cannot feed workers forged weights.

The trainer holds the private key and signs each manifest it publishes (`CheckpointStore.publish`);
workers hold only the public key and refuse a version whose manifest is unsigned or signed by another
key (`CheckpointStore.pull`). The manifest lists every file's sha256, so a valid signature covers
every byte of the version. `decentrl store keygen` writes a key pair with `write_keypair`.

Keys are PEM files (PKCS#8 private key, SubjectPublicKeyInfo public key), as `openssl` writes them.
A signature is the text "ed25519:" followed by the base64 of the 64 signature bytes.
"""

from __future__ import annotations

import base64
import os

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

_PREFIX = "ed25519:"


class SigningKeyError(ValueError):
    """A key file that cannot be used; the message names the file and what it must hold."""


def write_keypair(private_path: str, public_path: str) -> None:
    """Create a new key pair; the private key file is readable by its owner only. Never overwrites."""
    for path in (private_path, public_path):
        if os.path.exists(path):
            raise SigningKeyError(f"{path} already exists; remove it or choose another path")
    key = Ed25519PrivateKey.generate()
    private_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    public_pem = key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    # O_EXCL + 0o600: the private key is never briefly world-readable, and a racing writer fails.
    fd = os.open(private_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(private_pem)
    with open(public_path, "xb") as f:
        f.write(public_pem)


def load_private_key(path: str) -> Ed25519PrivateKey:
    key = _load(path, serialization.load_pem_private_key, "private", password=None)
    if not isinstance(key, Ed25519PrivateKey):
        raise SigningKeyError(f"{path}: not an ed25519 private key; create one with `decentrl store keygen`")
    return key


def load_public_key(path: str) -> Ed25519PublicKey:
    key = _load(path, serialization.load_pem_public_key, "public")
    if not isinstance(key, Ed25519PublicKey):
        raise SigningKeyError(f"{path}: not an ed25519 public key; use the .pub file of `decentrl store keygen`")
    return key


def _load(path: str, loader, kind: str, **kwargs: object):  # noqa: ANN001, ANN202 - cryptography loaders
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise SigningKeyError(f"cannot read {kind} key {path}: {exc.strerror}") from None
    try:
        return loader(data, **kwargs)
    except (ValueError, TypeError) as exc:
        raise SigningKeyError(f"{path}: not a PEM {kind} key ({exc}); create one with `decentrl store keygen`") from None


def sign(key: Ed25519PrivateKey, payload: bytes) -> str:
    return _PREFIX + base64.b64encode(key.sign(payload)).decode("ascii")


def is_valid(key: Ed25519PublicKey, payload: bytes, signature: str) -> bool:
    """True iff `signature` (as `sign` writes it) signs `payload` with the private half of `key`."""
    if not signature.startswith(_PREFIX):
        return False
    try:
        key.verify(base64.b64decode(signature[len(_PREFIX) :], validate=True), payload)
    # binascii.Error: not base64; ValueError: non-ASCII text, which b64decode refuses to read.
    except (InvalidSignature, ValueError):
        return False
    return True
