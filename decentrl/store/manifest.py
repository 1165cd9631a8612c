"""A version's manifest: its format, its strict parser and the check of its signature.

The manifest (``<store>/vNNNNNN/manifest.json``) names every file of a version with its size and
digest (BLAKE3, or sha256 in manifests written before BLAKE3) and, when the trainer has a signing key, carries an
ed25519 signature over all of that plus
the run name and the version number. Everything that reads a manifest - the store on a pull
(decentrl/store/checkpoints.py), a cached version before it is served again, the hf backend choosing which
files to load (workers/backends/hf.py) - parses it here, so that every way a manifest can be bad
(too large, not JSON, nested 100k deep, a wrong type, a NUL in a file name, a non-ASCII
signature) is one `VerificationError` naming the file, never another exception in a caller's thread.
"""

from __future__ import annotations

import hashlib
import json
from typing import Annotated, Protocol

import blake3
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from decentrl.store import signing

MANIFEST_NAME = "manifest.json"
# A manifest lists a version's files: a few hundred shards at most. The cap bounds what a reader
# downloads and parses before it knows whether the manifest is even signed.
MAX_MANIFEST_BYTES = 1024 * 1024
MAX_FILES = 4096
_RUN_NAME = r"^[A-Za-z0-9._-]{1,64}$"  # as RunConfig.run_name
_NO_CONTROL = "\x00-\x1f\x7f"


def version_dirname(version: int) -> str:
    return f"v{version:06d}"


def policy_url(url: str, policy: str | None) -> str:
    """Where a policy's stream of versions lives: a run of two policies ([orchestrator.roles]
    policies = 'per_role') keeps each under `<url>/<policy>/`; a run of one, at `url` itself."""
    return url if policy is None else f"{url.rstrip('/')}/{policy}"


class StoreError(Exception):
    """A store operation cannot proceed; the message says what is wrong and what to do."""


class StoreUnreachable(StoreError):
    """The store could not be read (a connection refused or timed out, a 5xx): asking again later may succeed."""


class VerificationError(StoreError):
    """A stored file is missing or does not match its manifest entry, or the manifest is not trusted."""


class SignatureError(VerificationError):
    """A public key is configured and the manifest is unsigned, signed by another key, or for another run."""


class DeltaFile(BaseModel):
    """How a file of a delta version is stored: `<path>.delta`, the zstd-compressed XOR of the file
    with the same file of the manifest's `delta_base` (decentrl/store/delta.py)."""

    model_config = ConfigDict(strict=True)

    size: int = Field(description="Size of the stored delta in bytes", ge=0, le=2**44)
    blake3: str = Field(description="Lowercase hex BLAKE3 of the stored delta", pattern=r"^[0-9a-f]{64}$")


class ManifestFile(BaseModel):
    model_config = ConfigDict(strict=True)

    # Flat file name only: it is joined onto local cache paths, so no separators, no "..", and no
    # control characters (a NUL makes every os call on the joined path fail).
    path: str = Field(
        description="File name relative to the version directory, e.g. model.safetensors",
        pattern=rf"^[^/\\{_NO_CONTROL}]*[^/\\.{_NO_CONTROL}][^/\\{_NO_CONTROL}]*$",
        max_length=255,
    )
    size: int = Field(description="Size in bytes", ge=0, le=2**44)
    # Exactly one digest. BLAKE3 for versions published since it was added (it hashes several times
    # faster than sha256, so a verified pull runs at copy speed); sha256 in older manifests, still
    # read and verified. Both are cryptographic: a signature over either covers the bytes.
    blake3: str | None = Field(default=None, description="Lowercase hex BLAKE3 (32 bytes) of the file", pattern=r"^[0-9a-f]{64}$")
    sha256: str | None = Field(default=None, description="Lowercase hex SHA-256 of the file (older manifests)", pattern=r"^[0-9a-f]{64}$")
    delta: DeltaFile | None = Field(
        default=None, description="Set when the store holds the file as a delta against the manifest's delta_base; "
        "size and digest above are then those of the full, rebuilt file",
    )

    @model_validator(mode="after")
    def _one_digest(self) -> ManifestFile:
        if (self.blake3 is None) == (self.sha256 is None):
            raise ValueError("give exactly one of blake3 and sha256")
        return self

    @property
    def algorithm(self) -> str:
        """The digest's name: 'blake3' or 'sha256'."""
        return "sha256" if self.blake3 is None else "blake3"

    @property
    def digest(self) -> str:
        """The file's hex digest under `algorithm`."""
        found = self.blake3 if self.blake3 is not None else self.sha256
        assert found is not None  # _one_digest
        return found


DIGESTS = ("blake3", "sha256")


class Hasher(Protocol):
    def update(self, data: bytes | memoryview, /) -> object: ...
    def hexdigest(self) -> str: ...


def new_hasher(algorithm: str, *, parallel: bool = True) -> Hasher:
    """A fresh hasher for a manifest digest; BLAKE3 on as many threads as the machine has, or on one
    (`parallel=False`) beside copies that keep the other cores busy (docs/real_model.md, the pull)."""
    if algorithm == "blake3":
        return blake3.blake3(max_threads=blake3.blake3.AUTO if parallel else 1)
    if algorithm == "sha256":
        return hashlib.sha256()
    raise ValueError(f"unknown digest {algorithm!r}; use one of {DIGESTS}")


class Manifest(BaseModel):
    # Strict: `true` is not a version, "3" is not a size.
    model_config = ConfigDict(strict=True)

    version: int = Field(description="Policy version this checkpoint holds", ge=0, le=2**31 - 1)
    parent: int | None = Field(description="Version this one was trained from; None for the first", ge=0)
    created_at: float = Field(description="Unix time the version was published", ge=0, allow_inf_nan=False)
    files: Annotated[list[ManifestFile], Field(min_length=1, max_length=MAX_FILES)] = Field(
        description="Every file of the version except the manifest"
    )
    base_version: int | None = Field(
        default=None,
        ge=0,
        description="LoRA runs: the full version this adapter-only version (adapter_config.json, "
        "adapter_model.safetensors) applies to; None for a full checkpoint",
    )
    delta_base: int | None = Field(
        default=None,
        ge=0,
        description="Delta versions: the version whose files the `delta` entries apply to (the previous one "
        "published); None for a key version, whose files are all stored whole",
    )
    whole: bool = Field(
        default=False,
        description="Key versions with a delta_base: every file is stored whole too, beside its delta. A reader "
        "holding delta_base fetches the deltas, any other the whole files; a chain of deltas ends here. False: "
        "the store holds each file one way only",
    )
    run: str | None = Field(
        default=None,
        pattern=_RUN_NAME,
        description="Run that published the version; covered by the signature, so a signed version "
        "cannot be replayed into another run's store. None in manifests from before it existed.",
    )
    signature: str | None = Field(
        default=None,
        pattern=r"^ed25519:[A-Za-z0-9+/]{86}==$",
        description="ed25519 signature of `signed_payload` of the manifest (decentrl.store.signing)",
    )

    @model_validator(mode="after")
    def _distinct_files(self) -> Manifest:
        names = [entry.path for entry in self.files]
        if len(set(names)) != len(names):
            raise ValueError("files: a file is listed twice")
        if MANIFEST_NAME in names:
            raise ValueError(f"files: {MANIFEST_NAME} cannot be one of the version's files")
        deltas = [entry.path for entry in self.files if entry.delta is not None]
        if deltas and self.delta_base is None:
            raise ValueError("files: a file is stored as a delta, but the manifest names no delta_base")
        if self.delta_base is not None and self.delta_base >= self.version:
            raise ValueError(f"delta_base: {self.delta_base} is not an earlier version than {self.version}")
        if self.whole and not deltas:
            raise ValueError("whole: set only where files are stored as deltas too (a key version without deltas is whole already)")
        if self.delta_base is not None and self.base_version is not None:
            raise ValueError("delta_base: adapter versions (base_version) are never deltas")
        if any(f"{name}.delta" in names for name in deltas):
            raise ValueError("files: a file's stored delta name is another listed file")
        return self


def signed_payload(manifest: dict[str, object]) -> bytes:
    """What a signature covers: the manifest's JSON object minus `signature`, canonically encoded."""
    body = {key: value for key, value in manifest.items() if key != "signature"}
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def parse_manifest(raw: bytes, where: str) -> tuple[Manifest, dict[str, object]]:
    """The manifest and the JSON object it was read from (what the signature covers); any way the
    bytes can be bad is a VerificationError naming `where`."""
    if len(raw) > MAX_MANIFEST_BYTES:
        raise VerificationError(f"{where}: larger than {MAX_MANIFEST_BYTES} bytes; not a manifest decentrl wrote")
    try:
        data = json.loads(raw)
        manifest = Manifest.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(part) for part in first["loc"]) or "manifest"
        raise VerificationError(f"{where}: not a valid manifest ({field}: {first['msg']})") from None
    except RecursionError:
        raise VerificationError(f"{where}: not a valid manifest (JSON nested too deeply)") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, an integer of 5000 digits
        raise VerificationError(f"{where}: not a valid manifest ({exc})") from None
    assert isinstance(data, dict)  # a model validated from it
    return manifest, data


def check_manifest(
    raw: bytes, version: int, *, where: str, public_key: Ed25519PublicKey | None, run_name: str | None
) -> Manifest:
    """The manifest of `version` in `raw`, after checking it is well formed, describes `version`
    and - with a public key - is signed by it for run `run_name` (None: any run, for a reader
    that does not know the run, such as `decentrl store pull` without --run)."""
    manifest, data = parse_manifest(raw, where)
    if manifest.version != version:
        raise VerificationError(f"{where}: describes version {manifest.version}, not {version}")
    if public_key is None:
        return manifest
    if manifest.signature is None:
        raise SignatureError(f"{where}: unsigned, and a public key is configured; refusing the version")
    if not signing.is_valid(public_key, signed_payload(data), manifest.signature):
        raise SignatureError(f"{where}: signature does not match the configured public key; refusing the version")
    if run_name is not None and manifest.run != run_name:
        found = "no run (published before signatures named the run)" if manifest.run is None else f"run {manifest.run!r}"
        raise SignatureError(
            f"{where}: signed for {found}, not for run {run_name!r}; refusing the version "
            "(a version copied from another run, or republish it with this run's trainer)"
        )
    return manifest
