"""Versioned checkpoint store: the hand-off point for policy weights.

The trainer publishes each new policy version here; rollout workers and the
`decentrl store` CLI pull and verify versions from it. Any fsspec URL works
(local path, ``file://``, ``memory://``, ``s3://`` ...).

Layout under ``<url>/``: one directory per version, ``v000042``, holding
HF-compatible files plus ``manifest.json``. The manifest is written last and
deleted first, so a version exists for readers exactly when its manifest does.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import tempfile
import time
from collections.abc import Set as AbstractSet
from typing import BinaryIO

from fsspec.core import url_to_fs
from fsspec.implementations.local import LocalFileSystem
from pydantic import BaseModel, Field

MANIFEST_NAME = "manifest.json"
_CHUNK = 8 * 1024 * 1024  # streaming unit: a checkpoint is never held in memory whole
_RETRY_DELAYS = (0.2, 0.4)  # sleeps between the 3 download attempts of one file
_VERSION_DIR = re.compile(r"v(\d{6,})")  # 6+ digits: version_dirname pads, never truncates


def version_dirname(version: int) -> str:
    return f"v{version:06d}"


class ManifestFile(BaseModel):
    # Flat file name only: it is joined onto local cache paths, so no separators or "..".
    path: str = Field(
        description="File name relative to the version directory, e.g. model.safetensors",
        pattern=r"^[^/\\]*[^/\\.][^/\\]*$",
    )
    size: int = Field(description="Size in bytes", ge=0)
    sha256: str = Field(description="Lowercase hex SHA-256 of the file", pattern=r"^[0-9a-f]{64}$")


class Manifest(BaseModel):
    version: int = Field(description="Policy version this checkpoint holds", ge=0)
    parent: int | None = Field(description="Version this one was trained from; None for the first", ge=0)
    created_at: float = Field(description="Unix time the version was published", ge=0)
    files: list[ManifestFile] = Field(description="Every file of the version except the manifest")
    signature: str | None = Field(default=None, description="Reserved for signed manifests")


class StoreError(Exception):
    """A store operation cannot proceed; the message says what is wrong and what to do."""


class VerificationError(StoreError):
    """A stored file is missing or does not match its manifest entry."""


def _copy_hashing(src: BinaryIO, dst: BinaryIO | None) -> tuple[int, str]:
    """Stream src (into dst if given) chunk by chunk; return (size, sha256 hex)."""
    digest = hashlib.sha256()
    size = 0
    while chunk := src.read(_CHUNK):
        digest.update(chunk)
        size += len(chunk)
        if dst is not None:
            dst.write(chunk)
    return size, digest.hexdigest()


def _mismatch(entry: ManifestFile, size: int, sha256: str) -> str | None:
    if size != entry.size:
        return f"size mismatch (expected {entry.size}, got {size})"
    if sha256 != entry.sha256:
        return f"sha256 mismatch (expected {entry.sha256[:12]}.., got {sha256[:12]}..)"
    return None


class CheckpointStore:
    def __init__(self, url: str, storage_options: dict[str, object] | None = None) -> None:
        self.url = url.rstrip("/")
        self.fs, self.root = url_to_fs(self.url, **(storage_options or {}))

    def _vdir(self, version: int) -> str:
        return f"{self.root}/{version_dirname(version)}"

    def _manifest_path(self, version: int) -> str:
        return f"{self._vdir(version)}/{MANIFEST_NAME}"

    def versions(self) -> list[int]:
        # Object-store filesystems cache listings; a poller must see new versions.
        self.fs.invalidate_cache()
        found = []
        for path in self.fs.glob(f"{self.root}/v*/{MANIFEST_NAME}"):
            match = _VERSION_DIR.fullmatch(path.rstrip("/").split("/")[-2])
            if match:
                found.append(int(match.group(1)))
        return sorted(found)

    def latest(self) -> int | None:
        versions = self.versions()
        return versions[-1] if versions else None

    def _manifest_bytes(self, version: int) -> bytes:
        try:
            return self.fs.cat_file(self._manifest_path(version))
        except FileNotFoundError:
            raise StoreError(
                f"version {version} not found in {self.url} (no manifest); "
                f"published versions: {self.versions()}"
            ) from None

    def manifest(self, version: int) -> Manifest:
        return Manifest.model_validate_json(self._manifest_bytes(version))

    def publish(self, version: int, local_dir: str, parent: int | None = None) -> Manifest:
        if self.fs.exists(self._manifest_path(version)):
            raise StoreError(
                f"version {version} already published in {self.url}; "
                "publish under a new version number or delete it first"
            )
        # A pulled directory carries its own manifest.json; it is regenerated, not uploaded.
        names = sorted(
            e.name for e in os.scandir(local_dir) if e.is_file() and e.name != MANIFEST_NAME
        )
        if not names:
            raise StoreError(f"no files to publish in {local_dir}")
        vdir = self._vdir(version)
        self.fs.makedirs(vdir, exist_ok=True)
        files = [self._upload(os.path.join(local_dir, name), f"{vdir}/{name}") for name in names]
        manifest = Manifest(version=version, parent=parent, created_at=time.time(), files=files)
        self._write_manifest(version, manifest.model_dump_json(indent=2).encode())
        return manifest

    def _upload(self, local_path: str, remote_path: str) -> ManifestFile:
        with open(local_path, "rb") as src, self.fs.open(remote_path, "wb") as dst:
            size, sha256 = _copy_hashing(src, dst)
        return ManifestFile(path=os.path.basename(local_path), size=size, sha256=sha256)

    def _write_manifest(self, version: int, data: bytes) -> None:
        path = self._manifest_path(version)
        if isinstance(self.fs, LocalFileSystem):
            # A reader must never see a half-written manifest: write aside, then rename.
            tmp = f"{path}.tmp-{os.getpid()}"
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        else:
            self.fs.pipe_file(path, data)  # a single put is atomic on object stores

    def pull(self, version: int, cache_dir: str) -> str:
        name = version_dirname(version)
        final = os.path.join(cache_dir, name)
        # The final directory only ever appears by rename of a verified one.
        if os.path.isdir(final):
            return final
        raw = self._manifest_bytes(version)
        manifest = Manifest.model_validate_json(raw)
        os.makedirs(cache_dir, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=f".{name}.partial-{os.getpid()}-", dir=cache_dir)
        try:
            for entry in manifest.files:
                self._download(version, entry, os.path.join(tmp, entry.path))
            with open(os.path.join(tmp, MANIFEST_NAME), "wb") as f:
                f.write(raw)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        try:
            os.rename(tmp, final)
        except OSError:
            shutil.rmtree(tmp)
            if not os.path.isdir(final):
                raise
            # else another process finished the same pull first; its copy is as good.
        return final

    def _download(self, version: int, entry: ManifestFile, local_path: str) -> None:
        where = f"{version_dirname(version)}/{entry.path}"
        remote = f"{self._vdir(version)}/{entry.path}"
        # Retried: the object may be mid-rewrite or the network may blip.
        for attempt in range(len(_RETRY_DELAYS) + 1):
            if attempt:
                time.sleep(_RETRY_DELAYS[attempt - 1])
            error: type[StoreError] = VerificationError
            try:
                with self.fs.open(remote, "rb") as src, open(local_path, "wb") as dst:
                    problem = _mismatch(entry, *_copy_hashing(src, dst))
            except FileNotFoundError:
                problem = "missing from store"
            except OSError as e:
                # Not a verification failure: the store could not be read at all.
                problem, error = f"download failed ({e}); check the store is reachable", StoreError
            if problem is None:
                return
        raise error(f"{where}: {problem}")

    def verify(self, version: int) -> list[str]:
        manifest = self.manifest(version)
        problems = []
        for entry in manifest.files:
            try:
                with self.fs.open(f"{self._vdir(version)}/{entry.path}", "rb") as src:
                    problem = _mismatch(entry, *_copy_hashing(src, None))
            except FileNotFoundError:
                problem = "missing from store"
            if problem is not None:
                problems.append(f"{version_dirname(version)}/{entry.path}: {problem}")
        return problems

    def delete(self, version: int) -> None:
        vdir = self._vdir(version)
        if not self.fs.exists(vdir):
            raise StoreError(f"version {version} not found in {self.url}; nothing to delete")
        # Manifest first: readers stop seeing the version before any file disappears.
        if self.fs.exists(self._manifest_path(version)):
            self.fs.rm(self._manifest_path(version))
        self.fs.rm(vdir, recursive=True)

    def retain(self, keep_last: int, protect: AbstractSet[int] = frozenset()) -> list[int]:
        if keep_last < 1:
            raise ValueError(f"keep_last must be >= 1, got {keep_last}")
        doomed = [v for v in self.versions()[:-keep_last] if v not in protect]
        for version in doomed:
            self.delete(version)
        return doomed
