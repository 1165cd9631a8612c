"""Versioned checkpoint store: the hand-off point for policy weights.

The trainer publishes each new policy version here (`decentrl.trainer.publisher`); rollout workers
(`workers/worker.py`) and the `decentrl store` CLI pull and verify versions from it. Any fsspec URL
works (local path, ``file://``, ``memory://``, ``s3://`` ...). docs/store.md has the whole story.

Layout under ``<url>/``: one directory per version, ``v000042``, holding HF-compatible files plus
``manifest.json`` (sizes, BLAKE3 digests - sha256 in older versions - and, with a signing key, an ed25519 signature). The manifest is
written last and deleted first, so a version exists for readers exactly when its manifest does.

A pull lands in ``<cache>/v000042`` only by renaming a fully verified ``.v000042.partial``
directory, so a cached version is complete and verified or absent; the partial directory survives
an interrupted pull and the next pull resumes it. A cached version is served only while its
manifest is the store's, byte for byte: caches are keyed by version number, which another store
(another run, or this URL before its run restarted) also uses.

Size: ~700 lines, for one object over one fsspec filesystem and one layout (publish, pull with its
resume and cache checks and delta chains, verify, retain). What has a seam is out: the manifest's format and
parser (decentrl/store/manifest.py), the cache's local files (decentrl/store/cache.py), a delta file's format
(decentrl/store/delta.py), the weights inside a version (decentrl/store/weights.py), a remote store's large files
fetched as parallel resumable ranges (decentrl/store/ranges.py). `pull` stays here because each
of its steps asks the store: whether
a cached version may be served is decided against the store's manifest, read and signature-checked
on every pull, and its downloads stream from the store's filesystem; a cache object of its own
would hold a reference back to this one.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import logging
import os
import re
import stat
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from collections.abc import Set as AbstractSet
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from fsspec.core import url_to_fs
from fsspec.implementations.local import LocalFileSystem

from decentrl.config import StoreConfig
from decentrl.store import signing
from decentrl.store.cache import (
    CHUNK,
    NO_RANGE_COPY,
    NotRegularFile,
    VerifiedFiles,
    cached_manifest,
    check_cached_file,
    copy_hashing,
    copy_range_hashing,
    dir_bytes,
    hash_regular,
    is_real_dir,
    locked,
    make_dir,
    mismatch,
    open_regular,
    read_regular,
    remove_path,
)
from decentrl.store.delta import DELTA_SUFFIX, apply, encode

# The manifest's format lives in decentrl/store/manifest.py; these names stay importable from here.
from decentrl.store.manifest import (  # noqa: F401 - re-exported
    MANIFEST_NAME,
    MAX_MANIFEST_BYTES,
    DeltaFile,
    Hasher,
    Manifest,
    ManifestFile,
    SignatureError,
    StoreError,
    StoreUnreachable,
    VerificationError,
    check_manifest,
    new_hasher,
    parse_manifest,
    policy_url,
    signed_payload,
    version_dirname,
)
from decentrl.store.ranges import RECORD_SUFFIX, RangedReads, StoredSizeMismatch, discard
from decentrl.store.ranges import read_errors as _read_errors

# s3fs tries a request 5 times around botocore's own tries; the store's retries (a publish's, a
# pull's, a range's: logged, with back-off) are the ones that wait out an outage.
_S3FS_TRIES = 2
# fsspec read-ahead for remote files: a few large ranged GETs per file, not one per chunk.
_READ_BLOCK = 64 * 1024 * 1024
_RETRY_DELAYS = (0.2, 0.4)  # sleeps between the 3 download attempts of one file
_VERSION_DIR = re.compile(r"v(\d{6,})")  # 6+ digits: version_dirname pads, never truncates
# A delta chain is store.full_every - 1 links at most (full_every <= 64); a longer one was not published by a
# trainer, and each link is one level of `_pull_one`'s recursion.
_MAX_CHAIN = 64
# A pull reads the manifests of a chain below a delta base the cache does not hold this many at once
# (each an answer's wait, 0.3-0.6 s from a store on the testbed's links, where one after another a
# late joiner's chain of 7 waited 8 answers in a row); and a whole key version is fetched by its
# chain of deltas from a version the cache holds up to this many versions below it (`_cheaper_by_deltas`).
_READ_AHEAD = 16
_CACHE_ENTRY = re.compile(r"\.?v(\d{6,})(\.partial)?")
_DEFAULTS = StoreConfig()

log = logging.getLogger("decentrl.store.checkpoints")


class ClientReadError(OSError):
    """The store's client library failed a read with an error of its own kind: s3fs raises IndexError
    for a read that timed out on its whole-file path. The store could not be read; the read is tried
    again, as any other read error (and a swapper never dies of an IndexError)."""


def _read_block(declared: int, have: int = 0) -> int:
    """fsspec's read-ahead for a file declared `declared` bytes of which `have` are local. Its
    read-ahead cache fetches each read (a CHUNK) plus one block; sized so, a file up to
    _READ_BLOCK is fetched in one ranged GET ending one byte past its declared size (to see that
    it is longer), and a larger one overshoots by at most one block."""
    return max(1, min(_READ_BLOCK, declared + 1 - have - CHUNK))


def _link_hashing(remote: str, local_path: str, limit: int, algorithm: str) -> tuple[int, str, os.stat_result] | None:
    """Hard-link a local store file into the cache and hash the link: (size, digest, stat), or None where
    the cache cannot link to the store (another filesystem). The link and the store name one inode,
    which the store never rewrites (a version's files are written once, then the manifest), and
    which outlives the store's name when retention deletes it."""
    remove_path(local_path)  # a partial copy from an earlier attempt
    try:
        os.link(remote, local_path)
    except FileNotFoundError:
        raise
    except OSError:
        return None
    return hash_regular(local_path, limit, algorithm)


def _hash_own_file(path: str, algorithm: str) -> tuple[int, str]:
    """(size, digest) of a file being published: the trainer's own, so a symlink (an HF snapshot's) is followed."""
    with open(path, "rb", buffering=0) as f:
        return copy_hashing(f, None, new_hasher(algorithm))


def _run_all(pool: ThreadPoolExecutor, tasks: list[Callable[[], object]]) -> list[object]:
    """Run tasks on the pool; on the first failure cancel what has not started and raise it."""
    return _results([pool.submit(task) for task in tasks])


def _results(futures: Sequence[Future[Any]]) -> list[Any]:
    """The futures' results; on the first failure cancel what has not started and raise it."""
    wait(futures, return_when=FIRST_EXCEPTION)
    for future in futures:
        future.cancel()
    # The pool starts tasks in order, so none before a failed one was cancelled: this raises the
    # first failure in task order, after waiting for the tasks still running before it.
    return [future.result() for future in futures]


def _short_sha(data: bytes | None) -> str:
    return "none" if data is None else hashlib.sha256(data).hexdigest()[:12]


def _stored_entry(entry: ManifestFile) -> ManifestFile:
    """What the store holds for a manifest entry: the file, or - stored as a delta - `<path>.delta`
    with the delta's size and digest."""
    if entry.delta is None:
        return entry
    return ManifestFile(path=entry.path + DELTA_SUFFIX, size=entry.delta.size, blake3=entry.delta.blake3)


def _cached_base(version_dir: str) -> int | None:
    """The base version of a cached (hence verified) version directory; None for a full checkpoint."""
    raw = cached_manifest(version_dir)
    if raw is None:
        return None
    return parse_manifest(raw, os.path.join(version_dir, MANIFEST_NAME))[0].base_version


class CheckpointStore:
    """Publish, list, pull, verify and retain versions under one fsspec URL.

    signing_key: publishes signed manifests (the trainer). public_key: refuses unsigned or
    wrongly signed versions (workers). cache_max_bytes: after each pull, evict the oldest cached
    versions until the cache fits. retention_grace_s: see `retain`. run_name: the run this store
    belongs to, written into every manifest published and, with a public key, required of every
    manifest read (the signature covers it); None reads any run's (`decentrl store` without --run).
    """

    def __init__(
        self,
        url: str,
        storage_options: dict[str, object] | None = None,
        *,
        signing_key: Ed25519PrivateKey | None = None,
        public_key: Ed25519PublicKey | None = None,
        upload_concurrency: int = _DEFAULTS.upload_concurrency,
        download_concurrency: int = _DEFAULTS.download_concurrency,
        parallel_reads: int = _DEFAULTS.parallel_reads,
        part_mb: int = _DEFAULTS.part_mb,
        stall_timeout_s: float = _DEFAULTS.stall_timeout_s,
        min_part_kb: int = _DEFAULTS.min_part_kb,
        cache_max_bytes: int | None = None,
        retention_grace_s: float = _DEFAULTS.retention_grace_s,
        link_local: bool = _DEFAULTS.link_local,
        run_name: str | None = None,
        digest: str = _DEFAULTS.digest,
    ) -> None:
        self.url = url.rstrip("/")
        self.fs, self.root = url_to_fs(self.url, **(storage_options or {}))
        if "s3" in self.fs.protocol:
            self.fs.retries = min(self.fs.retries, _S3FS_TRIES)  # s3fs's tries around botocore's (StoreConfig.fsspec_options)
        self.signing_key = signing_key
        self.public_key = public_key
        self.upload_concurrency = upload_concurrency
        self.download_concurrency = download_concurrency
        self.cache_max_bytes = cache_max_bytes
        self.retention_grace_s = retention_grace_s
        self.run_name = run_name
        self.digest = digest  # of the files this store publishes; a reader verifies whichever a manifest lists
        self.verified = VerifiedFiles()  # cache files this process hashed against their manifest
        self._ahead = threading.local()  # a pull's manifests read ahead (`_read_ahead`), in the pulling thread
        self._whole_only: set[int] = set()  # key versions whose chain of deltas failed once: whole from now on
        self._retention_read: dict[int, Manifest] = {}  # manifests retention read (`_retention_manifest`)
        # Zero-copy pulls need a store on this machine's filesystem and a trusted one: with a
        # public key, whoever can write the store is not trusted, and a hard link would let a
        # later in-place write reach a cache that was verified before it.
        self.link_local = link_local and isinstance(self.fs, LocalFileSystem) and public_key is None
        # A remote store's large files come as parallel, resumable byte ranges (decentrl/store/ranges.py).
        self.ranged = None if isinstance(self.fs, LocalFileSystem) else RangedReads(
            self.fs, parallel_reads=parallel_reads, part_bytes=part_mb * 2**20, stall_timeout_s=stall_timeout_s,
            min_part_bytes=min_part_kb * 2**10,
        )

    @classmethod
    def from_config(cls, config: StoreConfig, *, run_name: str | None = None) -> CheckpointStore:
        """A store as the run config describes it; key files are read here (errors name the file)."""
        return cls(
            config.url,
            config.fsspec_options(),
            signing_key=signing.load_private_key(config.signing_key) if config.signing_key else None,
            public_key=signing.load_public_key(config.public_key) if config.public_key else None,
            upload_concurrency=config.upload_concurrency,
            download_concurrency=config.download_concurrency,
            parallel_reads=config.parallel_reads,
            part_mb=config.part_mb,
            stall_timeout_s=config.stall_timeout_s,
            min_part_kb=config.min_part_kb,
            cache_max_bytes=None if config.cache_max_gb is None else int(config.cache_max_gb * 2**30),
            retention_grace_s=config.retention_grace_s,
            link_local=config.link_local,
            run_name=run_name,
            digest=config.digest,
        )

    def of_policy(self, policy: str) -> CheckpointStore:
        """This store's stream of `policy`'s versions, under `<url>/<policy>/` (manifest.py `policy_url`):
        the same filesystem, keys and settings, a stream of its own."""
        stream = copy.copy(self)
        stream.url, stream.root = policy_url(self.url, policy), f"{self.root}/{policy}"
        stream.verified = VerifiedFiles()
        return stream

    def _vdir(self, version: int) -> str:
        return f"{self.root}/{version_dirname(version)}"

    def _manifest_path(self, version: int) -> str:
        return f"{self._vdir(version)}/{MANIFEST_NAME}"

    def versions(self) -> list[int]:
        # Object-store filesystems cache listings; a poller must see new versions.
        self.fs.invalidate_cache()
        try:
            paths = self.fs.glob(f"{self.root}/v*/{MANIFEST_NAME}")
        except _read_errors() as exc:
            raise StoreError(f"listing versions in {self.url} failed ({exc!r}); check the store is reachable") from exc
        found = []
        for path in paths:
            match = _VERSION_DIR.fullmatch(path.rstrip("/").split("/")[-2])
            if match:
                found.append(int(match.group(1)))
        return sorted(found)

    def latest(self) -> int | None:
        versions = self.versions()
        return versions[-1] if versions else None

    def _manifest_bytes(self, version: int) -> bytes:
        """At most MAX_MANIFEST_BYTES + 1 bytes (one ranged read), so an oversize one is seen as such;
        a read this pull made ahead (`_read_ahead`) where there is one."""
        ahead = getattr(self._ahead, "reads", None)
        if ahead is not None and version in ahead:
            try:
                return ahead[version].result()
            except Exception:  # noqa: BLE001 - read again: that read's error is the one to report
                del ahead[version]
        return self._read_manifest_bytes(version)

    def _read_manifest_bytes(self, version: int) -> bytes:
        try:
            return self.fs.cat_file(self._manifest_path(version), start=0, end=MAX_MANIFEST_BYTES + 1)
        except FileNotFoundError:
            raise StoreError(
                f"version {version} not found in {self.url} (no manifest); "
                f"published versions: {self.versions()}"
            ) from None
        except _read_errors() as exc:
            raise StoreUnreachable(
                f"reading {version_dirname(version)}/{MANIFEST_NAME} from {self.url} failed ({exc!r}); "
                "check the store is reachable"
            ) from exc

    def _checked_manifest(self, version: int) -> tuple[Manifest, bytes]:
        """The manifest and its raw bytes, after checking it is well formed, for `version`, and signed."""
        raw = self._manifest_bytes(version)
        where = f"{version_dirname(version)}/{MANIFEST_NAME}"
        return self._trusted(raw, version, where), raw

    def _trusted(self, raw: bytes, version: int, where: str) -> Manifest:
        return check_manifest(raw, version, where=where, public_key=self.public_key, run_name=self.run_name)

    def manifest(self, version: int) -> Manifest:
        return self._checked_manifest(version)[0]

    def read_verified(self, version: int, select: Callable[[str], bool]) -> tuple[Manifest, dict[str, bytes]]:
        """`version`'s checked (and, with a public key, signature-verified) manifest and the bytes
        of each of its files whose name `select` accepts, every one checked against the manifest's
        size and digest: read into memory, not into a cache. For a reader that copies new weights
        straight into a model it holds (the orchestrator's verifier, orchestrator/verify.py)."""
        manifest, _ = self._checked_manifest(version)
        found: dict[str, bytes] = {}
        for entry in manifest.files:
            if not select(entry.path):
                continue
            where = f"{version_dirname(version)}/{entry.path}"
            try:
                # Never more than the declared size (+1 to see a larger object), whatever is stored.
                with self.fs.open(f"{self._vdir(version)}/{entry.path}", "rb", block_size=_read_block(entry.size)) as f:
                    data = f.read(entry.size + 1)
            except FileNotFoundError:
                raise VerificationError(f"{where}: missing from store") from None
            except _read_errors() as e:
                raise StoreError(f"{where}: read failed ({e}); check the store is reachable") from None
            hasher = new_hasher(entry.algorithm)
            hasher.update(data)
            problem = mismatch(entry, len(data), hasher.hexdigest())
            if problem is not None:
                raise VerificationError(f"{where}: {problem}")
            found[entry.path] = data
        return manifest, found

    def publish(
        self, version: int, local_dir: str, parent: int | None = None, base_version: int | None = None,
        *, hand_over: bool = False, delta_from: tuple[int, str] | None = None, whole: bool = False,
        scratch_dir: str | None = None,
    ) -> Manifest:
        """Upload every file of `local_dir` in parallel, then the (signed) manifest last.
        `base_version`: `local_dir` holds a LoRA adapter to apply to that (full) version.
        `hand_over`: the caller never writes these files again (the trainer's temporary dir), so a
        local store on the same filesystem takes them by hard link instead of a copy.
        `delta_from`: (version, its local directory) of the version published before: each weight
        file of the same size there is stored as a delta against it (decentrl/store/delta.py), the rest
        whole. A key version (every file whole) when that version is no longer in the store.
        `whole` with `delta_from`: a key version whose files are stored whole and as deltas, so
        readers holding the version before fetch the deltas and the others the whole files.
        `scratch_dir`: where the deltas are written before their upload (the trainer's scratch);
        None: the system's temporary directory.
        Publishing the same files under the same version again returns the manifest already there
        (a retry whose earlier attempt wrote its manifest and lost the answer); other files: StoreError."""
        if self.fs.exists(self._manifest_path(version)):
            if (own := self._published_from(version, local_dir)) is not None:
                log.info("version %d: already in %s with these files (an earlier attempt of this publish)", version, self.url)
                return own
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
        paths = [os.path.join(local_dir, name) for name in names]
        if delta_from is not None and not self.fs.exists(self._manifest_path(delta_from[0])):
            log.info("version %d: its delta base v%d is not in the store; publishing a key version", version, delta_from[0])
            delta_from = None
        with tempfile.TemporaryDirectory(prefix=f"decentrl-delta-v{version}-", dir=scratch_dir) as scratch:
            deltas = self._encode_deltas(names, paths, delta_from, scratch)
            uploaded = [
                (os.path.join(scratch, n + DELTA_SUFFIX), n + DELTA_SUFFIX) if n in deltas and not whole else (p, n)
                for p, n in zip(paths, names)
            ]
            if whole:
                uploaded += [(os.path.join(scratch, n + DELTA_SUFFIX), n + DELTA_SUFFIX) for n in names if n in deltas]
            hashes = self._upload_hashing(vdir, paths, uploaded, hand_over)
        files = [
            ManifestFile.model_validate({"path": n, "size": size, self.digest: d, "delta": deltas.get(n)})
            for n, (size, d) in zip(names, hashes)
        ]
        manifest = Manifest(
            version=version, parent=parent, created_at=time.time(), files=files, base_version=base_version,
            delta_base=delta_from[0] if deltas and delta_from else None, whole=whole and bool(deltas), run=self.run_name,
        )
        if self.signing_key is not None:
            payload = signed_payload(manifest.model_dump(mode="json"))
            manifest = manifest.model_copy(update={"signature": signing.sign(self.signing_key, payload)})
        self._write_manifest(version, manifest.model_dump_json(indent=2).encode())
        self._retention_read[version] = manifest
        return manifest

    def _published_from(self, version: int, local_dir: str) -> Manifest | None:
        """The manifest of `version` when it lists exactly the files of `local_dir` (names, sizes, digests)."""
        manifest = self.manifest(version)
        local = sorted(e.name for e in os.scandir(local_dir) if e.is_file() and e.name != MANIFEST_NAME)
        if local != sorted(entry.path for entry in manifest.files):
            return None
        for entry in manifest.files:
            size, digest = _hash_own_file(os.path.join(local_dir, entry.path), entry.algorithm)
            if mismatch(entry, size, digest) is not None:
                return None
        return manifest

    def _encode_deltas(
        self, names: list[str], paths: list[str], delta_from: tuple[int, str] | None, scratch: str
    ) -> dict[str, DeltaFile]:
        """The files stored as deltas against `delta_from`'s, written into `scratch`: every file
        whose base has its size (`encode`), weights and the rest (an unchanged tokenizer is a delta
        of a few bytes: SmolLM2's tokenizer.json is 3.5 MB a version stored whole)."""
        if delta_from is None:
            return {}
        todo = [(n, p) for n, p in zip(names, paths) if os.path.isfile(os.path.join(delta_from[1], n))]
        with ThreadPoolExecutor(self.upload_concurrency) as pool:
            encoded = pool.map(
                lambda item: encode(item[1], os.path.join(delta_from[1], item[0]), os.path.join(scratch, item[0] + DELTA_SUFFIX), "blake3"),
                todo,
            )
            return {n: DeltaFile(size=found[0], blake3=found[1]) for (n, _), found in zip(todo, encoded) if found is not None}

    def _upload_hashing(
        self, vdir: str, paths: list[str], uploaded: list[tuple[str, str]], hand_over: bool
    ) -> list[tuple[int, str]]:
        """Upload each (local file, stored name) into `vdir`; (size, digest) of each of `paths`."""
        # Hashed beside fsspec's own (multipart, concurrent) uploads: the local files are ours and
        # do not change, so this is as sound as hashing the uploaded stream, and costs no wait.
        with ThreadPoolExecutor(self.upload_concurrency) as pool, ThreadPoolExecutor(self.upload_concurrency) as hashers:
            local = isinstance(self.fs, LocalFileSystem)
            uploads = [
                pool.submit(self._put_local, p, f"{vdir}/{n}", hand_over) if local else pool.submit(self.fs.put_file, p, f"{vdir}/{n}")
                for p, n in uploaded
            ]
            hashes = list(hashers.map(functools.partial(_hash_own_file, algorithm=self.digest), paths))
            for upload in uploads:
                upload.result()
        return hashes

    def _put_local(self, local_path: str, remote: str, link: bool) -> None:
        """Into a new file, never into an existing one (a failed publish's or delete's leftover),
        which a cache may hold a hard link to; by hard link when the file is handed over."""
        try:
            os.remove(remote)
        except FileNotFoundError:
            pass
        if link:
            try:
                os.link(local_path, remote)
                return
            except OSError:  # another filesystem, or no hard links there
                pass
        self.fs.put_file(local_path, remote)

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
        """`cache_dir/vNNNNNN`, downloaded and verified unless already cached from this store (see
        `_pull_one`); resumes a partial pull.
        An adapter version (manifest `base_version`) brings its base version into the cache too:
        it is loaded onto that base, which is thus pulled once and kept for every adapter after it.
        The files of every version the pull needs are fetched through one pool of
        `download_concurrency` threads: a delta chain's deltas come at once, not one by one."""
        reads = ThreadPoolExecutor(_READ_AHEAD, thread_name_prefix="store-manifest")
        self._ahead.reads, self._ahead.pool = {}, reads
        try:
            with ThreadPoolExecutor(self.download_concurrency, thread_name_prefix="store-pull") as fetches:
                final, base = self._pull_one(version, cache_dir, fetches)
                if base is not None:
                    self._pull_one(base, cache_dir, fetches)
        finally:
            self._ahead.reads = self._ahead.pool = None
            reads.shutdown(wait=False, cancel_futures=True)  # reads never used end on their own
        self.evict(cache_dir, keep=version)
        return final

    def _pull_one(
        self, version: int, cache_dir: str, fetches: ThreadPoolExecutor, depth: int = 0
    ) -> tuple[str, int | None]:
        """The cached directory of `version` and the base version it is an adapter for.

        A delta version is rebuilt from its delta base's cached directory, which is pulled the
        same way while this version's deltas download on `fetches` (`depth` links down its chain,
        at most _MAX_CHAIN): a base cached and still valid costs nothing; one missing or corrupted
        in the cache is pulled again, itself rebuilt from its own base, down to the chain's key
        version, whose files are stored whole. So a chain's files download concurrently and are
        applied in order, from the key version up. Each link holds its version's lock while the
        links below it are pulled: locks are taken from the newest version down, never up.

        A cached directory is served when its manifest is the store's, byte for byte (the manifest
        covers every file's digest, and its signature is checked as for a download), and its files
        still match it (`_cached_problem`); else it is replaced by a fresh pull. Where the store
        cannot say - it is unreachable, or retention already deleted the version - the cached
        directory is served only after its own manifest passes the same checks (signature and run
        included) and its files match it: a worker keeps generating with what it has through a
        store outage, and never with what it could not verify."""
        final = os.path.join(cache_dir, version_dirname(version))
        try:
            manifest, raw = self._checked_manifest(version)
        except VerificationError:
            raise
        except StoreError as exc:
            cached = cached_manifest(final)
            if cached is None:
                raise
            kept = self._trusted(cached, version, f"cached {final}/{MANIFEST_NAME}")
            problem = self._cached_problem(final, kept)
            if problem is not None:
                raise VerificationError(f"cached {final}: {problem}; and the store cannot be read to pull it again ({exc})") from None
            log.warning("serving cached %s (its manifest and files verified again): %s", final, exc)
            return final, kept.base_version
        if not self._cache_holds(final, raw, manifest, say=False):  # said under the lock, once
            make_dir(cache_dir)
            # One puller per version per cache dir: the partial directory is shared across attempts.
            lock = os.path.join(cache_dir, f".{version_dirname(version)}.lock")
            with locked(lock):
                if not self._cache_holds(final, raw, manifest):
                    self._demote_foreign(final, raw)
                    self._pull_locked(manifest, raw, cache_dir, fetches, depth)
                os.remove(lock)  # safe while held (see locked); a failed pull leaves it beside its partial
        return final, manifest.base_version

    def _read_ahead(self, versions: Sequence[int], cache_dir: str) -> None:
        """Start reading the manifests of `versions` (newest first) at once, on this pull's pool,
        up to and including the first one the cache holds: a chain's links are then each one
        answer's wait together instead of one after another (a cached link's manifest is read too,
        to compare). Outside a pull (no pool), nothing."""
        reads, pool = getattr(self._ahead, "reads", None), getattr(self._ahead, "pool", None)
        if reads is None or pool is None:
            return
        for version in versions:
            if version < 0:
                return
            if version not in reads:
                reads[version] = pool.submit(self._read_manifest_bytes, version)
            if cached_manifest(os.path.join(cache_dir, version_dirname(version))) is not None:
                return

    def _cheaper_by_deltas(self, manifest: Manifest, cache_dir: str) -> bool:
        """Whether a whole key version, whose delta base the cache does not hold, costs fewer bytes
        as its chain of deltas down from a version the cache does hold (at most `_READ_AHEAD`
        below): a worker that fell a few versions behind a key version fetches what changed, not
        the whole model again (a 10 Mbit/s volunteer: 7 deltas of 2.2 MB against 32 MB). The
        chain's manifests are read at once; any link missing or not a delta: whole."""
        if not manifest.whole or manifest.delta_base is None or manifest.version in self._whole_only:
            return False
        below = range(manifest.delta_base, max(-1, manifest.version - _READ_AHEAD - 1), -1)
        held = next((v for v in below if cached_manifest(os.path.join(cache_dir, version_dirname(v))) is not None), None)
        if held is None or self._held(held, cache_dir, manifest.version) is None:
            return False
        self._read_ahead(below, cache_dir)
        chain_bytes, link = sum(_stored_entry(e).size for e in manifest.files), manifest.delta_base
        try:
            while link != held:
                linked = self.manifest(link)
                if linked.delta_base is None or not held <= linked.delta_base < link:
                    return False
                chain_bytes += sum(_stored_entry(e).size for e in linked.files)
                link = linked.delta_base
        except StoreError:
            return False
        return chain_bytes < sum(e.size for e in manifest.files)

    def _delta_base_dir(self, manifest: Manifest, cache_dir: str, fetches: ThreadPoolExecutor, depth: int) -> str | None:
        """The cached, verified directory of the version a delta version's files apply to; None
        for a key version. A base that is in neither the store nor the cache refuses the version."""
        if manifest.delta_base is None:
            return None
        first = next(entry.path for entry in manifest.files if entry.delta is not None)
        where = f"{version_dirname(manifest.version)}/{first}"
        if depth >= _MAX_CHAIN:
            raise VerificationError(f"{where}: more than {_MAX_CHAIN} delta versions in a row; not a chain decentrl publishes")
        try:
            return self._pull_one(manifest.delta_base, cache_dir, fetches, depth + 1)[0]
        except VerificationError as exc:
            raise VerificationError(f"{where}: its delta base v{manifest.delta_base} cannot be verified ({exc})") from None
        except StoreError:
            if manifest.delta_base in self.versions():
                raise  # the store could not be read: a caller may retry
            raise VerificationError(
                f"{where}: stored as a delta against v{manifest.delta_base}, which is in neither the store nor the cache"
            ) from None

    def _held_base(self, manifest: Manifest, cache_dir: str) -> str | None:
        """A whole key version's delta base, when the cache holds it verified (its own manifest
        trusted, its files matching it): the deltas are rebuilt from it without asking the store
        about it. None for any other version, or a base not held: the whole files are fetched."""
        if not manifest.whole or manifest.delta_base is None:
            return None
        return self._held(manifest.delta_base, cache_dir, manifest.version)

    def _held(self, version: int, cache_dir: str, wanted: int) -> str | None:
        """`version`'s cached directory, when its own manifest is trusted and its files match it;
        else None (a pull of `wanted` then goes by its whole files)."""
        cached = os.path.join(cache_dir, version_dirname(version))
        raw = cached_manifest(cached)
        if raw is None:
            return None
        try:
            kept = self._trusted(raw, version, f"cached {cached}/{MANIFEST_NAME}")
        except VerificationError as exc:
            log.warning("v%d: the cached v%d is not trusted (%s); fetching the whole files", wanted, version, exc)
            return None
        return cached if self._cached_problem(cached, kept) is None else None

    def _cache_holds(self, final: str, raw: bytes, manifest: Manifest, *, say: bool = True) -> bool:
        """Whether `final` is the store's version: the same manifest, and files that still match it
        (`say`: a file that does not is logged)."""
        if cached_manifest(final) != raw:
            return False
        problem = self._cached_problem(final, manifest)
        if problem is not None and say:
            log.warning("cached %s no longer matches its manifest (%s); pulling it again", final, problem)
        return problem is None

    def _cached_problem(self, final: str, manifest: Manifest) -> str | None:
        """The first problem with a cached version's files against its manifest, or None: each
        file re-hashed unless this process verified it and its identity is unchanged since
        (decentrl/store/cache.py). Files the manifest does not list are left alone: nothing loads them."""
        with ThreadPoolExecutor(self.download_concurrency) as pool:
            problems = pool.map(
                lambda entry: check_cached_file(os.path.join(final, entry.path), entry, self.verified), manifest.files
            )
            return next((f"{entry.path}: {p}" for entry, p in zip(manifest.files, problems) if p is not None), None)

    def _demote_foreign(self, final: str, raw: bytes) -> None:
        """Turn a cached directory that is not the store's version (held under its pull lock) into
        that version's partial directory, which the pull then discards as started for another
        manifest: a crash part-way leaves a partial, never a half-deleted version. Only names in
        the cache go; files hard-linked from a local store keep the store's names."""
        if not os.path.lexists(final):
            return
        cached = cached_manifest(final)
        if cached != raw:  # (the same manifest, files changed since: `_cache_holds` said which)
            log.warning(
                "cached %s (manifest sha256 %s..) is not that version of %s (manifest sha256 %s..): it came "
                "from another store or an earlier run, or was altered; pulling it again",
                final, _short_sha(cached), self.url, _short_sha(raw),
            )
        head, name = os.path.split(final)
        partial = os.path.join(head, f".{name}.partial")
        remove_path(partial)
        os.rename(final, partial)  # a symlink found at `final` is renamed, not followed

    def _pull_locked(
        self, manifest: Manifest, raw: bytes, cache_dir: str, fetches: ThreadPoolExecutor, depth: int
    ) -> None:
        """Fetch the version's files (its deltas as stored) on `fetches` while its delta base is
        pulled, then rebuild its delta files from the base and move it into place. A whole key
        version goes by its deltas where the cache holds its base (`_held_base`), else whole."""
        version, name = manifest.version, version_dirname(manifest.version)
        final, partial = os.path.join(cache_dir, name), os.path.join(cache_dir, f".{name}.partial")
        manifest_copy = os.path.join(partial, MANIFEST_NAME)
        # Resume only what was started for this very manifest (a version may be re-published),
        # in a real directory (a symlink planted there is removed, not written through).
        if not is_real_dir(partial) or read_regular(manifest_copy) != raw:
            remove_path(partial)
        make_dir(partial)
        with open_regular(manifest_copy, os.O_WRONLY | os.O_CREAT | os.O_TRUNC) as f:
            f.write(raw)
        expected = {entry.path for entry in manifest.files} | {MANIFEST_NAME}
        expected |= {name + RECORD_SUFFIX for name in expected}  # a ranged download's record (ranges.py)
        held_base = self._held_base(manifest, cache_dir)
        # A whole key version goes by deltas from its base held, or from one held below when cheaper.
        chained = manifest.whole and held_base is None and self._cheaper_by_deltas(manifest, cache_dir)
        by_delta = manifest.delta_base is not None and (not manifest.whole or held_base is not None or chained)
        same = self._same_as_base(manifest, cache_dir) if by_delta else []
        stored = [_stored_entry(e) if by_delta else e for e in manifest.files if e not in same]
        expected |= {e.path for e in stored} | {e.path + RECORD_SUFFIX for e in stored}
        for stray in set(os.listdir(partial)) - expected:
            remove_path(os.path.join(partial, stray))
        downloads = [fetches.submit(self._download, version, e, os.path.join(partial, e.path)) for e in stored]
        if by_delta and held_base is None:  # the chain's manifests below, at once, while these download
            self._read_ahead(range(manifest.delta_base, manifest.delta_base - _READ_AHEAD, -1), cache_dir)
        try:
            base_dir = held_base or (self._delta_base_dir(manifest, cache_dir, fetches, depth) if by_delta else None)
            _results(downloads)
        except StoreError as exc:
            if not chained:
                raise
            # The chain was a choice, not the version's only form: its whole files are next (a retry).
            self._whole_only.add(version)
            raise StoreError(f"{name}: its chain of deltas failed ({exc}); its whole files are fetched next") from exc
        finally:
            for future in downloads:  # none outlives this version's lock
                future.cancel()
            wait(downloads)
        rebuilt = [e for e in manifest.files if e.delta is not None and by_delta and e not in same]
        if rebuilt or same:
            with ThreadPoolExecutor(self.download_concurrency) as pool:
                _run_all(pool, [lambda e=e: self._rebuild(version, e, partial, base_dir) for e in rebuilt]
                         + [lambda e=e: self._copy_same(version, e, partial, base_dir) for e in same])
        try:
            os.rename(partial, final)
        except OSError:
            remove_path(partial)
            if not is_real_dir(final):
                raise
            # else another process finished the same pull first; its copy is as good.

    def _same_as_base(self, manifest: Manifest, cache_dir: str) -> list[ManifestFile]:
        """The files of a version pulled by its deltas that its delta base, cached, holds byte for
        byte (the same size and digest in both manifests): the config and tokenizer files of every
        delta version (4 of the demo's 5 files, 18-byte deltas, a request each). They are copied from
        the base (`_copy_same`), not fetched. Only a base the cache already holds is asked: one
        pulled with this version (a chain) is read after the downloads start."""
        assert manifest.delta_base is not None
        base_dir = os.path.join(cache_dir, version_dirname(manifest.delta_base))
        raw = cached_manifest(base_dir)
        if raw is None:
            return []
        try:
            base = parse_manifest(raw, os.path.join(base_dir, MANIFEST_NAME))[0]
        except (VerificationError, ValueError):
            return []  # its own checks (the base's pull) say what is wrong with it
        held = {(e.path, e.size, e.algorithm, e.digest) for e in base.files}
        return [e for e in manifest.files if e.delta is not None and (e.path, e.size, e.algorithm, e.digest) in held]

    def _copy_same(self, version: int, entry: ManifestFile, partial: str, base_dir: str | None) -> None:
        """A file the version shares with its delta base: copied from the base's verified file and
        hashed against the entry; a copy that does not match (the base changed since it was checked)
        falls back to the file's delta, fetched and rebuilt."""
        assert base_dir is not None
        target = os.path.join(partial, entry.path)
        try:
            with open_regular(os.path.join(base_dir, entry.path)) as src, \
                    open_regular(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC) as dst:
                problem = mismatch(entry, *copy_hashing(src, dst, new_hasher(entry.algorithm, parallel=False), limit=entry.size + 1))
                written = os.fstat(dst.fileno())
        except (FileNotFoundError, NotRegularFile) as exc:
            problem = str(exc)
        if problem is None:
            self.verified.remember(written, entry)
            return
        log.warning("v%d %s: not as its base's copy (%s); fetching its delta", version, entry.path, problem)
        remove_path(target)
        stored = _stored_entry(entry)
        self._download(version, stored, os.path.join(partial, stored.path))
        self._rebuild(version, entry, partial, base_dir)

    def _rebuild(self, version: int, entry: ManifestFile, partial: str, base_dir: str | None) -> None:
        """Rebuild a file from its delta (downloaded and checked against the delta's size and
        digest) and the base version's file, and check it against the manifest's size and digest
        of the full file; only then is it in the partial directory."""
        assert base_dir is not None  # a manifest with delta entries names its delta_base
        stored = _stored_entry(entry)
        delta_path = os.path.join(partial, stored.path)
        with open_regular(delta_path) as f:
            delta = f.read(stored.size + 1)
        where = f"{version_dirname(version)}/{entry.path}"
        written = apply(os.path.join(base_dir, entry.path), delta, entry, os.path.join(partial, entry.path), where)
        self.verified.remember(written, entry)
        os.remove(delta_path)

    def _download(self, version: int, entry: ManifestFile, local_path: str) -> None:
        where = f"{version_dirname(version)}/{entry.path}"
        remote = f"{self._vdir(version)}/{entry.path}"
        # Retried: the object may be mid-rewrite or the network may blip.
        for attempt in range(len(_RETRY_DELAYS) + 1):
            if attempt:
                time.sleep(_RETRY_DELAYS[attempt - 1])
            error: type[StoreError] = VerificationError
            try:
                size, digest, written = self._fetch_resuming(remote, local_path, entry.size, entry.algorithm)
                problem = mismatch(entry, size, digest)
                if problem is None:
                    self.verified.remember(written, entry)
                else:
                    discard(local_path)  # wrong bytes somewhere, in no range we could name: the next attempt starts over
            except FileNotFoundError:
                problem = "missing from store"
            except StoredSizeMismatch as e:  # a ranged download's check before it fetches
                problem = mismatch(entry, e.stored, "")
            except NotRegularFile as e:  # the store's file is a symlink (a local store, hard-linked)
                problem = f"not a regular file in the store ({e.strerror})"
            except _read_errors() as e:
                # Not a verification failure: the store could not be read. What arrived is kept.
                problem, error = f"download failed ({e}); check the store is reachable", StoreError
            if problem is None:
                return
        raise error(f"{where}: {problem}")

    def _fetch_resuming(
        self, remote: str, local_path: str, expected_size: int, algorithm: str
    ) -> tuple[int, str, os.stat_result]:
        """Append the rest of `remote` to `local_path`, hashing as it streams: (size, digest) of the
        whole, read no further than `expected_size` + 1 bytes, and the stat of the file written.
        A remote store's large file comes as parallel ranges instead (`RangedReads.fetch`)."""
        if self.ranged is not None and self.ranged.applies(local_path, expected_size):
            return self.ranged.fetch(remote, local_path, expected_size, algorithm)
        limit = expected_size + 1
        if self.link_local:
            linked = _link_hashing(remote, local_path, limit, algorithm)
            if linked is not None:
                return linked
            self.link_local = False  # another filesystem, or no hard links there: copy from now on
        digest, have = new_hasher(algorithm, parallel=False), 0  # beside copies, which use the other cores
        try:
            st = os.lstat(local_path)
            if st.st_size > expected_size or not stat.S_ISREG(st.st_mode):
                remove_path(local_path)
            else:
                with open_regular(local_path) as f:
                    have, _ = copy_hashing(f, None, digest, limit=limit)
                    if have == expected_size:  # finished before the interruption: nothing to fetch
                        return have, digest.hexdigest(), os.fstat(f.fileno())
        except FileNotFoundError:
            pass
        if isinstance(self.fs, LocalFileSystem) and hasattr(os, "copy_file_range"):
            copied = self._copy_local(remote, local_path, digest, have, limit)
            if copied is not None:
                return copied
            remove_path(local_path)  # the kernel cannot copy between these files: stream it all
            digest, have = new_hasher(algorithm, parallel=False), 0
        try:
            with (
                self.fs.open(remote, "rb", block_size=_read_block(expected_size, have)) as src,
                open_regular(local_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND) as dst,
            ):
                if have:
                    src.seek(have)
                size, hexdigest = copy_hashing(src, dst, digest, have, limit=limit)
                return size, hexdigest, os.fstat(dst.fileno())
        except IndexError as exc:  # what arrived is kept: the next attempt resumes after it
            raise ClientReadError(f"reading {remote} failed in the store's client ({exc!r}; s3fs's for a read timeout)") from exc

    def _copy_local(
        self, remote: str, local_path: str, digest: Hasher, have: int, limit: int
    ) -> tuple[int, str, os.stat_result] | None:
        """A local store's file appended to `local_path` by the kernel, hashing what lands
        (`copy_range_hashing`): (size, digest, stat), as `_fetch_resuming` returns them; None where
        the store's file is not a regular file or the kernel cannot copy between the two."""
        src = os.open(self.fs._strip_protocol(remote), os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            if not stat.S_ISREG(os.fstat(src).st_mode):
                return None
            with open_regular(local_path, os.O_RDWR | os.O_CREAT) as dst:
                try:
                    size = copy_range_hashing(src, dst.fileno(), digest, have, limit)
                except OSError as exc:
                    if exc.errno in NO_RANGE_COPY:
                        return None
                    raise
                return size, digest.hexdigest(), os.fstat(dst.fileno())
        finally:
            os.close(src)

    def evict(self, cache_dir: str, keep: int) -> list[int]:
        """Delete the oldest cached versions (never `keep`, nor the base version it is an adapter
        for) until the cache fits `cache_max_bytes`."""
        if self.cache_max_bytes is None:
            return []
        kept = {keep, _cached_base(os.path.join(cache_dir, version_dirname(keep)))}
        entries = []
        for entry in os.scandir(cache_dir):
            match = _CACHE_ENTRY.fullmatch(entry.name)
            if match and entry.is_dir(follow_symlinks=False):
                entries.append((int(match.group(1)), entry.path))
        total = sum(dir_bytes(path) for _, path in entries)
        evicted = []
        for version, path in sorted(entries):
            if total <= self.cache_max_bytes:
                break
            if version in kept:
                continue
            lock = os.path.join(cache_dir, f".{version_dirname(version)}.lock")
            with locked(lock, blocking=False) as acquired:
                if not acquired:  # another process is pulling it right now
                    continue
                size = dir_bytes(path)
                remove_path(path)
                os.remove(lock)
            total -= size
            evicted.append(version)
        return evicted

    def verify(self, version: int) -> list[str]:
        """Problems with `version` in the store, each naming the file; [] when every byte matches."""
        try:
            manifest = self.manifest(version)
        except VerificationError as exc:
            return [str(exc)]

        def check(entry: ManifestFile) -> str | None:
            try:
                remote = f"{self._vdir(version)}/{entry.path}"
                with self.fs.open(remote, "rb", block_size=_read_block(entry.size)) as src:
                    problem = mismatch(entry, *copy_hashing(src, None, new_hasher(entry.algorithm), limit=entry.size + 1))
            except FileNotFoundError:
                problem = "missing from store"
            return None if problem is None else f"{version_dirname(version)}/{entry.path}: {problem}"

        # What the store holds: a delta version's files as their deltas; a whole key version's both ways.
        stored = [_stored_entry(e) for e in manifest.files]
        if manifest.whole:
            stored += [e for e in manifest.files if e.delta is not None]
        with ThreadPoolExecutor(self.download_concurrency) as pool:
            return [problem for problem in pool.map(check, stored) if problem is not None]

    def delete(self, version: int) -> None:
        vdir = self._vdir(version)
        if not self.fs.exists(vdir):
            raise StoreError(f"version {version} not found in {self.url}; nothing to delete")
        # Manifest first: readers stop seeing the version before any file disappears.
        self._retention_read.pop(version, None)
        if self.fs.exists(self._manifest_path(version)):
            self.fs.rm(self._manifest_path(version))
        self.fs.rm(vdir, recursive=True)

    def _chains(self, kept: AbstractSet[int]) -> set[int]:
        """Every version the delta chains of `kept` versions pass through. Manifests are read
        without the signature check: a chain can only keep a version longer."""
        needed: set[int] = set()
        for version in kept:
            base = self._delta_base_of(version)
            while base is not None and base not in needed:
                needed.add(base)
                base = self._delta_base_of(base)
        return needed

    def _delta_base_of(self, version: int) -> int | None:
        try:
            manifest = self._retention_manifest(version)
            return None if manifest.whole else manifest.delta_base  # a whole key version needs no base
        except StoreError:  # gone (a broken chain: nothing further to keep), or not a manifest
            return None

    def _retention_manifest(self, version: int) -> Manifest:
        """`version`'s manifest as retention reads it (parsed, not signature-checked), each read once
        by this process: a manifest is written once and retention runs after every publish, so
        reading every kept version's again each time (two reads each, one after another: with a
        5.8 s step and 35 versions kept, 70 answers of 0.2 s in the publisher's thread between a
        version and the next) costs the store requests and the trainer's next publish time."""
        if version not in self._retention_read:
            raw = self._manifest_bytes(version)
            self._retention_read[version] = parse_manifest(raw, f"{version_dirname(version)}/{MANIFEST_NAME}")[0]
        return self._retention_read[version]

    def retain(self, keep_last: int, protect: AbstractSet[int] = frozenset(), now: float | None = None) -> list[int]:
        """Delete versions older than the newest `keep_last`, except `protect`ed ones and any
        superseded less than `retention_grace_s` ago: a worker that began pulling a version while
        it was the newest may still be downloading it, and any version a kept delta version's chain
        reaches (down to its key version): it is rebuilt from them. Returns the deleted versions."""
        if keep_last < 1:
            raise ValueError(f"keep_last must be >= 1, got {keep_last}")
        now = time.time() if now is None else now
        versions = self.versions()
        for gone in set(self._retention_read) - set(versions):  # deleted by another process
            del self._retention_read[gone]
        doomed = []
        for older, newer in zip(versions[:-keep_last], versions[1:]):
            if older in protect:
                continue
            # `newer` superseded `older` when it was published; read without the signature check:
            # a timestamp can only delay a deletion.
            superseded_at = self._retention_manifest(newer).created_at
            if now - superseded_at >= self.retention_grace_s:
                doomed.append(older)
        needed = self._chains({v for v in versions if v not in doomed})
        doomed = [version for version in doomed if version not in needed]
        for version in doomed:
            self.delete(version)
        return doomed
