"""The local side of a pull: files in a pull cache, opened so that nothing planted there is followed.

`CheckpointStore.pull` (decentrl/store/checkpoints.py) downloads into ``<cache>/.vNNNNNN.partial/`` and renames
it to ``<cache>/vNNNNNN``; this module holds what it does with local files. A cache directory may
be shared (several workers on a machine) and outlives runs, so whatever is found there is treated
as a neighbour's: every open refuses a symlink (O_NOFOLLOW) and anything but a regular file
(O_NONBLOCK, so a planted FIFO cannot hang the open), a symlink or file found where a directory
belongs is removed rather than entered, and a cached version is re-verified before it is served
again (`check_cached_file`).

Re-verification is bound to file identity: `VerifiedFiles` remembers, in this process's memory,
each file it hashed (or wrote while hashing) by (device, inode) with its size, mtime and ctime.
A write to a file changes its ctime, which no unprivileged process can set back, and a
replacement is another inode; so a cached file whose identity is unchanged since this process
verified it holds the same bytes and is not hashed again. Anything else - a file this process
has not seen (a restart, another worker's pull) or one whose identity moved - is hashed in full
against the manifest. The memory is not on disk: a marker file in the cache could be rewritten
by whoever rewrote the weights.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import shutil
import stat
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import BinaryIO

from decentrl.store.manifest import (
    MANIFEST_NAME,
    MAX_MANIFEST_BYTES,
    Hasher,
    Manifest,
    ManifestFile,
    VerificationError,
    new_hasher,
    parse_manifest,
)

# Streaming unit, read into one reused buffer: small enough to stay in CPU cache between the
# read, the hash and the write (several times faster than fresh 8 MiB reads on a local disk).
CHUNK = 1024 * 1024
# A local store's file is copied by the kernel (`copy_range_hashing`) in chunks of this size.
RANGE_CHUNK = 8 * 1024 * 1024
# copy_file_range's errors for "not between these two files" (an old kernel across filesystems,
# a filesystem without it): the pull streams the file instead.
NO_RANGE_COPY = frozenset({errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL})
_OPEN = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class NotRegularFile(OSError):
    """A path in the cache is a symlink, directory, FIFO or device where a file of ours belongs."""


def open_regular(path: str, flags: int = os.O_RDONLY, mode: int = 0o644) -> BinaryIO:
    """`path` opened unbuffered, refusing a symlink or anything but a regular file."""
    try:
        fd = os.open(path, flags | _OPEN, mode)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise NotRegularFile(errno.ELOOP, "a symlink, not a file the cache made", path) from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise NotRegularFile(errno.EINVAL, "not a regular file", path)
    writing = flags & (os.O_WRONLY | os.O_RDWR)
    return os.fdopen(fd, ("ab" if flags & os.O_APPEND else "wb") if writing else "rb", buffering=0)


def read_regular(path: str, limit: int = MAX_MANIFEST_BYTES) -> bytes | None:
    """The bytes of a small file of ours (at most `limit` + 1, so an oversize file is seen as
    such); None where there is no regular file at `path`."""
    try:
        with open_regular(path) as f:
            return f.read(limit + 1)
    except (FileNotFoundError, NotADirectoryError, NotRegularFile):
        return None


def remove_path(path: str) -> None:
    """Remove whatever is at `path` (a directory tree, a file, a symlink - not its target)."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if stat.S_ISDIR(mode):
        shutil.rmtree(path)  # rmtree removes symlinks inside a tree, never their targets
    else:
        os.unlink(path)


def is_real_dir(path: str) -> bool:
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except FileNotFoundError:
        return False


def make_dir(path: str) -> None:
    """`path` as a directory: one made here, or a real one found there (a symlink is replaced).
    Its parents are the caller's (the configured cache directory's): made as needed, as found."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    while True:
        try:
            os.mkdir(path)
            return
        except FileExistsError:
            if is_real_dir(path):
                return
            remove_path(path)


def copy_hashing(
    src: BinaryIO, dst: BinaryIO | None, digest: Hasher, size: int = 0, limit: int | None = None
) -> tuple[int, str]:
    """Stream src (into dst if given) through `digest`, which already covers `size` bytes; stop
    once the total reaches `limit` (a file's declared size + 1: enough to see it is too large)."""
    buffer = memoryview(bytearray(CHUNK))
    while limit is None or size < limit:
        want = CHUNK if limit is None else min(CHUNK, limit - size)
        n = src.readinto(buffer[:want])
        if not n:
            break
        chunk = buffer[:n]
        digest.update(chunk)
        size += n
        if dst is not None:
            dst.write(chunk)
    return size, digest.hexdigest()


def copy_range_hashing(src: int, dst: int, digest: Hasher, size: int, limit: int) -> int:
    """Copy file descriptor `src` from offset `size` into `dst` at the same offsets, in the kernel
    (copy_file_range: the bytes never pass through Python), until `limit` bytes or the end of
    `src`; returns the size reached. Each chunk is hashed as it landed in `dst`, read back through a
    mapping, on a second thread while the next chunk copies: `digest` covers exactly what the cache
    holds, and the hash hides behind the copy (docs/real_model.md, `pull_vs_raw`)."""

    def hash_landed(offset: int, length: int) -> None:
        start = offset - offset % mmap.ALLOCATIONGRANULARITY  # a mapping starts on a page boundary
        with mmap.mmap(dst, offset + length - start, access=mmap.ACCESS_READ, offset=start) as landed:
            with memoryview(landed) as view:
                digest.update(view[offset - start :])

    with ThreadPoolExecutor(1, thread_name_prefix="hash") as hasher:
        hashed: Future[None] | None = None
        while size < limit:
            copied = os.copy_file_range(src, dst, min(RANGE_CHUNK, limit - size), size, size)
            if not copied:
                break
            if hashed is not None:
                hashed.result()
            hashed = hasher.submit(hash_landed, size, copied)
            size += copied
        if hashed is not None:
            hashed.result()
    return size


def mismatch(entry: ManifestFile, size: int, digest: str) -> str | None:
    """What differs between a file of `size` bytes hashing to `digest` (under the entry's
    algorithm) and its manifest entry; None when nothing does."""
    if size != entry.size:
        got = f"more than {entry.size}" if size > entry.size else str(size)
        return f"size mismatch (expected {entry.size}, got {got})"
    if digest != entry.digest:
        return f"{entry.algorithm} mismatch (expected {entry.digest[:12]}.., got {digest[:12]}..)"
    return None


Identity = tuple[int, int, int]  # size, mtime_ns, ctime_ns of one (device, inode)


class VerifiedFiles:
    """What this process knows to hold a manifest entry's bytes: (device, inode) -> identity and digest."""

    def __init__(self) -> None:
        self._known: dict[tuple[int, int], tuple[Identity, str]] = {}

    def remember(self, st: os.stat_result, entry: ManifestFile) -> None:
        """`st` is a file just hashed and found to match `entry`."""
        self._known[(st.st_dev, st.st_ino)] = ((st.st_size, st.st_mtime_ns, st.st_ctime_ns), f"{entry.algorithm}:{entry.digest}")

    def holds(self, st: os.stat_result, entry: ManifestFile) -> bool:
        known = self._known.get((st.st_dev, st.st_ino))
        identity = ((st.st_size, st.st_mtime_ns, st.st_ctime_ns), f"{entry.algorithm}:{entry.digest}")
        return known == identity and st.st_size == entry.size


def check_cached_file(path: str, entry: ManifestFile, verified: VerifiedFiles) -> str | None:
    """What is wrong with the cached file at `path` against its manifest entry; None when it
    holds exactly those bytes (known from its unchanged identity, else hashed now)."""
    try:
        with open_regular(path) as f:
            before = os.fstat(f.fileno())
            if verified.holds(before, entry):
                return None
            size, digest = copy_hashing(f, None, new_hasher(entry.algorithm), limit=entry.size + 1)
            after = os.fstat(f.fileno())
    except FileNotFoundError:
        return "missing from the cache"
    except NotRegularFile as exc:
        return f"{exc.strerror} in the cache"
    if (before.st_size, before.st_mtime_ns, before.st_ctime_ns) != (after.st_size, after.st_mtime_ns, after.st_ctime_ns):
        return "changed while it was being verified"
    problem = mismatch(entry, size, digest)
    if problem is None:
        verified.remember(after, entry)
    return problem


def hash_regular(path: str, limit: int, algorithm: str) -> tuple[int, str, os.stat_result]:
    """(size up to `limit`, hex digest under `algorithm`, stat) of the regular file at `path`."""
    with open_regular(path) as f:
        size, digest = copy_hashing(f, None, new_hasher(algorithm), limit=limit)
        return size, digest, os.fstat(f.fileno())


@contextmanager
def locked(path: str, *, blocking: bool = True) -> Iterator[bool]:
    """flock `path` (created if needed); yields False at once if non-blocking and it is held.

    Eviction unlinks the lock files of evicted versions while holding them, so after acquiring,
    check the path still names the locked file; if not, lock the new one. A symlink planted at
    the path is removed, never opened.
    """
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | _OPEN, 0o644)
        except OSError as exc:
            if exc.errno != errno.ELOOP:
                raise
            os.unlink(path)
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
        except BlockingIOError:
            os.close(fd)
            yield False
            return
        try:
            if os.stat(path, follow_symlinks=False).st_ino == os.fstat(fd).st_ino:
                break
        except FileNotFoundError:
            pass
        os.close(fd)
    try:
        yield True
    finally:
        os.close(fd)


def cached_manifest(version_dir: str) -> bytes | None:
    """The raw manifest a pull kept in `version_dir` (a real directory); None where there is none."""
    if not is_real_dir(version_dir):
        return None
    return read_regular(os.path.join(version_dir, MANIFEST_NAME))


def read_cached_manifest(version_dir: str) -> Manifest:
    """The manifest a pull kept in `version_dir` (a pulled version), parsed strictly: what a
    reader of the version's weights (decentrl/store/weights.py) goes by to know which files are its."""
    where = os.path.join(version_dir, MANIFEST_NAME)
    raw = cached_manifest(version_dir)
    if raw is None:
        raise VerificationError(f"{where}: missing (or not a regular file); pull the version again")
    return parse_manifest(raw, where)[0]


def dir_bytes(path: str) -> int:
    return sum(entry.stat(follow_symlinks=False).st_size for entry in os.scandir(path) if entry.is_file(follow_symlinks=False))
