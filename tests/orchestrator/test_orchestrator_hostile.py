"""Hostile HTTP input against the live orchestrator on loopback (issue 21): every malformed,
oversized or unauthenticated request gets a 4xx JSON answer that says what to fix, never a 5xx
or a traceback, and no token ever appears in an answer or a log line.

Raw sockets send what aiohttp's client refuses to (control characters in a header, non-UTF-8
token bytes, header lines past 8 KiB, bodies cut short). The SIGTERM test runs a real
`decentrl orchestrator` process.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import logging
import os
import signal
import subprocess
import sys
import time
import zlib
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from transformers import PreTrainedTokenizerBase

from decentrl.api.wire import LeaseRequest, Rollout, RolloutBatch, SamplingParams
from decentrl.store.checkpoints import CheckpointStore
from decentrl.tasks import build_task
from orchestrator.appstate import INFLIGHT
from orchestrator.auth import TokenRegistry, add_token
from orchestrator.journal import Journal
from orchestrator.state import RunState

if TYPE_CHECKING:
    from tests.conftest import LiveOrchestrator as Server

WORKER, OTHER, TRAINER = "worker-secret-token-AAAA1111", "other-secret-token-BBBB2222", "trainer-secret-token-CCCC3333"
TOKENS = [
    {"name": "alice", "role": "worker", "token": WORKER},
    {"name": "bob", "role": "worker", "token": OTHER},
    {"name": "trainer", "role": "trainer", "token": TRAINER},
]
SECRETS = (WORKER, OTHER, TRAINER)


@pytest.fixture
def serve(make_config: Any, tokenizer: PreTrainedTokenizerBase, tmp_path: Path, serve_orchestrator: Any) -> Callable[..., Any]:
    """`async with serve(store=None, **config) as server:` the app with a journal and the tokens above."""

    @asynccontextmanager
    async def running(*, store: CheckpointStore | None = None, **overrides: Any) -> AsyncIterator[Server]:
        config = make_config(**overrides)
        journal = Journal(str(tmp_path / "journal.sqlite"), run_name=config.run_name)
        state = RunState(config=config, task=build_task(config.task), tokenizer=tokenizer, journal=journal)
        try:
            async with serve_orchestrator(state, TokenRegistry(TOKENS), store=store) as server:
                yield server
        finally:
            journal.close()

    return running


def run(scenario: Any) -> None:
    asyncio.run(scenario)


async def raw_request(url: str, data: bytes, *, read_s: float = 5.0) -> tuple[int, dict[str, str], bytes]:
    """Send `data` as it is over a new connection: (status, headers, body) of the answer."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(data)
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(), timeout=read_s)
    finally:
        writer.close()
    head, _, body = answer.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    return int(lines[0].split()[1]), headers, body


def leased_rollouts(server: Server, lease: Any, sampling: SamplingParams, n: int, **fields: Any) -> list[Rollout]:
    ids = [4, 5, 6, 2]
    return [
        Rollout(
            rollout_id=f"{lease.lease_id}-{i}", run_name=server.state.config.run_name, lease_id=lease.lease_id,
            prompt_id=lease.prompt_id, worker_id="w0", policy_version=0, prompt_token_ids=lease.prompt_token_ids,
            completion_token_ids=ids, logprobs=[-0.5] * len(ids), finish_reason="stop", sampling=sampling, **fields,
        )
        for i in range(n)
    ]


def assert_no_secret(*texts: str | bytes) -> None:
    for text in texts:
        text = text.decode("latin-1") if isinstance(text, bytes) else text
        for secret in SECRETS:
            assert secret not in text and secret[:12] not in text, text[:500]


# -- Content-Encoding ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "encoding, body, status, says",
    [
        ("gzip", b'{"worker_id": "w0", "max_groups": 1}', 400, "not valid gzip"),
        ("deflate", b'{"worker_id": "w0", "max_groups": 1}', 400, "not valid deflate"),
        ("gzip", gzip.compress(b'{"worker_id": "w0", "max_groups": 1}')[:-6], 400, "cut short"),
        ("gzip", gzip.compress(b'{"worker_id": "w0", "max_groups": 1}') + b"junk", 400, "bytes after its end"),
        ("br", b"\x0b\x02\x80{}\x03", 415, "not supported"),
        ("compress-9000", b'{"worker_id": "w0", "max_groups": 1}', 415, "not supported"),
        ("deflate", zlib.compress(b'{"worker_id": "w0", "max_groups": 1}'), 200, ""),
        ("GZIP", gzip.compress(b'{"worker_id": "w0", "max_groups": 1}'), 200, ""),
    ],
)
def test_content_encoding(serve: Any, encoding: str, body: bytes, status: int, says: str) -> None:
    async def scenario() -> None:
        async with serve() as server:
            server.state.announce(0)
            got, answer, _ = await server.call(
                "POST", "/v1/leases", WORKER, data=body,
                headers={"Content-Encoding": encoding, "Content-Type": "application/json"},
            )
            assert got == status, answer
            if status != 200:
                assert says in answer["error"]

    run(scenario())


# -- authentication -----------------------------------------------------------------------


def test_bearer_scheme_is_case_insensitive_and_odd_token_bytes_are_401(serve: Any) -> None:
    async def scenario() -> None:
        async with serve() as server:
            for scheme in ("Bearer", "bearer", "BEARER"):
                assert (await server.call("GET", "/v1/info", headers={"Authorization": f"{scheme} {WORKER}"}))[0] == 200
            assert (await server.call("GET", "/v1/info", headers={"Authorization": f"Basic {WORKER}"}))[0] == 401
            for token in (b"\xff\xfe\xfa", "tökén".encode(), WORKER.encode() + b"\xc3\x28"):
                status, _, body = await raw_request(
                    server.url,
                    b"GET /v1/info HTTP/1.1\r\nHost: x\r\nConnection: close\r\nAuthorization: Bearer " + token + b"\r\n\r\n",
                )
                assert status == 401 and b"bearer token" in body, body

    run(scenario())


@pytest.mark.parametrize(
    "header",
    [
        b"Authorization: Bearer " + WORKER.encode() + b"\x01x",  # a control character after the token
        b"Authorization: Bearer " + WORKER.encode() + b"a" * 9000,  # padded past 8 KiB
        b"Authorization : Bearer " + WORKER.encode(),  # a space before the colon
        b"Authorization: Bearer " + WORKER.encode() + b"\rX",  # a bare CR
        b"X-Pad: " + b"b" * 9000 + b"\r\nAuthorization: Bearer " + WORKER.encode(),
    ],
    ids=["control-char", "long-token", "space-before-colon", "bare-cr", "long-other-header"],
)
def test_protocol_errors_never_echo_the_token(serve: Any, header: bytes, caplog: pytest.LogCaptureFixture) -> None:
    async def scenario() -> None:
        async with serve() as server:
            status, headers, body = await raw_request(server.url, b"GET /v1/info HTTP/1.1\r\nHost: x\r\n" + header + b"\r\n\r\n")
            assert 400 <= status < 500 and headers["content-type"].startswith("application/json")
            assert "malformed HTTP request" in json.loads(body)["error"]
            assert_no_secret(body, json.dumps(headers))

    with caplog.at_level(logging.DEBUG):
        run(scenario())
    assert_no_secret(caplog.text)
    assert "Traceback" not in caplog.text
    assert "malformed HTTP request" in caplog.text  # one line, the kind of fault only


# -- strict types and bounds --------------------------------------------------------------


def test_booleans_are_not_integers(serve: Any) -> None:
    async def scenario() -> None:
        async with serve() as server:
            status, error, _ = await server.call("POST", "/v1/version", TRAINER, json={"version": True})
            assert status == 400 and "version" in error["error"]
            status, error, _ = await server.call("POST", "/v1/leases", WORKER, json={"worker_id": "w0", "max_groups": True})
            assert status == 400 and "max_groups" in error["error"]
            assert server.state.published_version is None

    run(scenario())


def test_oversized_lists_are_400_and_never_kept(serve: Any) -> None:
    async def scenario() -> None:
        # A long lease: the 700k-entry mask takes seconds to refuse on a loaded machine.
        async with serve(sampling={"top_k": 2}, orchestrator={"lease_timeout_s": 600.0}) as server:
            server.state.announce(0)
            worker = server.client(WORKER)
            answer = await asyncio.to_thread(worker.lease, LeaseRequest(worker_id="w0", max_groups=1))
            lease = answer.leases[0]
            good = leased_rollouts(server, lease, answer.sampling, 1, sampling_mask=[[4, 5], [5], [6], [2]])
            bad = [r.model_dump(mode="json") for r in good]
            for case, message in (
                ({"sampling_mask": [[4, 5, 6], [5], [6], [2]]}, "at most 2"),  # top_k = 2
                ({"sampling_mask": [list(range(5))] * 4}, "at most 2"),
                ({"expert_routing": {"layers": 64, "top_k": 32, "experts": [1]}}, "at most 1024"),
                ({"expert_routing": {"layers": True, "top_k": 1, "experts": [1]}}, "expert_routing.layers"),
                ({"expert_routing": {"layers": 1, "top_k": 1, "experts": [True]}}, "expert_routing.experts"),
                ({"sampling_mask": [[1]] * 700_000}, "sampling_mask"),
                ({"sampling": {**bad[0]["sampling"], "stop": ["x"] * 100}}, "stop"),
                ({"prompt_id": True}, "prompt_id"),
            ):
                status, error, _ = await server.call("POST", "/v1/rollouts", WORKER, json={"rollouts": [{**bad[0], **case}]})
                assert status == 400 and message in error["error"], (case.keys(), error)
            assert server.state.rollouts_accepted == 0
            assert (await asyncio.to_thread(worker.post_rollouts, RolloutBatch(rollouts=good))).accepted == 1

    run(scenario())


def test_trainer_version_is_bounded_by_the_run(serve: Any) -> None:
    async def scenario() -> None:
        async with serve(trainer={"steps": 10}) as server:
            status, error, _ = await server.call("GET", "/v1/batch?trainer_version=11", TRAINER)
            assert status == 400 and "trainer_version" in error["error"] and "10" in error["error"]
            assert server.state.trainer_version == 0

    run(scenario())


def test_announced_versions_must_be_in_the_store(serve: Any, tmp_path: Path) -> None:
    store = CheckpointStore(f"file://{tmp_path}/store")
    version_dir = tmp_path / "v0"
    version_dir.mkdir()
    (version_dir / "config.json").write_text("{}")
    store.publish(0, str(version_dir))

    async def scenario() -> None:
        async with serve(store=store) as server:
            status, error, _ = await server.call("POST", "/v1/version", TRAINER, json={"version": 2**31 - 1})
            assert status == 409 and "not complete in the store" in error["error"] and "publish it" in error["error"]
            assert server.state.published_version is None
            assert (await server.call("POST", "/v1/version", TRAINER, json={"version": 0}))[0] == 200
            assert (await server.call("POST", "/v1/version", TRAINER, json={"version": 1}))[0] == 409
            assert server.state.published_version == 0

    run(scenario())


def test_an_announcement_the_store_cannot_be_read_for_is_a_503_to_retry(
    serve: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The orchestrator's host cut from the store (F3): its check of an announced version cannot
    read the manifest. That is an outage, not a missing version: 503 with Retry-After (the
    trainer's client retries), not the 409 that stops the trainer's publishing."""
    store = CheckpointStore(f"file://{tmp_path}/store")
    for version in (0, 1):
        version_dir = tmp_path / f"v{version}"
        version_dir.mkdir()
        (version_dir / "config.json").write_text("{}")
        store.publish(version, str(version_dir))
    real = store.fs.cat_file

    def unreachable(*args: Any, **kwargs: Any) -> bytes:
        raise ConnectionRefusedError(111, "Connection refused")

    async def scenario() -> None:
        async with serve(store=store) as server:
            assert (await server.call("POST", "/v1/version", TRAINER, json={"version": 0}))[0] == 200
            monkeypatch.setattr(store.fs, "cat_file", unreachable)
            status, error, headers = await server.call("POST", "/v1/version", TRAINER, json={"version": 1})
            assert status == 503 and headers.get("Retry-After") == "5", (status, error)
            assert "cannot read the store to check version 1" in error["error"] and "announce it again" in error["error"]
            assert server.state.published_version == 0
            monkeypatch.setattr(store.fs, "cat_file", real)
            assert (await server.call("POST", "/v1/version", TRAINER, json={"version": 1}))[0] == 200
            assert server.state.published_version == 1

    run(scenario())


def test_dashboard_routes_take_only_strict_bounded_input(serve: Any) -> None:
    """POST /v1/trainer/steps and GET /v1/dashboard get the same treatment as the run's routes."""

    async def scenario() -> None:
        async with serve(trainer={"steps": 10}) as server:
            step = {"step": 1, "metrics": {"loss": 0.5}}
            for body, status, says in (
                ({"step": True, "metrics": {"loss": 0.5}}, 400, "step"),
                ({"step": 1, "metrics": {"loss": True}}, 400, "metrics.loss"),
                ({"step": 11, "metrics": {"loss": 0.5}}, 400, "trainer.steps = 10"),
                ({"step": 1, "metrics": {f"m{i}": 1.0 for i in range(65)}}, 400, "metrics"),
                ({"step": 1, "metrics": {"Bad Name": 1.0}}, 400, "metrics"),
                ({"step": 1, "metrics": {"loss": 0.5}, "extra": 1}, 400, "extra"),
            ):
                got, answer, _ = await server.call("POST", "/v1/trainer/steps", TRAINER, json=body)
                assert got == status and says in answer["error"], (body, answer)
            assert (await server.call("POST", "/v1/trainer/steps", WORKER, json=step))[0] == 403
            got, answer, _ = await server.call(
                "POST", "/v1/trainer/steps", TRAINER, data=json.dumps(step).encode(),
                headers={"Content-Encoding": "gzip", "Content-Type": "application/json"},
            )
            assert got == 400 and "not valid gzip" in answer["error"]
            assert server.state.status().trainer_version == 0
            got, _, _ = await server.call("POST", "/v1/trainer/steps", TRAINER, json=step)
            assert got == 200
            for since in ("nan", "inf", "-1", "1e400", "x" * 5000):
                got, answer, _ = await server.call("GET", f"/v1/dashboard?since={since}", WORKER)
                assert got == 400 and "since" in answer["error"], (since, answer)
                assert_no_secret(json.dumps(answer))
            got, answer, _ = await server.call("GET", "/v1/dashboard?since=0", WORKER)
            assert got == 200 and answer["steps"][0]["step"] == 1
            got, page, _ = await server.call("GET", "/")
            assert got == 200 and "<html" in page.lower()
            assert (await server.call("GET", "/v1/dashboard"))[0] == 401

    run(scenario())


# -- fairness, timeouts, disconnects ------------------------------------------------------


def test_slow_uploads_hold_no_place_in_flight(serve: Any, caplog: pytest.LogCaptureFixture) -> None:
    """Alice opens more slow uploads than the whole orchestrator has places: each holds only the byte
    it sent (a body is read before its post takes a place), so Alice's and Bob's posts go through
    meanwhile, and each slow one is cut off at body_timeout_s (408)."""

    async def scenario() -> None:
        async with serve(orchestrator={"max_inflight_requests": 8, "max_inflight_per_token": 3, "body_timeout_s": 1.5,
                                       "rate_limit_per_s": 0}) as server:
            server.state.announce(0)
            host, port = server.url.removeprefix("http://").split(":")
            slow = []
            started = time.monotonic()
            for _ in range(10):  # each sends its headers and one byte of a 1000-byte body, then stalls
                reader, writer = await asyncio.open_connection(host, int(port))
                writer.write(
                    b"POST /v1/rollouts HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n"
                    b"Authorization: Bearer " + WORKER.encode() + b"\r\n\r\n{"
                )
                await writer.drain()
                slow.append((reader, writer))
            await asyncio.sleep(0.2)
            assert server.app[INFLIGHT].count == 0
            for token, worker_id in ((OTHER, "b0"), (WORKER, "a0")):
                client = server.client(token)
                answer = await asyncio.to_thread(client.lease, LeaseRequest(worker_id=worker_id, max_groups=1))
                rollouts = leased_rollouts(server, answer.leases[0], answer.sampling, 2)
                rollouts = [r.model_copy(update={"worker_id": worker_id}) for r in rollouts]
                assert (await asyncio.to_thread(client.post_rollouts, RolloutBatch(rollouts=rollouts))).accepted == 2
            statuses = []
            for reader, writer in slow:
                status_line = await asyncio.wait_for(reader.readline(), timeout=5)
                statuses.append(int(status_line.split()[1]))
                writer.close()
            assert statuses == [408] * 10, statuses
            assert time.monotonic() - started < 1.5 + 2.0

    with caplog.at_level(logging.INFO):
        run(scenario())
    assert "Traceback" not in caplog.text


def test_a_body_announced_over_the_limit_is_refused_before_it_is_read(serve: Any) -> None:
    """`Content-Length: 1000000000000` with 2 bytes sent: 413 at once, saying the limit (issue 46, F10)."""

    async def scenario() -> None:
        async with serve(orchestrator={"body_timeout_s": 30.0}) as server:
            for path in ("/v1/rollouts", "/v1/leases", "/v1/version"):
                token = TRAINER if path == "/v1/version" else WORKER
                started = time.monotonic()
                reader, writer = await asyncio.open_connection(*server.url.removeprefix("http://").split(":"))
                writer.write(
                    f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    f"Content-Length: 1000000000000\r\nAuthorization: Bearer {token}\r\n\r\n{{}}".encode()
                )
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=15)
                length = int(next(line for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:")).split(b":")[1])
                body = await reader.readexactly(length)
                writer.close()
                status = int(head.split()[1])
                assert status == 413 and b"max_request_bytes" in body and b"1000000000000" in body, (path, body)
                assert time.monotonic() - started < 1.0, path
                assert_no_secret(body)
            assert server.app[INFLIGHT].count == 0

    run(scenario())


def test_clients_that_drop_mid_body_log_one_line_each_at_most(serve: Any, caplog: pytest.LogCaptureFixture) -> None:
    async def scenario() -> None:
        async with serve(orchestrator={"rate_limit_per_s": 0}) as server:
            host, port = server.url.removeprefix("http://").split(":")
            for _ in range(30):
                _, writer = await asyncio.open_connection(host, int(port))
                writer.write(
                    b"POST /v1/rollouts HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 5000\r\n"
                    b"Authorization: Bearer " + WORKER.encode() + b"\r\n\r\n{\"rollouts\": ["
                )
                await writer.drain()
                writer.close()
            await asyncio.sleep(0.5)
            assert (await server.call("GET", "/v1/info", WORKER))[0] == 200  # still serving

    with caplog.at_level(logging.DEBUG):
        run(scenario())
    assert "Traceback" not in caplog.text
    assert_no_secret(caplog.text)
    assert len([r for r in caplog.records if r.levelno >= logging.WARNING]) <= 6  # throttled: 5 a minute, then one "more"


# -- SIGTERM ------------------------------------------------------------------------------


def connected(pid: int, port: int) -> bool:
    """Whether process `pid` holds an established TCP connection to 127.0.0.1:`port` (Linux /proc)."""
    try:
        inodes = {os.readlink(f"/proc/{pid}/fd/{fd}")[8:-1] for fd in os.listdir(f"/proc/{pid}/fd")}
        table = Path(f"/proc/{pid}/net/tcp").read_text().splitlines()[1:]
    except OSError:
        return False
    for line in table:
        fields = line.split()  # sl local remote state ... inode
        if fields[3] == "01" and int(fields[2].split(":")[1], 16) == port and fields[9] in inodes:
            return True
    return False


@pytest.mark.integration  # a real `decentrl orchestrator` process
def test_sigterm_stops_within_2_s_with_long_polls_pending(tmp_path: Path) -> None:
    from decentrl.cli.launch import free_port
    from tests.orchestrator.test_orchestrator_kill9 import start

    config = tmp_path / "run.toml"
    config.write_text(
        'run_name = "sigterm"\ngroup_size = 2\ntrainer_ranks = 1\n'
        '[model]\ntype = "tiny"\nhidden_size = 32\nnum_layers = 1\nnum_heads = 2\nintermediate_size = 64\n'
        "[orchestrator]\nbatch_wait_s = 30.0\nlease_wait_s = 30.0\n"
    )
    tokens = str(tmp_path / "tokens.json")
    trainer = add_token(tokens, name="trainer", role="trainer")
    worker = add_token(tokens, name="w", role="worker")
    port = free_port()
    process = start(config, tmp_path, port)
    try:
        polls = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    (
                        "import urllib.request, sys\n"
                        f"r = urllib.request.Request('http://127.0.0.1:{port}' + sys.argv[1], method=sys.argv[2], "
                        "data=sys.argv[4].encode() or None, "
                        "headers={'Authorization': 'Bearer ' + sys.argv[3], 'Content-Type': 'application/json'})\n"
                        "print(urllib.request.urlopen(r, timeout=60).status)"
                    ),
                    path,
                    method,
                    token,
                    data,
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
            )
            for path, method, token, data in (
                ("/v1/batch?trainer_version=0", "GET", trainer, ""),
                ("/v1/batch?trainer_version=0", "GET", trainer, ""),
                ("/v1/leases", "POST", worker, '{"worker_id": "w0", "max_groups": 1}'),  # no version yet: waits
                ("/v1/version?wait_s=60", "GET", worker, ""),  # no version yet: waits for v0
            )
        ]
        # Each poll connected (a loaded machine starts them late), then a moment for its request to be read.
        deadline = time.monotonic() + 60
        while not all(connected(poll.pid, port) for poll in polls) and time.monotonic() < deadline:
            assert all(poll.poll() is None for poll in polls), [poll.communicate()[0] for poll in polls]
            time.sleep(0.1)
        assert all(connected(poll.pid, port) for poll in polls), "a long poll never connected"
        time.sleep(1.0)
        assert all(poll.poll() is None for poll in polls), [poll.communicate()[0] for poll in polls]
        started = time.monotonic()
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=10)
        stopped_in = time.monotonic() - started
        assert stopped_in < 2.0, stopped_in
        answers = [poll.communicate(timeout=10)[0].decode() for poll in polls]
        assert all(answer.strip() in ("200", "204") for answer in answers), answers
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGKILL)
            process.wait()
    assert "Traceback" not in (tmp_path / "orchestrator.log").read_text()
