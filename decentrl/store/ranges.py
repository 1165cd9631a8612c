"""A remote store's large files pulled as concurrent byte ranges, each resumable where it stopped.

`CheckpointStore._fetch_resuming` (decentrl/store/checkpoints.py) hands here every file of an S3
store, and every file larger than `MIN_RANGED` (256 KiB) of another remote store; the rest, and
every file of a local store, keep the whole-file stream there. A file's part is its size over
`[store] parallel_reads`, at least `[store] min_part_kb` (256 KiB) and at most `[store] part_mb`: a
delta of a few MB is several ranges, not one stream (one TCP stream on L2 carries 1.3 Mbit/s of a
50 Mbit/s link). Smaller parts suit a small file on a long lossy link and cost the store more
requests (the figures: the setting's description, decentrl/config/store.py). A part is also at
least what one stream carries while a request waits for its answer (`Pace`, measured by the
pull's own ranges): a store slow to answer gets fewer, larger requests.

No HEAD first: an S3 range's answer says the object's size (`Content-Range: bytes a-b/SIZE`), which
is checked against the manifest's before a byte of it is written (`StoredSizeMismatch`); a range
past the end of a shorter object asks its size (`_stored_size`). A HEAD would cost a round trip
before the first byte (150 ms on L2, 300 ms on L3); a small file is one GET. An object found the
wrong size is asked its size first on the next attempt: what a truncated object costs is one
attempt's bytes in flight.

Why ranges: one TCP stream carries at most about MSS/RTT * 1.22/sqrt(loss) (Mathis et al.), some
1.3 Mbit/s at 150 ms and 0.5% loss, whatever the link; K streams, each its own connection, add
up. `RangedReads` owns a pool of `[store] parallel_reads` threads, shared by every file of every
pull of its store, so the reads in flight stay bounded however many files a version has. A file's
missing bytes are cut into ranges of its part (`part_for`), which its streams take in order
(`Ranges`). A stream that finds none left takes the far half of the range still streaming with
the most time left, as segmented downloaders do, so the streams end together instead of one slow
part holding the file's end (at 1.3 Mbit/s an 8 MiB part takes 50 s); until one is worth
splitting it looks again every `_SPLIT_POLL_S`, unless another file's streams wait for a thread.
Only a range with more than `_SPLIT_AFTER_S` left at its own rate is split: the request it
abandons at its new end loses the bytes in flight past it, which on a fast link (large windows)
would cost more than the wait.

Resume: the partial file is preallocated (sparse) to its declared size, and each range's bytes are
written in place (pwrite) as they arrive, a `_PIECE` at most at a time. `RangeRecord` logs the
byte intervals written in ``<file>.ranges`` beside it, a line after every piece, so an
interrupted pull - a failed range, a killed process - fetches only what is missing, never from
byte 0. What is lost per interruption is what was in flight: bytes in the network's buffers, and,
after a kill, at most a piece per stream (after an error the S3 stream writes what it read first).

Verification stays whole-file: once every range is in, the file is hashed and `_download` checks
size and digest against the manifest, as for a streamed file. A manifest holds one digest per
file, so a mismatch cannot say which range was wrong: the caller discards the file and its record
(`discard`) and the next attempt fetches all of it again; a version that keeps failing is refused
and never loaded. The hash after assembly reads the file back once from the page cache (BLAKE3 on
every core; docs/store.md has the figure).

Retries: a range that fails (a cut connection, a 5xx that outlasts s3fs's own retries, no byte for
`stall_timeout_s`, no answer for `_ANSWER_STALLS` times that) is retried from where it stopped after a jittered exponential back-off; a
failure after some progress counts as the first. After `_ATTEMPTS` failures in a row without a
byte, the error propagates and the pull reports it as a StoreError, as for a streamed file.
"""

from __future__ import annotations

import asyncio
import errno
import functools
import logging
import os
import re
import stat
import threading
import time
from collections import deque
from collections.abc import Callable, Coroutine, Iterator
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from contextlib import closing
from dataclasses import dataclass
from typing import Any

from fsspec.asyn import sync
from fsspec.spec import AbstractFileSystem

from decentrl.backoff import backoff
from decentrl.store.cache import CHUNK, hash_regular, open_regular, read_regular, remove_path

RECORD_SUFFIX = ".ranges"  # beside a partial file: the byte intervals it holds
# Bytes written (and recorded) at a time: what a killed pull loses per stream, against one thread hop
# and one line of the record per piece (a few microseconds).
_PIECE = 256 * 1024
# Files of a remote store other than S3 larger than this are ranged (each needs its size first).
MIN_RANGED = _PIECE
_LINE_BYTES = 48  # at most, of one line of a record: two integers of up to 20 digits
_ATTEMPTS = 5  # failures in a row, without a byte between them, before a range gives up
_MIN_SPLIT = 4 * _PIECE  # a range still streaming is split only with at least twice this much left
_SPLIT_AFTER_S = 2.0  # ... and more than this long left at the rate it has had
_RATE_AFTER_S = 1.0  # a range's rate is known once it has streamed this long
_SPLIT_POLL_S = 0.25  # how often a stream with nothing to take looks again
_BACKOFF_CAP_S = 10.0  # a range's longest wait before it is retried
# A range's request waits this many stall bounds for its answer: a store under load is slow to start
# answering (moto on loaded cores passed 8 s for 1,076 requests of one run, each asked again, 2026-11-28).
_ANSWER_STALLS = 3

_CONTENT_RANGE = re.compile(r"bytes (?P<first>\d+)-(?P<last>\d+)/(?P<size>\d+)")

log = logging.getLogger("decentrl.store.ranges")

# Bytes [start, end) of a remote file of a declared size, in pieces as they arrive; the last argument
# is the stall bound. Raises StoredSizeMismatch where the object has another size. A source may
# yield one empty piece first, once the store has answered (its wait, timed by `Pace`).
ChunkSource = Callable[[AbstractFileSystem, str, int, int, int, float], Iterator[bytes]]


@functools.cache
def read_errors() -> tuple[type[Exception], ...]:
    """What a backend raises when the store cannot be read: OSError (fsspec's convention), the
    botocore errors s3fs lets through untranslated (EndpointConnectionError: endpoint down), and
    aiohttp's for a body cut mid-read (ClientPayloadError), which aiobotocore passes on as is."""
    from aiohttp import ClientError as HttpError  # s3fs's dependencies, hence ours
    from botocore.exceptions import BotoCoreError, ClientError

    return (OSError, BotoCoreError, ClientError, HttpError)


class Stalled(OSError):
    """No byte arrived for the stall bound: the read is abandoned (its connection closed) and retried."""


class StoredSizeMismatch(Exception):
    """The store's object is not the size its manifest entry declares; nothing was fetched."""

    def __init__(self, stored: int) -> None:
        super().__init__(stored)
        self.stored = stored


def discard(local_path: str) -> None:
    """Drop a partial file and its record: its bytes cannot be trusted (a digest mismatch)."""
    remove_path(local_path)
    remove_path(local_path + RECORD_SUFFIX)


class RangeRecord:
    """The byte intervals of a partial file that hold the store's bytes, logged in `path`: a line
    ``size S``, then a line ``start end`` appended (one write, no rewrite) after each piece was
    written. Opening one compacts the log to its merged intervals. The cache is shared, so a
    record is a claim, not a proof: the whole-file digest still decides."""

    def __init__(self, path: str, size: int, done: list[tuple[int, int]]) -> None:
        self.path, self.size = path, size
        self._done = _merged(done)
        self._lock = threading.Lock()
        tmp = f"{path}.tmp"
        with open_regular(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC) as f:
            f.write("".join(f"{line}\n" for line in [f"size {size}", *(f"{a} {b}" for a, b in self._done)]).encode())
        os.replace(tmp, path)
        self._log = open_regular(path, os.O_WRONLY | os.O_APPEND)

    @staticmethod
    def read(path: str, size: int) -> list[tuple[int, int]] | None:
        """The intervals the record at `path` claims for a file of `size` bytes; None where there
        is none, or it is not such a file's record in full (a line that does not parse - a write
        torn by a power cut - or an interval outside the file): the partial file starts again."""
        raw = read_regular(path, limit=_LINE_BYTES * (size // _PIECE + 4096))
        if raw is None or not raw.endswith(b"\n"):
            return None
        header, *lines = raw[:-1].split(b"\n")
        if header != f"size {size}".encode():
            return None
        done = []
        for line in lines:
            fields = line.split(b" ")
            if len(fields) != 2 or not all(field.isdigit() for field in fields):
                return None
            start, end = int(fields[0]), int(fields[1])
            if not start < end <= size:
                return None
            done.append((start, end))
        return _merged(done)

    def add(self, start: int, end: int) -> None:
        with self._lock:
            self._done = _merged([*self._done, (start, end)])
            os.write(self._log.fileno(), f"{start} {end}\n".encode())

    def close(self) -> None:
        self._log.close()

    def missing(self, part: int) -> list[tuple[int, int]]:
        """The byte ranges not yet held, each at most `part` long, in file order."""
        with self._lock:
            gaps, at = [], 0
            for start, end in [*self._done, (self.size, self.size)]:
                gaps += [(a, min(a + part, start)) for a in range(at, start, part)]
                at = end
            return gaps


def _merged(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Intervals sorted, overlapping and adjacent ones joined."""
    merged: list[tuple[int, int]] = []
    for a, b in sorted(intervals):
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    return merged


async def _within(awaitable: Coroutine[Any, Any, Any], stall_s: float, what: str) -> Any:
    try:
        return await asyncio.wait_for(awaitable, stall_s)
    except TimeoutError:
        raise Stalled(f"{what}: nothing for {stall_s:g} s") from None


async def _read_some(body: Any, n: int, stall_s: float) -> tuple[bytes, BaseException | None]:
    """Up to `n` bytes of a streaming body (fewer at its end), and the error that stopped the
    read early, if any: the bytes read before an error are returned with it, to be written
    before the retry instead of fetched again."""
    got = bytearray()
    try:
        while len(got) < n:
            data = await _within(body.read(n - len(got)), stall_s, "reading a range")
            if not data:
                break
            got += data
    except read_errors() as exc:
        return bytes(got), exc
    return bytes(got), None


async def _close(body: Any) -> None:
    body.close()  # on the loop that owns the connection: aiohttp transports are not thread-safe


def s3_chunks(fs: Any, path: str, start: int, end: int, size: int, stall_s: float) -> Iterator[bytes]:
    """Bytes [start, end) of an S3 object of `size` bytes from one streaming ranged GET, as they
    arrive (up to a `_PIECE` at a time), after its answer's Content-Range shows that size. s3fs has
    no public streaming ranged read; `_call_s3` is what its own reads call (credentials, request
    options, its retries of a failed request)."""
    bucket, key, version_id = fs.split_path(path)
    extra = {"VersionId": version_id} if version_id else {}
    request = fs._call_s3("get_object", Bucket=bucket, Key=key, Range=f"bytes={start}-{end - 1}", **extra)
    try:
        response = sync(fs.loop, _within, request, _ANSWER_STALLS * stall_s, "asking for a range")
    except OSError as exc:  # s3fs's translation of InvalidRange (416): past the end of a shorter object
        if exc.errno == errno.EINVAL and "range" in str(exc).lower():
            raise StoredSizeMismatch(_stored_size(fs, path)) from None
        raise
    body = response["Body"]
    try:
        yield b""  # the answer is in: what the request waited is timed apart from its body (`Pace`)
        answered = str(response.get("ContentRange") or "")
        match = _CONTENT_RANGE.fullmatch(answered)
        if match is not None and int(match["size"]) != size:
            raise StoredSizeMismatch(int(match["size"]))
        if match is None or (int(match["first"]), int(match["last"])) != (start, end - 1):
            raise OSError(f"{path}: asked for bytes {start}-{end - 1}, the store answered {answered or 'the whole object'}")
        while True:
            data, error = sync(fs.loop, _read_some, body, _PIECE, stall_s)
            if data:
                yield data
            if error is not None:
                raise error
            if not data:
                return
    finally:
        sync(fs.loop, _close, body)


def cat_chunks(fs: AbstractFileSystem, path: str, start: int, end: int, size: int, stall_s: float) -> Iterator[bytes]:
    """Bytes [start, end) through fsspec's `cat_file`, one ranged read per CHUNK: any filesystem.
    The object's size was checked before (`RangedReads.fetch`); its stalls are bounded by the
    filesystem's own timeouts, not by `stall_s`."""
    while start < end:
        data = fs.cat_file(path, start=start, end=min(end, start + CHUNK))
        if not data:
            return
        yield data
        start += len(data)


def _stored_size(fs: AbstractFileSystem, path: str) -> int:
    fs.invalidate_cache(path)  # a listing's cached size may be older than the object
    return int(fs.size(path))


def chunk_source(fs: AbstractFileSystem) -> ChunkSource:
    """The streaming read for S3 (s3fs), fsspec's ranged `cat_file` for any other filesystem."""
    from s3fs import S3FileSystem  # s3fs is a dependency; loaded only for a remote store

    return s3_chunks if isinstance(fs, S3FileSystem) else cat_chunks


class Pace:
    """What a request to this store costs, seen by this pull's streams: the wait for an answer
    (request to headers: a round trip plus the store's queue) and the rate of one stream's body,
    each a moving average. A range shorter than rate x wait spends more time asking than
    carrying; a store on loaded cores (moto on the testbed: answers p50 0.6 s in 256 KiB parts, 8
    workers, 2026-11-28) then slows every pull, the more so the more ranges each asks for."""

    _WEIGHT = 0.2  # of the newest observation in each average
    _MIN_TIMED = _PIECE // 2  # a body shorter than this says little about the rate

    def __init__(self) -> None:
        self.answer_s: float | None = None
        self.rate: float | None = None  # bytes/s of one stream
        self._lock = threading.Lock()

    def answered(self, seconds: float) -> None:
        with self._lock:
            self.answer_s = self._averaged(self.answer_s, seconds)

    def streamed(self, n: int, seconds: float) -> None:
        if n < self._MIN_TIMED or seconds <= 0:
            return
        with self._lock:
            self.rate = self._averaged(self.rate, n / seconds)

    @classmethod
    def _averaged(cls, average: float | None, seen: float) -> float:
        return seen if average is None else average + cls._WEIGHT * (seen - average)

    def amortized(self) -> int:
        """The bytes one stream carries while a request waits for its answer (0 until both known)."""
        with self._lock:
            return 0 if self.answer_s is None or self.rate is None else int(self.rate * self.answer_s)


@dataclass
class Range:
    """Bytes [at, end) of a file still to fetch: `at` moves up as bytes are written, `end` down
    when a split hands the far half to another stream; `first` and `since`: where and when this
    stream took it (its rate)."""

    at: int
    end: int
    first: int = 0
    since: float = 0.0

    def seconds_left(self, now: float) -> float | None:
        """At the rate it has had; None before `_RATE_AFTER_S` (not known yet)."""
        if now - self.since < _RATE_AFTER_S:
            return None
        done = self.at - self.first
        return (self.end - self.at) * (now - self.since) / done if done > 0 else float("inf")


class Ranges:
    """The ranges of one file, handed to its streams one at a time (thread-safe)."""

    def __init__(self, missing: list[tuple[int, int]], streams: int) -> None:
        self.unstarted = streams  # of this file's streams, those still waiting for a thread (RangedReads' lock)
        self._pending = deque(Range(a, b) for a, b in missing)
        self._streaming: list[Range] = []
        self._lock = threading.Lock()
        self._finished = threading.Condition(self._lock)

    def take(self, now: float) -> Range | None:
        """The next range; with none pending, the far half of the range streaming with the most
        time left, where that is more than `_SPLIT_AFTER_S` (and two `_MIN_SPLIT`s); else None."""
        with self._lock:
            if self._pending:
                taken = self._pending.popleft()
            else:
                known = [(left, r) for r in self._streaming if r.end - r.at >= 2 * _MIN_SPLIT
                         and (left := r.seconds_left(now)) is not None]
                if not known:
                    return None
                left, slowest = max(known, key=lambda pair: pair[0])
                if left <= _SPLIT_AFTER_S:
                    return None
                middle = slowest.at + (slowest.end - slowest.at) // 2
                taken, slowest.end = Range(middle, slowest.end), middle
            taken.first, taken.since = taken.at, now
            self._streaming.append(taken)
            return taken

    def splittable(self) -> bool:
        """Whether a range is pending, or one streaming is large enough to be split later."""
        with self._lock:
            return bool(self._pending) or any(r.end - r.at >= 2 * _MIN_SPLIT for r in self._streaming)

    def finished(self, taken: Range) -> None:
        with self._lock:
            self._streaming.remove(taken)
            self._finished.notify_all()

    def wait(self, timeout: float) -> None:
        """Until a range is finished (a stream waiting to split may then end), or `timeout`."""
        with self._lock:
            self._finished.wait(timeout)


class RangedReads:
    """Large files of one remote store fetched as concurrent, resumable byte ranges."""

    def __init__(
        self, fs: AbstractFileSystem, *, parallel_reads: int, part_bytes: int, stall_timeout_s: float, min_part_bytes: int = MIN_RANGED,
    ) -> None:
        self.fs = fs
        self.streams = parallel_reads
        self.part = part_bytes
        self.min_part = min(min_part_bytes, part_bytes)
        self.stall_s = stall_timeout_s
        self.chunks = chunk_source(fs)
        # Shared by every file of every pull of this store: the bound on ranges in flight.
        self.pool = ThreadPoolExecutor(parallel_reads, thread_name_prefix="store-range")
        self._waiting = 0  # streams submitted to the pool and not started: one with nothing to take yields to another file's
        self._waiting_lock = threading.Lock()
        self._mismatched: set[str] = set()  # objects whose ranges answered another size than declared
        self.pace = Pace()

    def applies(self, local_path: str, size: int) -> bool:
        """Whether a file goes by ranges: any file of S3 but an empty one (a range's answer says
        its size), larger than `MIN_RANGED` elsewhere, or already started as ranges."""
        smallest = 0 if self.chunks is s3_chunks else MIN_RANGED
        return size > smallest or os.path.lexists(local_path + RECORD_SUFFIX)

    def part_for(self, size: int) -> int:
        """The range size for a file of `size` bytes: one range per stream, within
        [`[store] min_part_kb`, `[store] part_mb`], and at least what a stream carries while a
        request waits for its answer (`Pace.amortized`)."""
        return min(self.part, max(self.min_part, -(-size // self.streams), self.pace.amortized()))

    def fetch(self, remote: str, local_path: str, size: int, algorithm: str) -> tuple[int, str, os.stat_result]:
        """Fetch what `local_path` lacks of `remote` (declared `size` bytes) as ranges in parallel;
        then (size, digest, stat) of the whole file, as `_fetch_resuming` returns them. Raises
        StoredSizeMismatch, writing nothing, when the store's object has another size (S3: seen in
        the ranges' answers; elsewhere asked first)."""
        if (self.chunks is not s3_chunks or remote in self._mismatched) and (stored := _stored_size(self.fs, remote)) != size:
            raise StoredSizeMismatch(stored)
        self._mismatched.discard(remote)
        record = self._prepare(local_path, size)
        try:
            missing = record.missing(self.part_for(size))
            # Every stream where a range could be split (the spare ones split the slow ones), else one a range.
            streams = self.streams if any(b - a >= 2 * _MIN_SPLIT for a, b in missing) else min(self.streams, len(missing))
            ranges = Ranges(missing, streams)
            with open_regular(local_path, os.O_WRONLY) as f:
                stop = threading.Event()
                with self._waiting_lock:
                    self._waiting += streams
                futures = [self.pool.submit(self._stream, remote, f.fileno(), ranges, record, stop) for _ in range(streams)]
                try:
                    wait(futures, return_when=FIRST_EXCEPTION)
                finally:
                    stop.set()  # the others stop after their current piece (recorded: it was written)
                    wait(futures)
                for future in futures:
                    future.result()  # a stream's failure
        except StoredSizeMismatch:
            self._mismatched.add(remote)  # its next fetch asks the size first: no more bytes of a wrong object
            discard(local_path)  # laid out for another size: nothing of it is the store's object
            raise
        finally:
            record.close()
        os.remove(record.path)
        return hash_regular(local_path, size + 1, algorithm)

    def _prepare(self, local_path: str, size: int) -> RangeRecord:
        """The record of `local_path`, made ready to take ranges: resumed where its record and
        the file agree; a file without a record is a whole-file stream's, appended from byte 0,
        whose bytes count; anything else is started again."""
        record_path = local_path + RECORD_SUFFIX
        done = RangeRecord.read(record_path, size)
        try:
            st = os.lstat(local_path)
        except FileNotFoundError:
            st = None
        regular = st is not None and stat.S_ISREG(st.st_mode)
        if done is not None and regular and st is not None and st.st_size == size:
            return RangeRecord(record_path, size, done)
        if done is None and regular and st is not None and st.st_size <= size:
            done = [(0, st.st_size)] if st.st_size else []
        else:
            done = []
            remove_path(local_path)
        # The record before the file is preallocated: a full-size file without one reads as complete.
        record = RangeRecord(record_path, size, done)
        with open_regular(local_path, os.O_WRONLY | os.O_CREAT) as f:
            os.ftruncate(f.fileno(), size)
        return record

    def _stream(self, remote: str, fd: int, ranges: Ranges, record: RangeRecord, stop: threading.Event) -> None:
        """One stream of a file: its ranges, one after another, until none is left to take or split
        (or another file's streams wait for this thread)."""
        with self._waiting_lock:
            self._waiting -= 1
            ranges.unstarted -= 1
        while not stop.is_set():
            taken = ranges.take(time.monotonic())
            if taken is None:
                with self._waiting_lock:
                    others_wait = self._waiting > ranges.unstarted
                if others_wait or not ranges.splittable():
                    return
                ranges.wait(_SPLIT_POLL_S)
                continue
            try:
                self._fetch_range(remote, fd, taken, record, stop)
            finally:
                ranges.finished(taken)

    def _fetch_range(self, remote: str, fd: int, taken: Range, record: RangeRecord, stop: threading.Event) -> None:
        """The range's bytes into `fd` at their offsets, each piece recorded once written; retried
        from where it stopped (module docstring). A split lowers `taken.end` meanwhile: the read
        stops there, and its request is abandoned (a few bytes in flight past it are lost)."""
        failures = 0
        while taken.at < taken.end and not stop.is_set():
            before = taken.at
            asked, answered = time.monotonic(), None
            try:
                with closing(self.chunks(self.fs, remote, taken.at, taken.end, record.size, self.stall_s)) as pieces:
                    for data in pieces:
                        if not data:  # the answer's headers
                            answered = time.monotonic()
                            self.pace.answered(answered - asked)
                            continue
                        data = data[: max(0, taken.end - taken.at)]
                        os.pwrite(fd, data, taken.at)
                        record.add(taken.at, taken.at + len(data))
                        taken.at += len(data)
                        if taken.at >= taken.end or stop.is_set():
                            if answered is not None:
                                self.pace.streamed(taken.at - before, time.monotonic() - answered)
                            return
                raise OSError(f"{remote}: the store ended the range before byte {taken.end}, at {taken.at}")
            except FileNotFoundError:
                raise
            except read_errors() as exc:
                failures = 1 if taken.at > before else failures + 1
                if failures >= _ATTEMPTS:
                    raise
                delay = backoff(failures, cap_s=_BACKOFF_CAP_S)
                log.warning(
                    "%s bytes %d-%d: %s (%s); retrying from the first in %.1fs",
                    remote, taken.at, taken.end - 1, type(exc).__name__, exc, delay,
                )
                stop.wait(delay)
