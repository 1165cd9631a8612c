"""The services of the spread testbed (benchmarks/spread.py, and the fault suite after it): the
orchestrator's TLS front, the S3 store and the fault front before the store.

- TLS front: nginx from Debian's package, configured by configs/deploy/nginx-orchestrator.conf.template
  (the file docs/deploy.md shows) and a throwaway CA (`make_certificates`); clients trust the CA
  through SSL_CERT_FILE. nginx runs in the foreground with every file under its own prefix.
- S3 store: moto's server, in its own process (`python spread_services.py moto`), serving a ranged
  GET from the range's bytes alone as S3 does (`serve_ranges_in_place`).
- Fault front: an HTTP proxy before the store (`python spread_services.py s3-front`) that passes
  requests through, streaming, and counts the bytes it serves per client and per object; the
  testbed sets a fault at run time through `FrontControl`: `slowdown` (503 SlowDown, as S3
  throttles), `stall` (headers and part of an object, then silence) or `cut` (part of an object,
  then the connection closed). A partition (the store unreachable) is the network's fault, not this.

Each service binds the address it is given and is started by a `popen` (subprocess.Popen, or a
namespace host's popen): the same calls run on loopback (tests/pipeline/test_spread_services.py) and
on the testbed's hosts. A service says it is ready through a file (nginx's pid file, a ready file
the Python services write), which every network namespace sees; the fault front's control socket is
a Unix socket for the same reason: the testbed reaches it whatever the links and partitions are.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import http.client
import ipaddress
import json
import logging
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections import Counter, deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

ROOT = Path(__file__).resolve().parents[1]
NGINX_TEMPLATE = ROOT / "configs" / "deploy" / "nginx-orchestrator.conf.template"
Popen = Callable[..., "subprocess.Popen[bytes]"]
CHUNK = 256 * 1024  # the fault front's streaming unit
TIMED_REQUESTS = 200_000  # answered GETs the front keeps the timings of (a versions part makes some 30,000)
SLOW_DOWN = (
    '<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
    "<Message>Please reduce your request rate.</Message><RequestId>{id}</RequestId></Error>"
)
# Not forwarded by a proxy (RFC 9110 7.6.1), and Expect: the front has answered it already.
HOP_HEADERS = frozenset(
    {"connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding", "upgrade", "expect"}
)

log = logging.getLogger("spread.services")


# -- certificates -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Certificates:
    ca: str  # the CA's certificate: what clients trust (SSL_CERT_FILE)
    cert: str  # the server's certificate, signed by the CA
    key: str  # the server's private key


def make_certificates(out_dir: str, names: list[str], *, days: int = 7) -> Certificates:
    """A throwaway CA and a server certificate it signs for `names` (DNS names or IP addresses),
    PEM files in `out_dir`. The extensions are those strict verifiers require (Python 3.13's
    default context sets VERIFY_X509_STRICT): key usages, key identifiers, a critical CA flag."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "decentrl spread testbed CA")])
    ca = (
        x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(
            digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False, key_encipherment=False,
            data_encipherment=False, key_agreement=False, encipher_only=False, decipher_only=False,
        ), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    alt_names: list[x509.GeneralName] = []
    for name in names:
        try:
            alt_names.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            alt_names.append(x509.DNSName(name))
    cert = (
        x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[0])]))
        .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(
            digital_signature=True, key_encipherment=False, key_cert_sign=False, crl_sign=False, content_commitment=False,
            data_encipherment=False, key_agreement=False, encipher_only=False, decipher_only=False,
        ), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.SubjectAlternativeName(alt_names), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    os.makedirs(out_dir, exist_ok=True)
    found = Certificates(*(os.path.join(out_dir, n) for n in ("ca.pem", "server.pem", "server.key")))
    Path(found.ca).write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    Path(found.cert).write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    fd = os.open(found.key, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        ))
    return found


# -- processes --------------------------------------------------------------------------------


@dataclass
class Service:
    """A service process this module started, its URL and its log."""

    name: str
    process: subprocess.Popen[bytes]
    url: str
    log_path: str

    def stop(self, timeout_s: float = 10.0) -> int:
        """SIGTERM, then SIGKILL after `timeout_s`; the exit status."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                return self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
        return self.process.wait()


def _start(name: str, argv: list[str], ready: str, log_path: str, popen: Popen, timeout_s: float) -> subprocess.Popen[bytes]:
    """`argv` started with its output in `log_path`; returns once the file `ready` exists (the
    service writes it once it listens), or raises with the log's tail."""
    with open(log_path, "ab") as out:
        process = popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(ready):
        if process.poll() is not None or time.monotonic() > deadline:
            if process.poll() is None:
                process.kill()
            process.wait()
            tail = Path(log_path).read_text(errors="replace")[-2000:]
            raise RuntimeError(f"{name} did not start (exit {process.returncode}); {log_path}:\n{tail}")
        time.sleep(0.05)
    return process


def _script(command: str, *args: str) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), command, *args]


# -- the TLS front (nginx) -------------------------------------------------------------------


def tls_front_limits(orchestrator: Any) -> tuple[int, int]:
    """(read timeout s, body limit bytes) for a front before an orchestrator configured so (its
    OrchestratorConfig): a read timeout a minute above its longest long-poll, its own body limit."""
    longest = max(orchestrator.batch_wait_s, orchestrator.lease_wait_s)
    return int(longest) + 60, orchestrator.max_request_bytes


def render_tls_front(
    *, listen: str, server_name: str, certs: Certificates, upstream: str, read_timeout_s: int, max_body_bytes: int
) -> str:
    """configs/deploy/nginx-orchestrator.conf.template with its ${DECENTRL_*} names filled in."""
    values = {
        "DECENTRL_LISTEN": listen, "DECENTRL_SERVER_NAME": server_name, "DECENTRL_CERT": certs.cert,
        "DECENTRL_KEY": certs.key, "DECENTRL_UPSTREAM": upstream, "DECENTRL_READ_TIMEOUT": f"{read_timeout_s}s",
        "DECENTRL_MAX_BODY": str(max_body_bytes),
    }
    # Only the braced ${DECENTRL_*} names: nginx's own $variables ($host, $scheme) stay as they are.
    return re.sub(r"\$\{(DECENTRL_[A-Z_]+)\}", lambda m: values[m.group(1)], NGINX_TEMPLATE.read_text())


def start_tls_front(
    prefix: str, *, host: str, port: int, server_name: str, certs: Certificates, upstream: str,
    read_timeout_s: int, max_body_bytes: int, popen: Popen = subprocess.Popen, timeout_s: float = 30.0,
) -> Service:
    """nginx terminating TLS on host:port for the orchestrator at `upstream` (host:port), in the
    foreground, with its configuration, pid file, logs and temp files all under `prefix`: stopped,
    it leaves nothing elsewhere. Ready once its pid file exists (written after it listens)."""
    prefix = os.path.abspath(prefix)
    os.makedirs(os.path.join(prefix, "temp"), exist_ok=True)
    site = os.path.join(prefix, "decentrl.conf")
    Path(site).write_text(render_tls_front(
        listen=f"{host}:{port}", server_name=server_name, certs=certs, upstream=upstream,
        read_timeout_s=read_timeout_s, max_body_bytes=max_body_bytes,
    ))
    temp_paths = "\n".join(f"    {kind}_temp_path {prefix}/temp/{kind};" for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
    # Workers run as root only where the master does (the testbed): the prefix may sit in a
    # directory only root can enter (pytest's tmp_path), and request bodies spill into it.
    user = "user root;\n" if os.geteuid() == 0 else ""
    main = os.path.join(prefix, "nginx.conf")
    Path(main).write_text(
        "# The spread testbed's nginx: in the foreground, every file under its prefix. The part a deployment\n"
        "# uses is decentrl.conf, rendered from configs/deploy/nginx-orchestrator.conf.template.\n"
        f"daemon off;\n{user}worker_processes 1;\npid {prefix}/nginx.pid;\nerror_log {prefix}/error.log warn;\n"
        "events {\n    worker_connections 1024;\n}\n"
        f"http {{\n    access_log {prefix}/access.log;\n{temp_paths}\n    include {site};\n}}\n"
    )
    pid_file = os.path.join(prefix, "nginx.pid")
    if os.path.exists(pid_file):
        os.remove(pid_file)
    # -e: the error log from the start, before the configuration names it (else /var/log/nginx).
    argv = ["nginx", "-p", prefix, "-c", main, "-e", os.path.join(prefix, "error.log")]
    log_path = os.path.join(prefix, "error.log")
    process = _start("nginx", argv, pid_file, log_path, popen, timeout_s)
    return Service("nginx", process, f"https://{server_name}:{port}", log_path)


# -- the S3 store (moto) ------------------------------------------------------------------------


def start_moto(run_dir: str, *, host: str, port: int, popen: Popen = subprocess.Popen, timeout_s: float = 60.0) -> Service:
    """moto's S3 server on host:port (0: any free port) in its own process."""
    ready = os.path.join(run_dir, "moto.ready")
    args = _script("moto", "--host", host, "--port", str(port), "--ready", ready)
    process = _start("moto", args, ready, os.path.join(run_dir, "moto.log"), popen, timeout_s)
    return Service("moto", process, Path(ready).read_text(), os.path.join(run_dir, "moto.log"))


class _RangeView:
    """A moto object's bytes, read only where sliced (`serve_ranges_in_place`)."""

    def __init__(self, key: Any) -> None:
        self.key = key

    def __len__(self) -> int:
        return int(self.key.size)

    def __getitem__(self, part: slice) -> bytes:
        start, stop, _ = part.indices(len(self))
        with self.key.lock:
            self.key._value_buffer.seek(start)
            return self.key._value_buffer.read(max(0, stop - start))


def serve_ranges_in_place() -> None:
    """moto (5.2) answers a ranged GET by reading the whole object, then slicing it (S3Response.get_object
    returns `FakeKey.value`; key_response's `_handle_range_header` slices): a range of a 27 MB object
    cost 70 ms, 32 of them 2.2 s where the whole object took 0.14 s (2026-11-29, load 7), so a worker's
    parallel ranges made the store's work grow with their count - not S3's cost, and on the testbed's
    two cores CPU the roles under test lose. Here a ranged GET's `FakeKey.value` is a view that reads
    the bytes sliced from it and no others; every other request, and a Range moto does not slice
    (several ranges, unparsable), gets the object's bytes as before."""
    import threading

    from moto.s3 import models, responses

    ranged = threading.local()  # werkzeug's threaded server: one request a thread
    stock_value, stock_key_response = models.FakeKey.value, responses.S3Response.key_response

    def value(key: Any) -> Any:
        return _RangeView(key) if getattr(ranged, "get", False) else stock_value.fget(key)

    def key_response(self: Any, request: Any, full_url: str, headers: dict[str, Any]) -> Any:
        ranged.get = request.method == "GET" and bool(request.headers.get("range"))
        try:
            status, answer_headers, body = stock_key_response(self, request, full_url, headers)
        finally:
            ranged.get = False
        return status, answer_headers, body[:] if isinstance(body, _RangeView) else body

    models.FakeKey.value = property(value, stock_value.fset)
    responses.S3Response.key_response = key_response


def _serve_moto(host: str, port: int, ready: str) -> None:
    from moto.server import ThreadedMotoServer

    serve_ranges_in_place()
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})  # for sigwait, in every thread
    server = ThreadedMotoServer(ip_address=host, port=port, verbose=False)
    server.start()
    bound_host, bound_port = server.get_host_and_port()
    _write_ready(ready, f"http://{bound_host}:{bound_port}")
    signal.sigwait({signal.SIGTERM, signal.SIGINT})
    os.remove(ready)
    server.stop()


def _write_ready(path: str, text: str) -> None:
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


# -- the fault front ------------------------------------------------------------------------------


class Fault(BaseModel):
    """One fault the front applies to the requests that match it, until it runs out or is cleared."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["slowdown", "stall", "cut"] = Field(
        description="slowdown: 503 SlowDown, nothing forwarded. stall: the headers and `after_bytes` of an "
        "object, then silence on an open connection. cut: as stall, then the connection closed."
    )
    count: int | None = Field(None, ge=1, description="Hit this many requests, then pass everything through.")
    seconds: float | None = Field(None, gt=0, description="Active this long after it is set; None = until cleared or spent.")
    share: float = Field(1.0, gt=0, le=1, description="Each matching request is hit with this probability.")
    match: str = Field("", description="Only requests whose path contains this, e.g. '.safetensors'.")
    methods: list[str] = Field(
        default_factory=list, description="Only these methods; default: any for slowdown, GET for stall and cut "
        "(which hit only answers with a body)."
    )
    after_bytes: int | None = Field(None, ge=0, description="stall, cut: body bytes sent first; None = half the body.")
    seed: int = Field(0, description="Of the draws that `share` makes.")


class Tally:
    """Bytes through the front: in all, per client address and per object path."""

    def __init__(self) -> None:
        self.total = 0
        self.by_client: Counter[str] = Counter()
        self.by_object: Counter[str] = Counter()

    def add(self, client: str, path: str, n: int) -> None:
        self.total += n
        self.by_client[client] += n
        self.by_object[path] += n

    def as_dict(self) -> dict[str, object]:
        return {"total": self.total, "by_client": dict(self.by_client), "by_object": dict(self.by_object)}


class FaultFront:
    """The proxy's state: the fault now set, what it hit, the bytes it served and received."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream.rstrip("/")
        self.fault: Fault | None = None
        self._left: int | None = None  # hits the fault has left (count)
        self._until = 0.0  # monotonic end of its window (seconds)
        self._draws = random.Random(0)
        self.reset()

    def reset(self) -> None:
        self.served, self.received = Tally(), Tally()
        self.requests = 0
        # Answered GETs: (arrived, epoch s; client; path; store's answer after, s; last byte after, s; bytes).
        self.timed: deque[tuple[float, str, str, float, float, int]] = deque(maxlen=TIMED_REQUESTS)
        self.hits: Counter[str] = Counter()
        self.stalled = 0  # connections held in a stall now

    def set_fault(self, fault: Fault | None) -> None:
        self.fault = fault
        if fault is not None:
            self._left = fault.count
            self._until = time.monotonic() + fault.seconds if fault.seconds is not None else float("inf")
            self._draws = random.Random(fault.seed)

    def take(self, kinds: tuple[str, ...], method: str, path: str) -> Fault | None:
        """The fault, if it is of one of `kinds` and hits this request (one hit spent)."""
        fault = self.fault
        if fault is None or fault.kind not in kinds:
            return None
        if self._left == 0 or time.monotonic() >= self._until:
            self.fault = None  # spent
            return None
        methods = fault.methods or (["GET"] if fault.kind in ("stall", "cut") else [])
        if (methods and method not in methods) or fault.match not in path:
            return None
        if fault.share < 1 and self._draws.random() >= fault.share:
            return None
        if self._left is not None:
            self._left -= 1
        self.hits[fault.kind] += 1
        return fault

    def stats(self) -> dict[str, object]:
        return {
            "requests": self.requests, "hits": dict(self.hits), "stalled_now": self.stalled,
            "served": self.served.as_dict(), "received": self.received.as_dict(),
            "fault": None if self.fault is None else self.fault.model_dump(),
        }


async def _proxy(front: FaultFront, session: Any, request: Any) -> Any:
    """Forward one request to the store, streaming both ways, and apply the fault that hits it:
    slowdown before anything is forwarded; stall and cut part-way through an answer's body, or
    (methods PUT or POST) part-way through an upload, which then never reaches the store."""
    from aiohttp import web
    from yarl import URL

    client, path = request.remote or "?", request.path
    front.requests += 1
    arrived, started = time.time(), time.monotonic()
    if front.take(("slowdown",), request.method, path) is not None:
        body = SLOW_DOWN.format(id=uuid.uuid4().hex[:16].upper())
        return web.Response(status=503, text=body, content_type="application/xml")
    if request.headers.get("Expect", "").lower() == "100-continue" and request.version == (1, 1):
        # botocore asks before it sends a body (aiohttp's router would answer this; the low-level server does not).
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        request.writer.output_size = 0  # the answer's own bytes start after it
    if request.body_exists and (fault := front.take(("stall", "cut"), request.method, path)) is not None:
        declared = request.content_length or 0
        stop_at = min(max(declared - 1, 0), declared // 2 if fault.after_bytes is None else fault.after_bytes)
        taken = 0
        while taken < stop_at and (chunk := await request.content.read(min(CHUNK, stop_at - taken))):
            taken += len(chunk)
            front.received.add(client, path, len(chunk))
        return await _fail(front, request, fault, None)

    async def upload() -> AsyncIterator[bytes]:
        async for chunk in request.content.iter_chunked(CHUNK):
            front.received.add(client, path, len(chunk))
            yield chunk

    headers = [(k, v) for k, v in request.headers.items() if k.lower() not in HOP_HEADERS]
    async with session.request(
        request.method, URL(front.upstream + request.raw_path, encoded=True), headers=headers,
        data=upload() if request.body_exists else None, allow_redirects=False,
    ) as answer:
        response = web.StreamResponse(status=answer.status, reason=answer.reason)
        for k, v in answer.headers.items():
            if k.lower() not in HOP_HEADERS and k.lower() != "content-length":
                response.headers.add(k, v)
        length = answer.content_length
        if length is not None:
            response.content_length = length
        fault = None
        if not request.body_exists and answer.status in (200, 206) and length:
            fault = front.take(("stall", "cut"), request.method, path)
        stop_at = None if fault is None else min(length - 1, length // 2 if fault.after_bytes is None else fault.after_bytes)
        answered = time.monotonic() - started
        await response.prepare(request)
        sent = 0
        try:
            async for chunk in answer.content.iter_chunked(CHUNK):
                if stop_at is not None:
                    chunk = chunk[: stop_at - sent]
                await response.write(chunk)
                sent += len(chunk)
                front.served.add(client, path, len(chunk))
                if stop_at is not None and sent >= stop_at:
                    break
        except ConnectionError:  # the client went away mid-answer: nothing to finish
            return response
        if fault is None:
            await response.write_eof()
            if request.method == "GET":
                front.timed.append((arrived, client, path, round(answered, 4), round(time.monotonic() - started, 4), sent))
            return response
        answer.close()  # the rest of the object is not wanted: drop the store's connection
    return await _fail(front, request, fault, response)


async def _fail(front: FaultFront, request: Any, fault: Fault, response: Any) -> Any:
    """End a request hit by a stall or a cut, its answer (if any) part-way through. A stalled
    download ends when its client goes away; a stalled upload (the front stops reading it) when
    the front stops."""
    from aiohttp import web

    response = web.Response(status=500) if response is None else response  # never sent: aiohttp wants one
    if fault.kind == "cut":
        request.transport.close()  # what was written goes out first, then the FIN
        return response
    front.stalled += 1
    try:  # the connection stays open and silent until the client gives up (its handler is cancelled)
        await asyncio.Event().wait()
    finally:
        front.stalled -= 1
    return response


def _control_app(front: FaultFront) -> Any:
    from aiohttp import web

    async def put_fault(request: web.Request) -> web.Response:
        front.set_fault(Fault.model_validate_json(await request.read()))
        return web.json_response(front.stats())

    async def clear_fault(request: web.Request) -> web.Response:
        front.set_fault(None)
        return web.json_response(front.stats())

    async def get_stats(request: web.Request) -> web.Response:
        return web.json_response(front.stats())

    async def get_timings(request: web.Request) -> web.Response:
        return web.json_response(list(front.timed))

    async def reset_stats(request: web.Request) -> web.Response:
        front.reset()
        return web.json_response(front.stats())

    app = web.Application()
    app.router.add_put("/fault", put_fault)
    app.router.add_delete("/fault", clear_fault)
    app.router.add_get("/stats", get_stats)
    app.router.add_get("/timings", get_timings)
    app.router.add_delete("/stats", reset_stats)
    return app


async def _serve_front(host: str, port: int, upstream: str, control: str, ready: str) -> None:
    import aiohttp
    from aiohttp import web

    front = FaultFront(upstream)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
    # Bytes pass as they are: no decompression, no headers the client did not send.
    async with aiohttp.ClientSession(
        connector=connector, timeout=timeout, auto_decompress=False,
        skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding", "Content-Type"),
    ) as session:
        # The low-level server: no router between a request and the proxy; a client that goes away
        # cancels its handler (which is how a stall ends).
        data = web.ServerRunner(
            web.Server(lambda request: _proxy(front, session, request), handler_cancellation=True),
            access_log=None, shutdown_timeout=1.0,
        )
        controls = web.AppRunner(_control_app(front), access_log=None)
        await data.setup()
        await controls.setup()
        try:
            await web.TCPSite(data, host, port).start()
            await web.UnixSite(controls, control).start()
            bound = data.addresses[0]
            _write_ready(ready, f"http://{bound[0]}:{bound[1]}")
            await stop.wait()
        finally:
            await controls.cleanup()
            await data.cleanup()
            for path in (ready, control):
                if os.path.exists(path):
                    os.remove(path)


def start_s3_front(
    run_dir: str, *, host: str, port: int, upstream: str, popen: Popen = subprocess.Popen, timeout_s: float = 60.0,
) -> tuple[Service, FrontControl]:
    """The fault front on host:port (0: any free port) before the S3 server at `upstream`, in its own
    process, and the control of it (a Unix socket in `run_dir`)."""
    ready, control = os.path.join(run_dir, "s3-front.ready"), os.path.join(run_dir, "s3-front.sock")
    args = _script("s3-front", "--host", host, "--port", str(port), "--upstream", upstream, "--control", control, "--ready", ready)
    log_path = os.path.join(run_dir, "s3-front.log")
    process = _start("s3-front", args, ready, log_path, popen, timeout_s)
    return Service("s3-front", process, Path(ready).read_text(), log_path), FrontControl(control)


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self.socket_path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self.socket_path)


class FrontControl:
    """The testbed's hand on a running fault front: set or clear its fault, read or reset its counts."""

    def __init__(self, socket_path: str, timeout_s: float = 10.0) -> None:
        self.socket_path = socket_path
        self.timeout_s = timeout_s

    def _call(self, method: str, path: str, body: bytes | None = None) -> dict[str, Any]:
        connection = _UnixConnection(self.socket_path, self.timeout_s)
        try:
            connection.request(method, path, body=body, headers={"Content-Type": "application/json"})
            answer = connection.getresponse()
            data = answer.read()
            if answer.status != 200:
                raise RuntimeError(f"fault front answered {answer.status}: {data.decode(errors='replace')}")
            return json.loads(data)
        finally:
            connection.close()

    def set(self, kind: str, **options: Any) -> dict[str, Any]:
        """Set a fault (`Fault`'s fields), replacing the one set before; the stats."""
        return self._call("PUT", "/fault", Fault(kind=kind, **options).model_dump_json().encode())  # type: ignore[arg-type]

    def clear(self) -> dict[str, Any]:
        return self._call("DELETE", "/fault")

    def stats(self) -> dict[str, Any]:
        """requests, hits per kind, stalled_now, served and received bytes (total, by_client, by_object), fault."""
        return self._call("GET", "/stats")

    def timings(self) -> list[list[Any]]:
        """The answered GETs since the last reset (the last TIMED_REQUESTS): [arrived (epoch s), client,
        path, the store's answer after (s), the last byte after (s), bytes]."""
        return self._call("GET", "/timings")  # type: ignore[return-value]

    def reset(self) -> dict[str, Any]:
        """Counts back to zero (the fault is kept)."""
        return self._call("DELETE", "/stats")


# -- entry point of the Python services -----------------------------------------------------------


def _die_with_parent() -> None:
    """SIGTERM this process when the one that started it dies, even by SIGKILL: no service outlives the testbed."""
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    moto = commands.add_parser("moto", help="moto's S3 server")
    front = commands.add_parser("s3-front", help="the fault front before an S3 server")
    for command in (moto, front):
        command.add_argument("--host", default="127.0.0.1")
        command.add_argument("--port", type=int, default=0)
        command.add_argument("--ready", required=True, help="written with the service's URL once it listens")
    front.add_argument("--upstream", required=True, help="the S3 server's URL")
    front.add_argument("--control", required=True, help="Unix socket path of the control API")
    args = parser.parse_args(argv)
    _die_with_parent()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.command == "moto":
        _serve_moto(args.host, args.port, args.ready)
    else:
        asyncio.run(_serve_front(args.host, args.port, args.upstream, args.control, args.ready))


if __name__ == "__main__":
    main()
