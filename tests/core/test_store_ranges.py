"""Large files of a remote store pulled as parallel, resumable byte ranges (decentrl/store/ranges.py).

Against a real S3-protocol server (moto's, on 127.0.0.1) behind a small TCP relay that counts the
bytes served and can cut the link, take it down or hold it (a silent stall): the ranged pull equals
the whole-file stream bit for bit, reads no more ranges at once than configured, resumes only the
missing bytes after a blip or a failed pull (bytes served <= 1.1x the file), sees a stall within its
bound, and refuses a corrupted or truncated object. The generic path (fsspec `cat_file`) on
`memory://`. `DECENTRL_LONG_TESTS=1` adds the single-stream vs parallel measurement of docs/store.md.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from decentrl.config import ConfigError, StoreConfig, parse_config
from decentrl.store import checkpoints as store_mod
from decentrl.store import ranges
from decentrl.store.checkpoints import CheckpointStore, StoreError, VerificationError
from decentrl.store.ranges import RECORD_SUFFIX, RangeRecord, Ranges

pytestmark = pytest.mark.integration  # a real S3 protocol server (moto) on loopback

ROOT = Path(__file__).resolve().parents[2]
MB = 2**20
BIG = "model-00001-of-00001.safetensors"


class Relay:
    """A TCP relay in front of the S3 server: counts the bytes it serves (server to client), and
    can cut every connection once a budget is served (`down` then refuses new ones until `restore`,
    or for `heal_after_s`), or instead hold every response from then on (`stall`: connections stay
    open, no byte flows; for `heal_after_s`)."""

    def __init__(self, upstream: int) -> None:
        self.upstream = upstream
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.served = 0
        self.budget: int | None = None
        self.heal_after_s: float | None = None
        self.stall = False
        self.cuts = 0
        self.down = threading.Event()
        self.held = threading.Event()
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            if self.down.is_set():
                client.close()
                continue
            server = socket.create_connection(("127.0.0.1", self.upstream))
            with self._lock:
                self._open |= {client, server}
            threading.Thread(target=self._pump, args=(client, server, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, True), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, serving: bool) -> None:
        try:
            while data := src.recv(64 * 1024):
                while serving and self.held.is_set() and not self.down.is_set():
                    time.sleep(0.01)
                if self.down.is_set():
                    break
                cut = False
                if serving:
                    with self._lock:
                        if self.budget is not None and self.served + len(data) >= self.budget:
                            data, cut = data[: self.budget - self.served], True
                dst.sendall(data)
                if serving:
                    with self._lock:
                        self.served += len(data)
                if cut and self.stall:
                    self.held.set()
                    self.budget = None
                    if self.heal_after_s is not None:
                        threading.Timer(self.heal_after_s, self.held.clear).start()
                elif cut:
                    self.cut()
                    break
        except OSError:
            pass
        finally:
            for sock in (src, dst):  # shut down first: close() alone does not wake the other pump's recv
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                sock.close()

    def cut(self) -> None:
        """The link goes down: every connection is reset, new ones are refused."""
        self.down.set()
        if self.heal_after_s is not None:
            threading.Timer(self.heal_after_s, self.restore).start()
        with self._lock:
            self.cuts += 1
            for sock in self._open:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            self._open.clear()

    def restore(self) -> None:
        self.budget = None
        self.down.clear()

    def close(self) -> None:
        self.cut()
        self.listener.close()


@pytest.fixture(scope="module")
def moto_port() -> Iterator[int]:
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    yield server.get_host_and_port()[1]
    server.stop()


@pytest.fixture
def relay(moto_port: int) -> Iterator[Relay]:
    relay = Relay(moto_port)
    yield relay
    relay.close()


def s3_options(port: int) -> dict[str, object]:
    # One attempt per request at the botocore and s3fs levels: the retries under test are the store's.
    return {
        "key": "testing", "secret": "testing", "skip_instance_cache": True,
        "client_kwargs": {"endpoint_url": f"http://127.0.0.1:{port}", "region_name": "us-east-1"},
        "config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 2, "max_pool_connections": 32},
    }


def new_bucket(port: int) -> str:
    import boto3

    bucket = f"ranges-{uuid.uuid4().hex[:12]}"
    boto3.client(
        "s3", endpoint_url=f"http://127.0.0.1:{port}", aws_access_key_id="testing",
        aws_secret_access_key="testing", region_name="us-east-1",
    ).create_bucket(Bucket=bucket)
    return f"s3://{bucket}/run"


def s3_store(url: str, port: int, **settings: object) -> CheckpointStore:
    store = CheckpointStore(url, s3_options(port), **settings)  # type: ignore[arg-type]
    store.fs.retries = 1  # s3fs's own retries of a request
    return store


@pytest.fixture(autouse=True)
def quick_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(store_mod, "_RETRY_DELAYS", (0.0, 0.0))
    monkeypatch.setattr(ranges, "backoff", lambda failures, base_s=0.5, cap_s=30.0: 0.05)


def make_ckpt(tmp_path: Path, size: int, name: str = "src", *, small: bool = True) -> Path:
    d = tmp_path / name
    d.mkdir()
    (d / BIG).write_bytes(os.urandom(size))
    if small:
        (d / "config.json").write_text(json.dumps({"name": name}))
    return d


def published(tmp_path: Path, moto_port: int, size: int, *, small: bool = True) -> tuple[str, Path]:
    """A bucket with version 0 (one large file of `size` bytes, and a small one) published straight to moto."""
    url, src = new_bucket(moto_port), make_ckpt(tmp_path, size, small=small)
    s3_store(url, moto_port).publish(0, str(src))
    return url, src


def test_ranged_pull_equals_the_stream_bit_for_bit(tmp_path: Path, moto_port: int, relay: Relay) -> None:
    url = new_bucket(moto_port)
    src = make_ckpt(tmp_path, 5 * MB + 7)  # a short last part
    (src / "model-extra.safetensors").write_bytes(os.urandom(3 * MB + 1))
    s3_store(url, moto_port).publish(0, str(src))
    parallel = s3_store(url, relay.port, parallel_reads=3, part_mb=1)
    streamed = s3_store(url, moto_port, part_mb=64)
    pieces = []
    real = parallel.ranged.chunks

    def counting(*args: object) -> Iterator[bytes]:
        pieces.append(args[2:4])
        yield from real(*args)

    parallel.ranged.chunks = counting
    a = Path(parallel.pull(0, str(tmp_path / "a")))
    b = Path(streamed.pull(0, str(tmp_path / "b")))
    for name in (BIG, "model-extra.safetensors", "config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes() == (src / name).read_bytes()
    assert sorted(p.name for p in a.iterdir()) == sorted(p.name for p in b.iterdir())  # no record left behind
    assert len(pieces) >= 6 + 4 and all(end - start <= MB for start, end in pieces)  # config.json streamed whole
    assert relay.served < (8 * MB + 8) * 1.01


def test_ranges_in_flight_are_bounded_across_files(tmp_path: Path, moto_port: int) -> None:
    url = new_bucket(moto_port)
    src = tmp_path / "src"
    src.mkdir()
    for i in range(3):
        (src / f"model-{i}.safetensors").write_bytes(os.urandom(4 * MB))
    s3_store(url, moto_port).publish(0, str(src))
    store = s3_store(url, moto_port, parallel_reads=2, part_mb=1, download_concurrency=3)
    lock, now, most = threading.Lock(), [0], [0]
    real = store.ranged.chunks

    def counting(*args: object) -> Iterator[bytes]:
        with lock:
            now[0] += 1
            most[0] = max(most[0], now[0])
        try:
            time.sleep(0.05)  # long enough for every file's ranges to be queued together
            yield from real(*args)
        finally:
            with lock:
                now[0] -= 1

    store.ranged.chunks = counting
    out = Path(store.pull(0, str(tmp_path / "cache")))
    assert most[0] == 2
    assert all((out / f"model-{i}.safetensors").read_bytes() == (src / f"model-{i}.safetensors").read_bytes() for i in range(3))


def test_a_blip_mid_pull_resumes_each_range_where_it_stopped(
    tmp_path: Path, moto_port: int, relay: Relay, caplog: pytest.LogCaptureFixture
) -> None:
    size = 24 * MB
    url, src = published(tmp_path, moto_port, size)
    store = s3_store(url, relay.port, parallel_reads=4, part_mb=2)
    relay.budget, relay.heal_after_s = size // 2, 0.3  # every connection cut half-way, the link back 0.3 s later
    with caplog.at_level(logging.WARNING, logger="decentrl.store.ranges"):
        out = Path(store.pull(0, str(tmp_path / "cache")))
    assert (out / BIG).read_bytes() == (src / BIG).read_bytes()
    assert relay.cuts == 1 and "retrying from" in caplog.text
    print(f"served / object: {relay.served / size:.4f}")  # docs/store.md quotes it (-s)
    assert relay.served <= 1.1 * size, relay.served / size


def test_a_failed_pull_leaves_its_ranges_and_the_next_fetches_only_the_rest(
    tmp_path: Path, moto_port: int, relay: Relay
) -> None:
    size = 16 * MB
    url, src = published(tmp_path, moto_port, size)
    store = s3_store(url, relay.port, parallel_reads=4, part_mb=1)
    relay.budget = size * 2 // 5  # the link goes down for good at 40%
    with pytest.raises(StoreError, match="download failed .*check the store is reachable"):  # the weights' or a small file's
        store.pull(0, str(tmp_path / "cache"))
    partial = tmp_path / "cache" / ".v000000.partial" / BIG
    done = RangeRecord.read(str(partial) + RECORD_SUFFIX, size)
    assert done is not None and partial.stat().st_size == size
    held = sum(b - a for a, b in done)
    assert 0.3 * size < held <= relay.served
    first = relay.served

    relay.restore()
    out = Path(store.pull(0, str(tmp_path / "cache")))
    assert (out / BIG).read_bytes() == (src / BIG).read_bytes()
    second = relay.served - first
    assert second <= (size - held) * 1.02 + 64 * 1024, (second, size - held)  # the missing bytes, and headers
    print(f"served / object: {relay.served / size:.4f}")  # docs/store.md quotes it (-s)
    assert relay.served <= 1.1 * size, relay.served / size


KILLED_PULL = """
import json, sys
from decentrl.store.checkpoints import CheckpointStore
a = json.loads(sys.argv[1])
store = CheckpointStore(a["url"], a["options"], parallel_reads=3, part_mb=2)
store.fs.retries = 1
store.pull(0, a["cache"])
"""


def test_a_killed_pull_resumes_from_its_record(tmp_path: Path, moto_port: int, relay: Relay) -> None:
    size = 32 * MB
    url, src = published(tmp_path, moto_port, size)
    cache = tmp_path / "cache"
    relay.budget, relay.stall = size // 2, True  # half-way the store goes silent, and the puller is killed
    args = json.dumps({"url": url, "options": s3_options(relay.port), "cache": str(cache)})
    puller = subprocess.Popen([sys.executable, "-c", KILLED_PULL, args], env=os.environ | {"PYTHONPATH": str(ROOT)})
    try:
        deadline = time.monotonic() + 120
        while not relay.held.is_set():
            assert puller.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        time.sleep(0.3)
    finally:
        puller.kill()
        puller.wait()
    first = relay.served
    done = RangeRecord.read(str(cache / ".v000000.partial" / (BIG + RECORD_SUFFIX)), size)
    assert done is not None
    held = sum(b - a for a, b in done)
    assert first - 3 * ranges._PIECE - 2 * MB <= held <= first  # lost: a piece per stream, and what the network held

    relay.held.clear()
    out = Path(s3_store(url, relay.port, parallel_reads=3, part_mb=2).pull(0, str(cache)))
    assert (out / BIG).read_bytes() == (src / BIG).read_bytes()
    print(f"served / object: {relay.served / size:.4f}")  # docs/store.md quotes it (-s)
    assert relay.served <= 1.1 * size, relay.served / size


def test_a_stall_is_abandoned_and_retried_within_its_bound(
    tmp_path: Path, moto_port: int, relay: Relay, caplog: pytest.LogCaptureFixture
) -> None:
    size = 8 * MB
    url, src = published(tmp_path, moto_port, size)
    store = s3_store(url, relay.port, parallel_reads=4, part_mb=1, stall_timeout_s=0.5)
    # A third of the way in, no byte flows and no connection is closed (a silent drop), for 1.2 s.
    relay.budget, relay.stall, relay.heal_after_s = size // 3, True, 1.2
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="decentrl.store.ranges"):
        out = Path(store.pull(0, str(tmp_path / "cache")))
    assert (out / BIG).read_bytes() == (src / BIG).read_bytes()
    assert "Stalled" in caplog.text and "nothing for 0.5 s" in caplog.text
    assert time.monotonic() - started < 15
    print(f"served / object: {relay.served / size:.4f}")  # docs/store.md quotes it (-s)
    assert relay.served <= 1.1 * size


def test_a_slow_answer_is_waited_for_longer_than_a_stall(tmp_path: Path, moto_port: int, relay: Relay) -> None:
    """Asking for a range waits 3x stall_timeout_s for the answer (a loaded store starts answering
    late; asking again would add to its load); no byte for stall_timeout_s mid-body is a stall."""
    url, src = published(tmp_path, moto_port, MB)
    store = s3_store(url, relay.port, stall_timeout_s=1.0)
    remote = f"{store.root}/v000000/{BIG}"
    relay.held.set()  # no byte of any answer flows until the timer
    threading.Timer(1.5, relay.held.clear).start()  # past one stall bound, within three
    started = time.monotonic()
    data = b"".join(ranges.s3_chunks(store.fs, remote, 0, 1000, MB, 1.0))
    # (CI's loaded host once took 0.5 s more than the hold to answer: the bound leaves 1.5 s.)
    assert data == (src / BIG).read_bytes()[:1000] and 1.5 <= time.monotonic() - started < 3.0
    relay.held.set()
    threading.Timer(3.5, relay.held.clear).start()  # past 3 x 1 s
    with pytest.raises(ranges.Stalled, match="asking for a range: nothing for 3 s"):
        b"".join(ranges.s3_chunks(store.fs, remote, 0, 1000, MB, 1.0))


def test_a_store_slow_to_answer_gets_fewer_larger_ranges(tmp_path: Path, moto_port: int) -> None:
    """Each range's request waits 0.3 s for its answer (a store on loaded cores): the first pull
    learns what a request costs and what a stream carries meanwhile (`Pace`), and the next pull
    asks for parts at least that large (here the file in one range) instead of one per stream."""
    url = new_bucket(moto_port)
    writer = s3_store(url, moto_port)
    for version in (0, 1):
        writer.publish(version, str(make_ckpt(tmp_path, 4 * MB, f"v{version}", small=False)))
    store = s3_store(url, moto_port, parallel_reads=8, part_mb=8, min_part_kb=64)
    asked: list[tuple[int, int]] = []
    real = store.ranged.chunks

    def slow(*args: object) -> Iterator[bytes]:
        asked.append(args[2:4])  # type: ignore[arg-type]
        time.sleep(0.3)
        yield from real(*args)

    store.ranged.chunks = slow
    store.pull(0, str(tmp_path / "a"))
    assert len(asked) == 8 and {end - start for start, end in asked} == {MB // 2}  # 4 MiB / 8 streams
    pace = store.ranged.pace
    assert pace.answer_s is not None and 0.3 <= pace.answer_s < 1.0 and pace.rate is not None
    assert pace.amortized() > 4 * MB  # loopback carries far more than a file in 0.3 s
    asked.clear()
    out = Path(store.pull(1, str(tmp_path / "b")))
    assert asked == [(0, 4 * MB)]
    assert (out / BIG).read_bytes() == (tmp_path / "v1" / BIG).read_bytes()


def test_pace_averages_answers_and_rates_and_bounds_the_part() -> None:
    pace = ranges.Pace()
    assert pace.amortized() == 0
    pace.answered(0.5)
    assert pace.amortized() == 0  # no rate yet
    pace.streamed(1000, 0.001)  # too short a body to time
    assert pace.rate is None
    pace.streamed(MB, 0.5)
    assert pace.amortized() == MB
    pace.answered(1.5)  # the average moves a fifth of the way
    assert pace.answer_s == pytest.approx(0.7)
    reads = ranges.RangedReads(None, parallel_reads=32, part_bytes=8 * MB, stall_timeout_s=8.0, min_part_bytes=256 * 1024)  # type: ignore[arg-type]
    reads.pace = pace
    assert reads.part_for(2 * MB) == int(2 * MB * 0.7)  # rate x answer, above the 64 KiB a stream would get
    pace.answered(100.0)
    assert reads.part_for(64 * MB) == 8 * MB  # never past part_mb
    reads.pace = ranges.Pace()
    assert reads.part_for(2 * MB) == 256 * 1024  # unknown: min_part_kb


def test_a_stall_past_the_retries_is_a_store_error(
    tmp_path: Path, moto_port: int, relay: Relay, caplog: pytest.LogCaptureFixture
) -> None:
    size = 4 * MB
    # No small file: its whole-file stream (s3fs's own read) would time out too, and s3fs turns that
    # timeout into an IndexError (S3File._fetch_range reads FSTimeoutError().args[0]).
    url, _ = published(tmp_path, moto_port, size, small=False)
    options = s3_options(relay.port)
    options["config_kwargs"]["read_timeout"] = 0.5  # type: ignore[index] - s3fs's bound for the size request
    store = CheckpointStore(url, options, parallel_reads=2, part_mb=1, stall_timeout_s=0.2)
    store.fs.retries = 1
    relay.budget, relay.stall = size // 4, True  # silent from a quarter of the file on
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="decentrl.store.ranges"):
        with pytest.raises(StoreError, match="download failed .*check the store is reachable"):
            store.pull(0, str(tmp_path / "cache"))
    # Seen mid-body (no byte for 0.2 s) or, where the budget ran out between answers, asking (0.6 s).
    assert "Stalled (reading a range: nothing for 0.2 s)" in caplog.text or "Stalled (asking for a range: nothing for 0.6 s)" in caplog.text
    # The file's 3 attempts, each 5 tries of a range (0.2 s mid-body, 0.6 s asking) between
    # jittered back-offs (0.5 s doubling): some 14 s, not a hang.
    assert time.monotonic() - started < 30


def test_a_corrupted_object_is_refused_fetched_again_and_never_loaded(
    tmp_path: Path, moto_port: int, relay: Relay
) -> None:
    size = 6 * MB
    url, _ = published(tmp_path, moto_port, size)
    writer = s3_store(url, moto_port)
    path = f"{writer.root}/v000000/{BIG}"
    data = bytearray(writer.fs.cat_file(path))
    data[size // 2] ^= 0x01
    writer.fs.pipe_file(path, bytes(data))
    store = s3_store(url, relay.port, parallel_reads=3, part_mb=1)
    with pytest.raises(VerificationError, match=f"v000000/{BIG}: blake3 mismatch"):
        store.pull(0, str(tmp_path / "cache"))
    assert not (tmp_path / "cache" / "v000000").exists()
    partial = tmp_path / "cache" / ".v000000.partial"
    assert not (partial / BIG).exists() and not (partial / (BIG + RECORD_SUFFIX)).exists()
    # One digest per file cannot name the bad range: each of the 3 attempts fetched it all.
    assert 3 * size <= relay.served <= 3.05 * size


def test_a_truncated_object_is_refused_at_its_first_answer(
    tmp_path: Path, moto_port: int, relay: Relay
) -> None:
    """No HEAD before the ranges: their answers' Content-Range shows the size, checked before a
    byte is written; the attempts after ask the size first, so one attempt's bytes are in flight."""
    url, _ = published(tmp_path, moto_port, 6 * MB)
    writer = s3_store(url, moto_port)
    path = f"{writer.root}/v000000/{BIG}"
    writer.fs.pipe_file(path, writer.fs.cat_file(path)[: 5 * MB])
    store = s3_store(url, relay.port, part_mb=1)
    with pytest.raises(VerificationError, match=rf"{BIG}: size mismatch \(expected {6 * MB}, got {5 * MB}\)"):
        store.pull(0, str(tmp_path / "cache"))
    assert relay.served <= 5 * MB + 64 * 1024  # at most one attempt's answers, cut at their headers; none after (sizes asked first)
    assert not (tmp_path / "cache" / ".v000000.partial" / BIG).exists()


def test_generic_filesystems_read_ranges_with_cat_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Any fsspec filesystem but S3 (here memory://): ranged `cat_file` reads, some of them failing."""
    size = 5 * MB + 3
    store = CheckpointStore(f"memory://ranges-{uuid.uuid4().hex[:8]}/run", parallel_reads=3, part_mb=1)
    assert store.ranged is not None and store.ranged.chunks is ranges.cat_chunks
    src = make_ckpt(tmp_path, size)
    store.publish(0, str(src))
    real, calls, fetched = store.fs.cat_file, [0], [0]

    def flaky(path: str, start: int | None = None, end: int | None = None, **kwargs: object) -> bytes:
        calls[0] += 1
        if calls[0] % 4 == 0:
            raise ConnectionResetError("connection reset by peer")
        data = real(path, start=start, end=end, **kwargs)
        fetched[0] += len(data) if path.endswith(BIG) else 0
        return data

    monkeypatch.setattr(store.fs, "cat_file", flaky)
    out = Path(store.pull(0, str(tmp_path / "cache")))
    assert (out / BIG).read_bytes() == (src / BIG).read_bytes()
    assert fetched[0] == size  # a failed read fetched nothing; no byte twice


def test_a_streamed_partial_is_resumed_as_ranges(tmp_path: Path) -> None:
    """A partial file the whole-file stream appended (an older decentrl, or a larger part_mb) keeps its bytes."""
    size = 4 * MB
    store = CheckpointStore(f"memory://ranges-{uuid.uuid4().hex[:8]}/run", part_mb=1)
    src = make_ckpt(tmp_path, size)
    store.publish(0, str(src))
    partial = tmp_path / "cache" / ".v000000.partial"
    partial.mkdir(parents=True)
    (partial / "manifest.json").write_bytes(store.fs.cat_file(f"{store.root}/v000000/manifest.json"))
    (partial / BIG).write_bytes((src / BIG).read_bytes()[: 3 * MB + 5])
    asked: list[tuple[int, int]] = []
    real = store.ranged.chunks
    store.ranged.chunks = lambda fs, path, start, end, size, stall_s: (
        asked.append((start, end)) or real(fs, path, start, end, size, stall_s)
    )
    out = Path(store.pull(0, str(tmp_path / "cache")))
    assert (out / BIG).read_bytes() == (src / BIG).read_bytes()
    # The rest, from the first byte not held, in ranges of size / parallel_reads (256 KiB here): none twice.
    assert min(asked)[0] == 3 * MB + 5 and sum(b - a for a, b in asked) == size - (3 * MB + 5)
    assert all(b - a <= 256 * 1024 for a, b in asked)


def test_a_stream_with_nothing_left_takes_the_far_half_of_the_slowest_range() -> None:
    ranges = Ranges([(0, 8 * MB), (8 * MB, 9 * MB)], streams=4)
    first, second = ranges.take(0.0), ranges.take(0.0)
    assert (first.at, first.end, second.at, second.end) == (0, 8 * MB, 8 * MB, 9 * MB)
    assert ranges.take(0.5) is None and ranges.splittable()  # no rate known yet: wait
    first.at, second.at = 2 * MB, 9 * MB - 10  # 1 MiB/s: 6 MiB left take 6 s
    third = ranges.take(2.0)
    assert (third.at, third.end, first.end) == (5 * MB, 8 * MB, 5 * MB)
    ranges.finished(second)
    fourth = ranges.take(2.5)  # the first again (3 MiB, 3 s left); the third's rate is not known yet
    assert (fourth.at, fourth.end, first.end) == (3 * MB + MB // 2, 5 * MB, 3 * MB + MB // 2)
    third.at = 7 * MB + MB // 2  # fast: 1 s left, not worth abandoning its request
    first.at, fourth.at = first.end - 10, fourth.end - 10
    assert ranges.take(4.0) is None and not ranges.splittable()  # every range about to end


def test_split_ranges_end_where_the_split_put_them(tmp_path: Path) -> None:
    """One slow range and spare streams: one takes its far half once its rate shows it would take
    more than 2 s; each stops where the split put it."""
    size = 48 * MB + 5
    store = CheckpointStore(f"memory://ranges-{uuid.uuid4().hex[:8]}/run", parallel_reads=4, part_mb=16)
    src = make_ckpt(tmp_path, size)
    store.publish(0, str(src))
    partial = tmp_path / "cache" / ".v000000.partial"
    partial.mkdir(parents=True)
    (partial / "manifest.json").write_bytes(store.fs.cat_file(f"{store.root}/v000000/manifest.json"))
    # A ranged partial holding all but its first part (size / parallel_reads): one range left, three spare streams.
    part = -(-size // 4)
    (partial / BIG).write_bytes(bytes(part) + (src / BIG).read_bytes()[part:])
    (partial / (BIG + RECORD_SUFFIX)).write_text(f"size {size}\n{part} {size}\n")
    asked, real = [], store.ranged.chunks

    def slow(fs: object, path: str, start: int, end: int, size: int, stall_s: float) -> Iterator[bytes]:
        asked.append((start, end))
        for data in real(fs, path, start, end, size, stall_s):
            time.sleep(0.3)  # 3.3 MiB/s
            yield data

    store.ranged.chunks = slow
    out = Path(store.pull(0, str(tmp_path / "cache")))
    assert (out / BIG).read_bytes() == (src / BIG).read_bytes()
    assert asked[0] == (0, part) and any(0 < start < part for start, _ in asked[1:])


def test_range_record_logs_merges_and_refuses_what_it_cannot_describe(tmp_path: Path) -> None:
    path = str(tmp_path / ("f" + RECORD_SUFFIX))
    record = RangeRecord(path, 10 * MB, [(0, MB)])
    record.add(3 * MB, 3 * MB + 10)
    record.add(MB, 2 * MB)  # adjacent: merged
    record.close()
    assert Path(path).read_text() == f"size {10 * MB}\n0 {MB}\n{3 * MB} {3 * MB + 10}\n{MB} {2 * MB}\n"
    done = RangeRecord.read(path, 10 * MB)
    assert done == [(0, 2 * MB), (3 * MB, 3 * MB + 10)]
    again = RangeRecord(path, 10 * MB, done)  # compacted when opened
    assert again.missing(4 * MB) == [(2 * MB, 3 * MB), (3 * MB + 10, 7 * MB + 10), (7 * MB + 10, 10 * MB)]
    again.close()
    assert Path(path).read_text() == f"size {10 * MB}\n0 {2 * MB}\n{3 * MB} {3 * MB + 10}\n"
    assert RangeRecord.read(path, 11 * MB) is None  # another file's
    for bad in ("size 100\n5 3\n", "size 100\n0 101\n", "size 100\n0 5", "size 100\n-1 5\n", "size 100\n1 2 3\n",
                "size 100\n0 x\n", "", "size 99\n"):
        Path(path).write_text(bad)
        assert RangeRecord.read(path, 100) is None, bad


@pytest.mark.parametrize(
    ("store", "message"),
    [
        ({"parallel_reads": 0}, "store.parallel_reads"),
        ({"parallel_reads": 65}, "store.parallel_reads"),
        ({"part_mb": 0}, "store.part_mb"),
        ({"stall_timeout_s": 0}, "store.stall_timeout_s"),
        ({"min_part_kb": 8}, "store.min_part_kb"),
        ({"min_part_kb": "big"}, "store.min_part_kb"),
        ({"min_part_kb": 2048, "part_mb": 1}, "min_part_kb \\(2048\\) is larger than part_mb \\(1 MiB\\): set min_part_kb <= 1024"),
    ],
)
def test_bad_range_settings_are_refused(store: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_config({"store": store})


def test_s3_connections_cover_the_ranges() -> None:
    """botocore pools 10 connections by default: a range waiting for one would count as stalled."""
    options = StoreConfig(url="s3://b/run", parallel_reads=16, download_concurrency=4, stall_timeout_s=5).fsspec_options()
    assert options == {"config_kwargs": {"max_pool_connections": 20, "connect_timeout": 5.0, "read_timeout": 15.0}}
    mine = StoreConfig(url="s3://b/run", storage_options={"config_kwargs": {"max_pool_connections": 50, "read_timeout": 90}})
    assert mine.fsspec_options() == {"config_kwargs": {"max_pool_connections": 50, "connect_timeout": 8.0, "read_timeout": 90}}
    assert StoreConfig(url="memory://b/run").fsspec_options() == {}


# --- Measurements (docs/store.md, "Large files over a remote store"); DECENTRL_LONG_TESTS=1 ---

LONG = pytest.mark.skipif(
    os.environ.get("DECENTRL_LONG_TESTS") != "1", reason="a measurement for docs/store.md: set DECENTRL_LONG_TESTS=1"
)
# One pull in a fresh process (its own s3fs, event loop and GIL), timed; JSON on stdout.
PULL = """
import json, sys, time
from decentrl.store.checkpoints import CheckpointStore
a = json.loads(sys.argv[1])
store = CheckpointStore(a["url"], a["options"], parallel_reads=a["k"], part_mb=a["part_mb"])
started = time.perf_counter()
store.pull(0, a["cache"])
print(json.dumps({"pull_s": time.perf_counter() - started}))
"""
# A published version served the way S3 answers s3fs's GET (with Range) and HEAD, from a directory
# (/bucket/key -> root/bucket/key) by sendfile: a store that serves a range at disk speed. moto copies
# the whole object for every GET, under the object's lock, so a ranged pull from it measures moto.
RANGE_SERVER = """
import os, re, sys, urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
root, host, port = sys.argv[1], sys.argv[2], int(sys.argv[3])

class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def log_message(self, *args):
        pass
    def do_HEAD(self):
        self.serve(False)
    def do_GET(self):
        self.serve(True)
    def serve(self, body):
        path = os.path.join(root, urllib.parse.unquote(urllib.parse.urlsplit(self.path).path).lstrip("/"))
        if not os.path.isfile(path):
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        size = os.path.getsize(path)
        start, end = 0, size - 1
        asked = re.fullmatch(r"bytes=(\\d+)-(\\d*)", self.headers.get("Range", ""))
        if asked:
            start, end = int(asked[1]), min(int(asked[2] or size - 1), size - 1)
        self.send_response(206 if asked else 200)
        self.send_header("Content-Length", str(end + 1 - start))
        if asked:
            self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
        self.send_header("ETag", '"0"')
        self.send_header("Last-Modified", "Sat, 28 Nov 2026 00:00:00 GMT")
        self.end_headers()
        if body:
            with open(path, "rb") as f:
                while start <= end:
                    start += os.sendfile(self.connection.fileno(), f.fileno(), start, end + 1 - start)

class Server(ThreadingHTTPServer):
    daemon_threads = True
    def handle_error(self, request, client_address):
        pass  # a client that abandons a range (a split) breaks its pipe

server = Server((host, port), Handler)
print("ready", flush=True)
server.serve_forever()
"""
MODES = {"stream": (1, 4096), "ranges_k1": (1, 8), "ranges_k8": (8, 8), "ranges_k16": (16, 8), "ranges_k32": (32, 8)}


def timed_pull(run, url: str, endpoint: str, mode: str, cache: Path) -> float:  # noqa: ANN001 - subprocess.run or Host.run
    k, part_mb = MODES[mode]
    options = {"key": "testing", "secret": "testing",
               "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"},
               "config_kwargs": {"max_pool_connections": k + 4}}
    args = json.dumps({"url": url, "options": options, "k": k, "part_mb": part_mb, "cache": str(cache)})
    done = run([sys.executable, "-c", PULL, args], capture_output=True, text=True, timeout=1800, env=os.environ | {"PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-3000:]
    return float(json.loads(done.stdout.strip().splitlines()[-1])["pull_s"])


def free_port() -> int:
    with socket.create_server(("127.0.0.1", 0)) as probe:
        return probe.getsockname()[1]


def moto_process(host: str, port: int, popen=subprocess.Popen) -> subprocess.Popen:  # noqa: ANN001 - or Host.popen
    return popen([sys.executable, "-m", "moto.server", "-H", host, "-p", str(port)],
                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def range_server(root: Path, host: str, port: int, popen=subprocess.Popen) -> subprocess.Popen:  # noqa: ANN001
    server = popen([sys.executable, "-c", RANGE_SERVER, str(root), host, str(port)], stdout=subprocess.PIPE, text=True)
    assert server.stdout is not None and server.stdout.readline().strip() == "ready"
    return server


def wait_for(run, endpoint: str) -> None:  # noqa: ANN001 - subprocess.run or Host.run
    probe = f"import urllib.request; urllib.request.urlopen('{endpoint}/moto-api/', timeout=1)"
    deadline = time.monotonic() + 60
    while run([sys.executable, "-c", probe], capture_output=True).returncode != 0:
        assert time.monotonic() < deadline, f"moto at {endpoint} did not start"
        time.sleep(0.3)


PUBLISH = """
import json, os, sys, tempfile, boto3
from decentrl.store.checkpoints import CheckpointStore
a = json.loads(sys.argv[1])
boto3.client("s3", endpoint_url=a["endpoint"], aws_access_key_id="testing", aws_secret_access_key="testing",
             region_name="us-east-1").create_bucket(Bucket="bench")
with tempfile.TemporaryDirectory() as d:
    with open(os.path.join(d, "model.safetensors"), "wb") as f:
        f.write(os.urandom(a["size"]))
    CheckpointStore("s3://bench/run", {"key": "testing", "secret": "testing",
                    "client_kwargs": {"endpoint_url": a["endpoint"], "region_name": "us-east-1"}}).publish(0, d)
"""


def publish_to_moto(run, endpoint: str, size: int) -> str:  # noqa: ANN001
    done = run([sys.executable, "-c", PUBLISH, json.dumps({"endpoint": endpoint, "size": size})],
               capture_output=True, text=True, timeout=900, env=os.environ | {"PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-3000:]
    return "s3://bench/run"


def publish_to_dir(root: Path, size: int) -> str:
    """Version 0 of s3://bench/run as RANGE_SERVER serves it from `root`."""
    src = root / "src"
    src.mkdir(parents=True)
    (src / "model.safetensors").write_bytes(os.urandom(size))
    CheckpointStore(str(root / "bench" / "run")).publish(0, str(src), hand_over=True)
    return "s3://bench/run"


@LONG
@pytest.mark.parametrize("server", ["range_server", "moto"])
def test_measure_loopback_single_stream_vs_ranges(tmp_path: Path, server: str) -> None:
    """MB/s of a pull of one DECENTRL_RANGES_MB (256) MB object on loopback: the whole-file stream,
    and ranges on 1, 8 and 32 connections; best of 3 interleaved; and the hash after assembly."""
    from decentrl.store.cache import hash_regular

    size = int(os.environ.get("DECENTRL_RANGES_MB", "256")) * MB
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    if server == "moto":
        process = moto_process("127.0.0.1", port)
    else:
        url = publish_to_dir(tmp_path / "store", size)
        process = range_server(tmp_path / "store", "127.0.0.1", port)
    try:
        if server == "moto":
            wait_for(subprocess.run, endpoint)
            url = publish_to_moto(subprocess.run, endpoint, size)
        best: dict[str, float] = {}
        for round_ in range(3):
            for mode in ("stream", "ranges_k1", "ranges_k8", "ranges_k32"):
                cache = tmp_path / f"{mode}-{round_}"
                best[mode] = max(best.get(mode, 0.0), size / MB / timed_pull(subprocess.run, url, endpoint, mode, cache))
                if round_ == 0 and mode == "ranges_k32":
                    started = time.perf_counter()
                    hash_regular(str(cache / "v000000" / "model.safetensors"), size + 1, "blake3")
                    best["hash_after_assembly_s"] = time.perf_counter() - started
                for path in cache.rglob("*.safetensors"):  # 9 pulls of the object would not fit every disk
                    path.unlink()
    finally:
        process.terminate()
        process.wait()
    print(json.dumps({"server": server, "object_mb": size // MB, "mb_s": best, "load_avg": os.getloadavg()}))
    assert all(value > 0 for value in best.values())


@LONG
def test_measure_shaped_link_single_stream_vs_ranges(tmp_path: Path) -> None:
    """Mbit/s of a pull over a shaped link (benchmarks/spreadnet.py; DECENTRL_RANGES_PROFILE, L2 by
    default: 50/10 Mbit/s, 150 ms, 0.5% loss) from RANGE_SERVER on the store's host (200 Mbit/s),
    one DECENTRL_RANGES_MB (24) MB object: the whole-file stream, then ranges on 8, 16, 32 connections."""
    import importlib.util

    if "spreadnet" not in sys.modules:
        spec = importlib.util.spec_from_file_location("spreadnet", ROOT / "benchmarks" / "spreadnet.py")
        assert spec is not None and spec.loader is not None
        sys.modules["spreadnet"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules["spreadnet"])
    sn = sys.modules["spreadnet"]
    if reason := sn.unavailable_reason():
        pytest.skip(reason)
    profile = os.environ.get("DECENTRL_RANGES_PROFILE", "L2")
    size = int(os.environ.get("DECENTRL_RANGES_MB", "24")) * MB
    modes = os.environ.get("DECENTRL_RANGES_MODES", "stream,ranges_k8,ranges_k16,ranges_k32").split(",")
    url = publish_to_dir(tmp_path / "store", size)
    with sn.Testbed() as net:
        store_host = net.add_host("store", sn.PROFILES["store"])
        worker = net.add_host("worker", sn.PROFILES[profile])
        range_server(tmp_path / "store", store_host.ip, 9000, store_host.popen)
        endpoint = f"http://{store_host.ip}:9000"
        mbit = {mode: size * 8 / 1e6 / timed_pull(worker.run, url, endpoint, mode, tmp_path / mode) for mode in modes}
        shaping = net.shaping["summary"]
    link = sn.PROFILES[profile]
    print(json.dumps({"profile": profile, "link_down_mbit": link.down_mbit, "rtt_ms": link.rtt_ms, "loss": link.loss,
                      "object_mb": size // MB, "mbit_s": mbit, "shaping": shaping, "load_avg": os.getloadavg()}))
    assert all(value > 0 for value in mbit.values())
