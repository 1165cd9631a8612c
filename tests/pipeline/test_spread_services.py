"""The spread testbed's services on loopback (benchmarks/spread_services.py): the orchestrator behind
its nginx TLS front, and decentrl's checkpoint store behind the S3 fault front.

TLS: a real `decentrl orchestrator` behind nginx (configs/deploy/nginx-orchestrator.conf.template, a
throwaway CA). A client that trusts the CA through SSL_CERT_FILE gets through; one that does not
fails at once on the certificate; a long-poll outlasts a read timeout set below it only when the
front's timeout is above it, and what the front cuts or cannot reach is answered 503 with
Retry-After, which decentrl's client retries.

S3: moto's server in its own process, the fault front before it, a CheckpointStore publishing and
pulling through the front: 503 SlowDown bursts, a cut and a stalled download, a cut and a stalled
upload. The figures (bytes served against the object, seconds until a stall is seen) are those
decentrl's store gives; botocore's read timeout and retries are [store] storage_options
(config_kwargs = {read_timeout = ..., retries = {...}}).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from decentrl.api.client import OrchestratorClient, Unavailable
from decentrl.api.wire import LeaseRequest, LeaseResponse
from decentrl.cli.launch import free_port
from decentrl.config import OrchestratorConfig, StoreConfig
from decentrl.store.checkpoints import CheckpointStore, StoreError
from orchestrator.auth import add_token
from tests.pipeline.test_pipeline import TINY_MODEL
from tests.workers.test_worker import WORKER
from tests.workers.test_worker_renewal import Client as RenewalClient
from tests.workers.test_worker_renewal import (
    quick_backoff,  # noqa: F401 - a fixture, used by name
    renewal_config,
    serving,
    worker_of,
)

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(shutil.which("nginx") is None, reason="needs nginx: apt-get install nginx"),
]

ROOT = Path(__file__).parents[2]


def _services() -> ModuleType:
    spec = importlib.util.spec_from_file_location("spread_services", ROOT / "benchmarks" / "spread_services.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # pydantic resolves the module's annotations through it
    spec.loader.exec_module(module)
    return module


ss = _services()


# -- the TLS front ---------------------------------------------------------------------------------

BATCH_WAIT_S = 3.0  # the long-poll: a trainer's batch request with nothing to train answers 204 after this
CONFIG = f"""
run_name = "spread-tls"
trainer_ranks = 1
{TINY_MODEL}
[orchestrator]
batch_wait_s = {BATCH_WAIT_S}
"""


@pytest.fixture(scope="module")
def orchestrator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """A real orchestrator on 127.0.0.1 (plain HTTP): its host:port and a trainer token."""
    run_dir = tmp_path_factory.mktemp("orchestrator")
    (run_dir / "run.toml").write_text(CONFIG)
    token = add_token(str(run_dir / "tokens.json"), name="trainer", role="trainer")
    port = free_port()
    with open(run_dir / "orchestrator.log", "ab") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "decentrl", "orchestrator", str(run_dir / "run.toml"), "--run-dir", str(run_dir),
             "--port", str(port)],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1):
                    break
            except OSError:
                assert process.poll() is None, (run_dir / "orchestrator.log").read_text()
                assert time.monotonic() < deadline, "orchestrator did not start"
                time.sleep(0.2)
        yield f"127.0.0.1:{port}", token
    finally:
        process.terminate()
        process.wait(timeout=30)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> object:
    return ss.make_certificates(str(tmp_path_factory.mktemp("certs")), ["localhost", "127.0.0.1"])


def front(prefix: Path, upstream: str, certs: object, *, read_timeout_s: int, max_body_bytes: int = 16 * 2**20) -> object:
    return ss.start_tls_front(
        str(prefix), host="127.0.0.1", port=free_port(), server_name="localhost", certs=certs, upstream=upstream,
        read_timeout_s=read_timeout_s, max_body_bytes=max_body_bytes,
    )


def test_front_limits_follow_the_orchestrator_config() -> None:
    assert ss.tls_front_limits(OrchestratorConfig()) == (80, 16 * 2**20)  # batch_wait_s 20 s + a minute
    assert ss.tls_front_limits(OrchestratorConfig(batch_wait_s=300, max_request_bytes=2**20)) == (360, 2**20)


def test_rendered_config_fills_every_name_and_keeps_nginx_variables(certs: object) -> None:
    text = ss.render_tls_front(
        listen="10.0.0.1:443", server_name="orchestrator.test", certs=certs, upstream="10.0.0.1:8740",
        read_timeout_s=90, max_body_bytes=16777216,
    )
    body = [line.split("#")[0].strip() for line in text.splitlines() if not line.lstrip().startswith("#")]
    assert not any("DECENTRL_" in line for line in body)
    for directive in ("listen 10.0.0.1:443 ssl;", "server 10.0.0.1:8740;", "proxy_read_timeout 90s;",
                      "client_max_body_size 16777216;", "proxy_buffering off;", "proxy_http_version 1.1;",
                      'proxy_set_header Connection "";', "proxy_set_header Host $host;"):
        assert directive in body, directive


def test_orchestrator_over_tls(
    orchestrator: tuple[str, str], certs: object, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    upstream, token = orchestrator
    # Its read timeout above the long-poll, as tls_front_limits makes it, though below nginx's 60 s default.
    tls = front(tmp_path / "nginx", upstream, certs, read_timeout_s=int(BATCH_WAIT_S) + 3)
    try:
        # Trusted through the usual variable, as a worker's or the trainer's environment sets it.
        monkeypatch.setenv("SSL_CERT_FILE", certs.ca)
        client = OrchestratorClient(tls.url, token, timeout_s=30, max_wait_s=0.5)
        assert client.info().run_name == "spread-tls"
        started = time.monotonic()
        assert client.batch(0) is None  # the whole long-poll, answered 204 through the front
        assert BATCH_WAIT_S <= time.monotonic() - started < BATCH_WAIT_S + 2

        # Without the CA (the system's bundle only): refused on the certificate at once, not retried.
        monkeypatch.setenv("SSL_CERT_FILE", "/etc/ssl/certs/ca-certificates.crt")
        started = time.monotonic()
        with pytest.raises(ConnectionError, match="CERTIFICATE_VERIFY_FAILED.*SSL_CERT_FILE"):
            OrchestratorClient(tls.url, token, timeout_s=30, max_wait_s=60).info()
        assert time.monotonic() - started < 5
    finally:
        tls.stop()
    assert tls.process.returncode == 0
    assert sorted(os.listdir(tmp_path / "nginx")) == ["access.log", "decentrl.conf", "error.log", "nginx.conf", "temp"]
    assert "[emerg]" not in (tmp_path / "nginx" / "error.log").read_text()


def test_front_cuts_a_long_poll_past_its_read_timeout_into_a_retried_503(
    orchestrator: tuple[str, str], certs: object, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    upstream, token = orchestrator
    monkeypatch.setenv("SSL_CERT_FILE", certs.ca)
    tls = front(tmp_path / "nginx", upstream, certs, read_timeout_s=1, max_body_bytes=64 * 1024)
    try:
        request = urllib.request.Request(
            f"{tls.url}/v1/batch?trainer_version=0&request_id={uuid.uuid4().hex}", headers={"Authorization": f"Bearer {token}"}
        )
        started = time.monotonic()
        with pytest.raises(urllib.error.HTTPError) as cut:
            urllib.request.urlopen(request, timeout=30)
        assert 1 <= time.monotonic() - started < BATCH_WAIT_S  # cut at the front's timeout, not the long-poll's end
        assert cut.value.code == 503 and cut.value.headers["Retry-After"] == "1"
        assert "not answering" in json.loads(cut.value.read())["error"]

        # A body above the orchestrator's limit: 413 from the front, with a message.
        big = urllib.request.Request(
            f"{tls.url}/v1/rollouts", data=b"x" * (65 * 1024), method="POST", headers={"Authorization": f"Bearer {token}"}
        )
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(big, timeout=30)
        assert refused.value.code == 413
        assert json.loads(refused.value.read())["error"].endswith("(client_max_body_size 65536 bytes)")
    finally:
        tls.stop()


def test_front_answers_503_while_the_orchestrator_is_down(certs: object, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SSL_CERT_FILE", certs.ca)
    tls = front(tmp_path / "nginx", f"127.0.0.1:{free_port()}", certs, read_timeout_s=5)  # nothing listens there
    try:
        # Retried for max_wait_s, then raised as unreachable (a ConnectionError), as without a front.
        with pytest.raises(Unavailable) as down:
            OrchestratorClient(tls.url, "token", timeout_s=10, max_wait_s=1.0).info()
        assert down.value.status == 503 and "not answering" in down.value.message
        assert "unavailable for 1s" in str(down.value)
    finally:
        tls.stop()


@pytest.mark.usefixtures("quick_backoff")
def test_a_worker_behind_the_front_rides_out_orchestrator_restarts(
    certs: object, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The orchestrator down for 1.5 s, three times the worker's max_wait_s, twice: while the worker
    holds leases and generates (a renewal and the post meet the outage), and as it asks for more.
    The front answers 503 all that while, and the worker retries as it retries an unreachable
    orchestrator (until 2026-11-29 a renewal or lease request answered 503 past max_wait_s stopped
    the worker). Its leases, renewed in time, lose nothing."""
    monkeypatch.setenv("SSL_CERT_FILE", certs.ca)
    outages: list[threading.Thread] = []
    # Leases renewed at 2.5 s; the app restarted on the same port, its state kept.
    with serving(tmp_path, renewal_config(lease_timeout_s=5.0), port=free_port()) as setup:
        orchestrator = setup.orchestrator

        def outage(after_s: float) -> None:
            def down_and_up() -> None:
                time.sleep(after_s)
                orchestrator.stop()
                time.sleep(1.5)
                orchestrator.start()

            outages.append(threading.Thread(target=down_and_up, daemon=True))
            outages[-1].start()

        class Client(RenewalClient):
            """Takes the orchestrator down 2.2 s after its first lease is granted, and as it asks the second time."""

            def lease(self, request: LeaseRequest) -> LeaseResponse:
                if len(self.asked) == 1:
                    outage(0.0)
                    time.sleep(0.1)  # down before this request is sent
                response = super().lease(request)
                if len(self.asked) == 1:
                    outage(2.2)
                return response

        tls = front(tmp_path / "nginx", f"127.0.0.1:{orchestrator.port}", certs, read_timeout_s=5)
        try:
            setup.publish(0, seed=0)
            client = Client(tls.url, WORKER, timeout_s=30.0, max_wait_s=0.5)
            worker = worker_of(setup, client, delay_s=3.0)
            caplog.set_level(logging.INFO)
            worker.run(max_iterations=2)
            status = orchestrator.client(WORKER).status()
        finally:
            tls.stop()
            for thread in outages:  # the app up again before the block stops it
                thread.join(timeout=10)
    assert len(outages) == 2 and not any(thread.is_alive() for thread in outages)
    assert status.rollouts_accepted == worker.rollouts_posted == 8 and status.rollouts_rejected == {}
    assert status.leases_expired == 0 and worker.progress.gone == 0
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("renewing leases failed" in m and "unavailable" in m for m in warnings), warnings
    assert any("lease request failed" in m and "unavailable" in m for m in warnings), warnings
    assert WORKER not in caplog.text


# -- the S3 store behind the fault front ----------------------------------------------------------

SMALL = 200_000  # a weight file of one part ([store] min_part_kb, 256 KiB)
LARGE = 24_000_000  # parallel ranges (of LARGE / parallel_reads each)
OBJECT = "/spread/run/v000000/model.safetensors"


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, object]]:
    """moto and the fault front before it, each in its own process: the front's URL and its control."""
    # The control socket's path must fit a sockaddr_un (108 bytes): not under pytest's long tmp_path.
    run_dir = tempfile.mkdtemp(prefix="spread-s3-")
    moto = ss.start_moto(run_dir, host="127.0.0.1", port=0)
    s3_front, control = ss.start_s3_front(run_dir, host="127.0.0.1", port=0, upstream=moto.url)
    try:
        import boto3

        boto3.client(
            "s3", endpoint_url=moto.url, aws_access_key_id="testing", aws_secret_access_key="testing", region_name="us-east-1"
        ).create_bucket(Bucket="spread")
        yield s3_front.url, control
    finally:
        assert s3_front.stop() == 0
        moto.stop()
        assert "Traceback" not in Path(s3_front.log_path).read_text()
        leftovers = sorted(os.listdir(run_dir))
        shutil.rmtree(run_dir)
    assert leftovers == ["moto.log", "s3-front.log"]  # ready files and the control socket removed


@pytest.fixture
def control(s3: tuple[str, object]) -> Iterator[object]:
    """The front's control, counts reset; the store's run prefix emptied after the test."""
    endpoint, control = s3
    control.clear()
    control.reset()
    yield control
    control.clear()
    store = make_store(endpoint)
    for version in store.versions():
        store.delete(version)


def make_store(endpoint: str, **storage_options: object) -> CheckpointStore:
    """decentrl's store through the front, configured as a worker's or the trainer's [store] section."""
    return CheckpointStore.from_config(StoreConfig(
        url="s3://spread/run", endpoint=endpoint, region="us-east-1", access_key_id="testing",
        secret_access_key="testing", storage_options=storage_options,
    ))


def make_version(tmp_path: Path, size: int) -> Path:
    src = tmp_path / "src"
    src.mkdir()
    (src / "model.safetensors").write_bytes(os.urandom(size))
    (src / "config.json").write_text("{}")
    return src


@pytest.fixture
def version_dir(tmp_path: Path) -> Path:
    return make_version(tmp_path, SMALL)


def pull_and_check(store: CheckpointStore, src: Path, cache: Path) -> None:
    out = Path(store.pull(0, str(cache)))
    assert (out / "model.safetensors").read_bytes() == (src / "model.safetensors").read_bytes()


def test_slowdown_bursts_publish_and_pull_retry_and_complete(
    s3: tuple[str, object], control: object, version_dir: Path, tmp_path: Path
) -> None:
    store = make_store(s3[0])
    control.set("slowdown", count=3)  # the publish's first three requests
    store.publish(0, str(version_dir))
    assert control.stats()["hits"] == {"slowdown": 3}
    control.set("slowdown", share=0.5, seconds=5.0, seed=1)  # half the pull's requests, for 5 s
    pull_and_check(make_store(s3[0]), version_dir, tmp_path / "cache")
    stats = control.stats()
    assert stats["hits"]["slowdown"] >= 2
    assert stats["served"]["by_object"][OBJECT] == SMALL  # a 503 costs no object bytes
    # The front times each answered GET: when it came, the store's answer, its last byte.
    timed = [entry for entry in control.timings() if entry[2] == OBJECT]
    assert sum(entry[5] for entry in timed) == SMALL and all(0 <= entry[3] <= entry[4] < 30 for entry in timed)
    assert all(entry[1] == "127.0.0.1" and abs(entry[0] - time.time()) < 120 for entry in timed)


def test_slowdown_past_botocores_retries_fails_a_publish(s3: tuple[str, object], control: object, version_dir: Path) -> None:
    """A sustained SlowDown: the publish gives up once botocore's attempts of its first request are
    spent (5 by default, some 10 s; here 1 + 2 retries) - a HEAD, whose 503 has no body in which
    s3fs would see "SlowDown" and retry again - and raises an OSError, which the trainer's
    publisher surfaces. More retries: [store] storage_options config_kwargs.retries."""
    control.set("slowdown")
    started = time.monotonic()
    with pytest.raises(OSError, match="Service Unavailable"):
        make_store(s3[0], config_kwargs={"retries": {"mode": "standard", "max_attempts": 2}}).publish(0, str(version_dir))
    assert time.monotonic() - started < 10
    assert control.stats()["hits"] == {"slowdown": 3}


def test_cut_download_resumes_from_the_bytes_it_has(s3: tuple[str, object], control: object, tmp_path: Path) -> None:
    """A file larger than a part comes as ranges (decentrl/store/ranges.py): a cut range resumes
    where it stopped; what is lost is what was in flight."""
    src = make_version(tmp_path, LARGE)
    make_store(s3[0]).publish(0, str(src))
    control.reset()
    control.set("cut", count=1, match=".safetensors")  # half a range, then the connection closed
    pull_and_check(make_store(s3[0]), src, tmp_path / "cache")
    stats = control.stats()
    assert stats["hits"] == {"cut": 1}
    assert LARGE <= stats["served"]["by_object"][OBJECT] <= 1.1 * LARGE


def test_stalled_download_is_seen_and_resumed(s3: tuple[str, object], control: object, tmp_path: Path) -> None:
    """A range that receives nothing for [store] stall_timeout_s (8 s) is abandoned and resumed."""
    src = make_version(tmp_path, LARGE)
    make_store(s3[0]).publish(0, str(src))
    control.reset()
    control.set("stall", count=1, match=".safetensors")  # the headers and half a range, then silence
    started = time.monotonic()
    pull_and_check(make_store(s3[0]), src, tmp_path / "cache")
    assert 8 <= time.monotonic() - started < 15
    stats = control.stats()
    assert stats["hits"] == {"stall": 1} and stats["stalled_now"] == 0  # the client closed the stalled connection
    assert LARGE <= stats["served"]["by_object"][OBJECT] <= 1.1 * LARGE


def test_cut_small_download_resumes_from_the_bytes_it_has(s3: tuple[str, object], control: object, tmp_path: Path) -> None:
    """A small file of S3 is ranged GETs (no HEAD first): cut, it resumes at once where it stopped,
    as a large file's range does; what was in flight at the cut (at most the part) comes again."""
    src = make_version(tmp_path, SMALL)
    make_store(s3[0]).publish(0, str(src))
    control.reset()
    control.set("cut", count=1, match=".safetensors")
    started = time.monotonic()
    pull_and_check(make_store(s3[0]), src, tmp_path / "cache")
    assert time.monotonic() - started < 5
    stats = control.stats()
    assert stats["hits"] == {"cut": 1}
    assert SMALL <= stats["served"]["by_object"][OBJECT] <= SMALL + SMALL // 2
    assert stats["served"]["by_client"] == {"127.0.0.1": stats["served"]["total"]}


def test_stalled_small_download_is_seen_at_the_stall_timeout(s3: tuple[str, object], control: object, tmp_path: Path) -> None:
    """A small file's stall is bounded as a large file's range is: no byte for [store]
    stall_timeout_s and it is abandoned, then resumed from the bytes it has."""
    src = make_version(tmp_path, SMALL)
    make_store(s3[0]).publish(0, str(src))
    control.reset()
    control.set("stall", count=1, match=".safetensors")  # the headers and half the object, then silence
    started = time.monotonic()
    store = CheckpointStore.from_config(StoreConfig(
        url="s3://spread/run", endpoint=s3[0], region="us-east-1", access_key_id="testing",
        secret_access_key="testing", stall_timeout_s=2.0,
    ))
    pull_and_check(store, src, tmp_path / "cache")
    assert 2 <= time.monotonic() - started < 6
    stats = control.stats()
    assert stats["hits"] == {"stall": 1} and stats["stalled_now"] == 0  # the client closed the stalled connection
    assert SMALL <= stats["served"]["by_object"][OBJECT] <= SMALL + SMALL // 2


def test_cut_and_stalled_uploads_are_retried(s3: tuple[str, object], control: object, version_dir: Path, tmp_path: Path) -> None:
    control.set("cut", count=1, match=".safetensors", methods=["PUT"])  # half the upload, then the connection closed
    make_store(s3[0]).publish(0, str(version_dir))
    assert control.stats()["hits"] == {"cut": 1}
    assert control.stats()["received"]["by_object"][OBJECT] == SMALL + SMALL // 2
    control.set("stall", count=1, match=".safetensors", methods=["PUT"])  # half the upload, then no reading
    control.reset()
    started = time.monotonic()
    make_store(s3[0], config_kwargs={"read_timeout": 2}).publish(1, str(version_dir))
    assert 2 <= time.monotonic() - started < 6
    assert control.stats()["hits"] == {"stall": 1}
    pull_and_check(make_store(s3[0]), version_dir, tmp_path / "cache")
    again = make_store(s3[0]).publish(1, str(version_dir))  # a retry whose earlier attempt wrote its manifest
    assert again == make_store(s3[0]).manifest(1)
    (version_dir / "config.json").write_text('{"other": 1}')
    with pytest.raises(StoreError, match="already published"):  # other files under a taken version
        make_store(s3[0]).publish(1, str(version_dir))


def test_the_trainers_publisher_rides_out_a_slowdown_burst(s3: tuple[str, object], control: object, tmp_path: Path) -> None:
    """A SlowDown burst past botocore's retries (issue 46, F3): the publisher tries the publish again
    with back-off until it completes, then announces it; no reader ever sees a half version."""
    from decentrl.config import TinyModelConfig
    from decentrl.model.build import build_model
    from decentrl.trainer.publisher import Publisher

    model = build_model(TinyModelConfig(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64))
    store = make_store(s3[0], config_kwargs={"retries": {"mode": "standard", "max_attempts": 2}})
    announced: list[int] = []
    publisher = Publisher(store=store, model_config=model.config, extras_from=str(tmp_path), keep_last=4,
                          on_published=announced.append, retry_s=60.0)
    burst_s = 8.0
    control.set("slowdown", seconds=burst_s)
    started = time.monotonic()
    publisher.submit(0, {name: t.detach().clone() for name, t in model.state_dict().items()})
    seen: set[int] = set()
    while not announced:  # what a worker sees meanwhile: nothing, or all of it
        assert time.monotonic() - started < 60
        with contextlib.suppress(StoreError, OSError):
            seen.update(make_store(s3[0]).versions())
        time.sleep(0.2)
    publisher.close()
    assert time.monotonic() - started >= burst_s
    assert announced == [0] and publisher.retries >= 1 and control.stats()["hits"]["slowdown"] >= 3
    assert make_store(s3[0]).verify(0) == []
    assert seen <= {0}


def test_the_store_answers_ranges_as_s3_does(s3: tuple[str, object], control: object) -> None:
    """The testbed's moto serves a ranged GET from the range's bytes alone (`serve_ranges_in_place`):
    the answers are S3's - the bytes, Content-Range with the object's size, 416 past the end, the
    whole object for a Range moto does not slice."""
    import boto3
    from botocore.exceptions import ClientError

    client = boto3.client("s3", endpoint_url=s3[0], aws_access_key_id="testing", aws_secret_access_key="testing",
                          region_name="us-east-1")
    data = os.urandom(1_000_000)
    client.put_object(Bucket="spread", Key="run/ranges.bin", Body=data)
    try:
        for asked, first, last in [("0-99", 0, 99), ("500000-500099", 500000, 500099), ("-100", 999900, 999999),
                                   ("999000-", 999000, 999999), ("999990-2000000", 999990, 999999)]:
            answer = client.get_object(Bucket="spread", Key="run/ranges.bin", Range=f"bytes={asked}")
            assert answer["ContentRange"] == f"bytes {first}-{last}/1000000", asked
            assert answer["Body"].read() == data[first:last + 1], asked
        with pytest.raises(ClientError, match="InvalidRange"):
            client.get_object(Bucket="spread", Key="run/ranges.bin", Range="bytes=1000000-")
        for whole in ({"Range": "bytes=0-1,5-6"}, {}):
            answer = client.get_object(Bucket="spread", Key="run/ranges.bin", **whole)
            assert "ContentRange" not in answer and answer["Body"].read() == data
    finally:
        client.delete_object(Bucket="spread", Key="run/ranges.bin")


def test_a_range_view_reads_only_the_bytes_sliced() -> None:
    import io
    import threading

    class Counted(io.BytesIO):
        read_bytes = 0

        def read(self, n: int | None = -1) -> bytes:
            data = super().read(n)
            Counted.read_bytes += len(data)
            return data

    class Key:
        size, lock, _value_buffer = 10_000_000, threading.Lock(), Counted(bytes(range(256)) * 39_063)

    view = ss._RangeView(Key())
    assert len(view) == 10_000_000
    assert view[4096:4196] == (bytes(range(256)) * 39_063)[4096:4196]
    assert view[9_999_990:20_000_000] == (bytes(range(256)) * 39_063)[9_999_990:10_000_000]
    assert Counted.read_bytes == 110
