"""HTTP client of the orchestrator's API, used by workers, scorers and the trainer (docs/api.md).

Standard library (http.client) plus msgpack, so a worker needs nothing beyond what it generates
with. Connections are kept alive, one per client and thread: a request on a link 300 ms away is one
round trip, not the three of a new TCP and TLS connection. A kept connection the server closed
meanwhile (its keep-alive timeout) is replaced and the request sent again at once. TLS trusts the
system's CAs, or `SSL_CERT_FILE` (read for each new connection); a certificate it cannot verify is
a ConnectionError that says so, never retried. Bodies go as msgpack by default (token ids and logprobs as typed arrays: about a third of
the JSON size and far cheaper to parse), optionally gzip-compressed; answers are asked for as
msgpack too. An orchestrator that answers 415 to msgpack is spoken to in JSON from then on.

Retries: connection failures, and 429/503 answers (rate limit, overload, a journal being
recovered), are retried with the server's Retry-After or exponential backoff with jitter, for at
most `max_wait_s` in all (then raised: unreachable, or still answering 503, as a ConnectionError; 429 as
OrchestratorError), or until `stop()` (a role's SIGTERM): a wait to retry then ends at once
with Stopped, a ConnectionError, so that a role stops in well under a second whether or not the
orchestrator is there (a worker's rollouts stay spooled). A rollout post is patient: 429 and 503
(a full buffer waiting for the trainer, posts crowded) are retried for as long as the orchestrator
answers so, since the rollouts in hand are what it waits for and their leases are renewed meanwhile;
only unreachable counts against `max_wait_s` there. Every retried request is safe to repeat: rollouts and scores are
idempotent by rollout id, and `batch()` sends one request id per call, so a batch whose answer was lost is
answered again with the same batch, never with a second one. Any other HTTP error is raised as
OrchestratorError carrying the server's message; a 2xx answer that does not validate as its
route's model, as InvalidAnswer saying what is wrong with it.
"""

from __future__ import annotations

import gzip
import http.client
import json
import logging
import random
import ssl
import threading
import urllib.parse
import uuid
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ValidationError

from decentrl.api.encoding import MEDIA_JSON, MEDIA_MSGPACK, MSGPACK_TYPES, encode_model, unpack_msgpack
from decentrl.api.wire import (
    API_PREFIX,
    IngestResponse,
    Lease,
    LeaseRequest,
    LeaseResponse,
    LeaseState,
    PublishedVersion,
    RolloutBatch,
    RunInfo,
    ScoreAck,
    ScoreLease,
    ScoreLeaseRequest,
    ScorePost,
    ScoreRenewal,
    StatusResponse,
    StepAck,
    StepPost,
    TokenCreate,
    TokenCreated,
    TokenEntry,
    TokenList,
    TrainBatch,
    TrainerStep,
    VerdictList,
    VersionAnnouncement,
    problems,
)

log = logging.getLogger("decentrl.api.client")
M = TypeVar("M", bound=BaseModel)
Encoding = Literal["msgpack", "json"]
RETRIED_STATUSES = (429, 503)
# What a kept-alive connection the server already closed raises on its next request: sent again on a new one.
_STALE = (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError, ConnectionAbortedError)
GZIP_MIN_BYTES = 16 * 1024  # smaller bodies are not worth compressing


class OrchestratorError(Exception):
    """The orchestrator answered with an error status; the message says why."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"orchestrator answered {status}: {message}")
        self.status = status
        self.message = message


class Unavailable(ConnectionError):
    """503 answered for the whole of the client's `max_wait_s` (a request that is not patient): as
    good as unreachable, and raised as such, so that its callers retry it as they retry a refused
    connection. A proxy in front of an orchestrator that is down or restarting answers so
    (configs/deploy/nginx-orchestrator.conf.template), as does an orchestrator whose journal failed."""

    def __init__(self, url: str, waited_s: float, message: str) -> None:
        super().__init__(f"orchestrator at {url} unavailable for {waited_s:.0f}s: answered 503 ({message})")
        self.status = 503
        self.message = message


class Stopped(ConnectionError):
    """The client was stopped (`OrchestratorClient.stop`) while it waited to retry a request."""


class InvalidAnswer(Exception):
    """The orchestrator's answer is not the model its route promises (another decentrl version,
    or something in between that rewrote it); the message says which fields are wrong."""


class OrchestratorClient:
    def __init__(
        self,
        url: str,
        token: str,
        *,
        timeout_s: float = 60.0,
        max_wait_s: float = 120.0,
        encoding: Encoding = "msgpack",
        gzip: bool = False,
        policy: str | None = None,
    ) -> None:
        """`policy`: in a run of two policies, the one this worker or trainer serves; every request
        that depends on it names it (info, versions, leases, batches, announcements)."""
        self.url = url.rstrip("/")
        self.policy = policy
        parts = urllib.parse.urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"orchestrator URL {url!r}: give it as http(s)://host[:port]")
        self._https, self._host, self._port, self._base = parts.scheme == "https", parts.hostname, parts.port, parts.path
        self._local = threading.local()  # this thread's kept-alive connection
        self._token = token
        self.timeout_s = timeout_s
        self.max_wait_s = max_wait_s  # give up on an unreachable or overloaded orchestrator after this long
        self.encoding: Encoding = encoding
        self.gzip = gzip
        self._stopped = threading.Event()

    def stop(self) -> None:
        """From now on no request is retried: a wait to retry, now or later, raises Stopped at once."""
        self._stopped.set()

    def _connection(self, timeout_s: float) -> tuple[http.client.HTTPConnection, bool]:
        """This thread's connection, and whether it was used before (it may have been closed by the server)."""
        conn: http.client.HTTPConnection | None = getattr(self._local, "conn", None)
        if conn is None:
            # context None: a default context per connection, as urllib made (SSL_CERT_FILE read now).
            conn = (http.client.HTTPSConnection(self._host, self._port, timeout=timeout_s) if self._https
                    else http.client.HTTPConnection(self._host, self._port, timeout=timeout_s))
            self._local.conn = conn
        conn.timeout = timeout_s
        if conn.sock is not None:
            conn.sock.settimeout(timeout_s)
        return conn, conn.sock is not None

    def _drop_connection(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
            self._local.conn = None

    def _exchange(
        self, method: str, path: str, data: bytes | None, headers: dict[str, str], timeout_s: float
    ) -> tuple[int, http.client.HTTPMessage, bytes]:
        """One request on this thread's connection: (status, headers, body). A kept connection
        the server closed since its last answer is replaced and the request sent again, once."""
        for fresh in (False, True):
            conn, reused = self._connection(timeout_s)
            try:
                conn.request(method, self._base + path, body=data, headers=headers)
                response = conn.getresponse()
                payload = response.read()
            except _STALE:
                self._drop_connection()
                if reused and not fresh:
                    continue
                raise
            except (OSError, http.client.HTTPException):
                self._drop_connection()
                raise
            if response.will_close:
                self._drop_connection()
            return response.status, response.headers, payload
        raise AssertionError("unreachable: the second attempt returns or raises")

    def _encode(self, body: BaseModel) -> tuple[bytes, dict[str, str]]:
        media = MEDIA_MSGPACK if self.encoding == "msgpack" else MEDIA_JSON
        data = encode_model(body, media)
        headers = {"Content-Type": media}
        if self.gzip and len(data) >= GZIP_MIN_BYTES:
            data = gzip.compress(data, compresslevel=1)
            headers["Content-Encoding"] = "gzip"
        return data, headers

    def _request(
        self, method: str, path: str, body: BaseModel | None = None, *, timeout_s: float | None = None,
        patient: bool = False,
    ) -> tuple[int, str, bytes]:
        """(status, content type, body) of a 2xx answer; retries as the module docstring says.
        `timeout_s`: the socket timeout, when a long-poll may stay silent longer than the client's.
        `patient`: 429 and 503 answers are retried until `stop()`, not counted against `max_wait_s`."""
        delay, waited, overloaded, said = 0.2, 0.0, 0.0, 0.0
        encoded: tuple[str, tuple[bytes, dict[str, str]]] | None = None
        while True:
            headers = {"Authorization": f"Bearer {self._token}", "Accept": f"{MEDIA_MSGPACK}, {MEDIA_JSON};q=0.5"}
            data = None
            if body is not None:
                if encoded is None or encoded[0] != self.encoding:
                    encoded = (self.encoding, self._encode(body))
                data = encoded[1][0]
                headers.update(encoded[1][1])
            try:
                status, answer_headers, payload = self._exchange(
                    method, path, data, headers, self.timeout_s if timeout_s is None else timeout_s
                )
            except ssl.SSLCertVerificationError as exc:
                # Not a blip: no retry makes the certificate trusted.
                raise ConnectionError(
                    f"orchestrator at {self.url}: its TLS certificate is not trusted ({exc.verify_message}: "
                    f"{exc}); point SSL_CERT_FILE at the CA that signed it (docs/deploy.md)"
                ) from None
            except (OSError, http.client.HTTPException) as exc:
                if waited >= self.max_wait_s:
                    raise ConnectionError(f"orchestrator at {self.url} unreachable for {waited:.0f}s: {exc}") from None
                # The last wait is cut to what is left of max_wait_s: given up on in time, not a backoff later.
                sleep, waiting = min(delay * (0.5 + random.random()), max(0.05, self.max_wait_s - waited)), False
                log.warning("orchestrator unreachable (%s); retrying in %.1fs", exc, sleep)
            else:
                if 200 <= status < 300:
                    return status, answer_headers.get_content_type(), payload
                text = payload.decode(errors="replace")
                try:
                    message = json.loads(text)["error"]
                except (ValueError, KeyError, TypeError):
                    message = text or http.client.responses.get(status, "")
                if 300 <= status < 400:
                    message = f"redirected to {answer_headers.get('Location')}; give the orchestrator's URL as that"
                if status == 415 and body is not None and self.encoding != "json":
                    log.warning("orchestrator refuses msgpack (%s); using JSON from now on", message)
                    self.encoding = "json"
                    continue
                if status == 503 and waited >= self.max_wait_s and not patient:
                    raise Unavailable(self.url, waited, message) from None
                if status not in RETRIED_STATUSES or (waited >= self.max_wait_s and not patient):
                    raise OrchestratorError(status, message) from None
                retry_after = answer_headers.get("Retry-After")
                try:
                    sleep = float(retry_after) * (1.0 + 0.2 * random.random()) if retry_after else delay
                except ValueError:
                    sleep = delay
                waiting = patient
                sleep = min(sleep, 30.0) if patient else min(sleep, 30.0, max(0.05, self.max_wait_s - waited))
                if overloaded < self.max_wait_s:
                    log.warning("orchestrator answered %d (%s); retrying in %.1fs", status, message, sleep)
                elif overloaded - said >= 60.0:  # a long wait on a stalled trainer: said once a minute
                    said = overloaded
                    log.warning("orchestrator has answered %d for %.0fs (%s); still waiting", status, overloaded, message)
            if self._stopped.wait(sleep):
                raise Stopped(f"{method} {path.split('?')[0]} not retried: the client is stopping")
            if waiting:
                overloaded += sleep
            else:
                waited += sleep
            delay = min(delay * 2, 5.0)

    @staticmethod
    def _decode(answer: type[M], media: str, payload: bytes) -> M:
        try:
            if media in MSGPACK_TYPES:
                return answer.model_validate(unpack_msgpack(payload))
            return answer.model_validate_json(payload)
        except ValidationError as exc:
            raise InvalidAnswer(f"the orchestrator's answer is not a valid {answer.__name__}: {problems(exc)}") from None

    def _call(
        self, method: str, path: str, answer: type[M], body: BaseModel | None = None, *, patient: bool = False
    ) -> M:
        _, media, payload = self._request(method, API_PREFIX + path, body, patient=patient)
        return self._decode(answer, media, payload)

    # -- everyone -------------------------------------------------------------------------

    def _of_policy(self) -> dict[str, str]:
        return {} if self.policy is None else {"policy": self.policy}

    def info(self) -> RunInfo:
        query = _query(**self._of_policy())
        return self._call("GET", "/info" + (f"?{query}" if query else ""), RunInfo)

    def status(self) -> StatusResponse:
        return self._call("GET", "/status", StatusResponse)

    def newer_version(self, after: int | None, wait_s: float) -> PublishedVersion:
        """The newest published version as soon as it is newer than `after` (any, with None), or
        after `wait_s` whatever it is: GET /v1/version, a long-poll (workers/versions.py keeps one
        outstanding). Its read timeout is the client's own plus `wait_s`."""
        query = _query(**({} if after is None else {"after": after}), wait_s=f"{wait_s:.3f}", **self._of_policy())
        _, media, payload = self._request("GET", f"{API_PREFIX}/version?{query}", timeout_s=self.timeout_s + wait_s)
        return self._decode(PublishedVersion, media, payload)

    # -- workers --------------------------------------------------------------------------

    def lease(self, request: LeaseRequest) -> LeaseResponse:
        if self.policy is not None:
            request = request.model_copy(update={"policy": self.policy})
        return self._call("POST", "/leases", LeaseResponse, request)

    def post_rollouts(self, batch: RolloutBatch) -> IngestResponse:
        """Patient (the module docstring): a full buffer is waited out, however long the trainer takes."""
        return self._call("POST", "/rollouts", IngestResponse, batch, patient=True)

    def lease_state(self, lease_id: str, worker_id: str) -> LeaseState:
        return self._call("GET", f"/leases/{_quote(lease_id)}?{_query(worker_id=worker_id)}", LeaseState)

    def renew_lease(self, lease_id: str, worker_id: str) -> Lease:
        """Push an open lease's deadline out (call well before it passes when generation is slow)."""
        return self._call("POST", f"/leases/{_quote(lease_id)}/renew?{_query(worker_id=worker_id)}", Lease)

    def release_lease(self, lease_id: str, worker_id: str) -> LeaseState:
        """Give a lease back that this worker will not finish; its prompt is leased again at once."""
        return self._call("DELETE", f"/leases/{_quote(lease_id)}?{_query(worker_id=worker_id)}", LeaseState)

    # -- scorers (workers/scorer.py) ---------------------------------------------------------

    def score_lease(self, request: ScoreLeaseRequest) -> ScoreLease:
        """Samples to score (a long-poll); `items` empty when none waited, ask again after `retry_after_s`."""
        return self._call("POST", "/score/leases", ScoreLease, request)

    def renew_score_lease(self, lease_id: str, scorer_id: str) -> ScoreRenewal:
        """Push a score lease's deadline out while its items are still being scored."""
        return self._call("POST", f"/score/leases/{_quote(lease_id)}/renew?{_query(scorer_id=scorer_id)}", ScoreRenewal)

    def post_scores(self, post: ScorePost) -> ScoreAck:
        return self._call("POST", "/scores", ScoreAck, post)

    def post_steps(self, post: StepPost) -> StepAck:
        """A tree lease's finished steps, for scoring while the rest is generated."""
        return self._call("POST", "/steps", StepAck, post)

    def verdicts(self, worker_id: str, after: int, wait_s: float = 0.0) -> VerdictList:
        """The verdicts on my posted steps after `after`, as soon as one is taken (long-poll up to `wait_s`)."""
        query = _query(worker_id=worker_id, after=after, wait_s=f"{wait_s:.3f}")
        _, media, payload = self._request("GET", f"{API_PREFIX}/verdicts?{query}", timeout_s=self.timeout_s + wait_s)
        return self._decode(VerdictList, media, payload)

    # -- the trainer ----------------------------------------------------------------------

    def announce(self, version: int) -> StatusResponse:
        return self._call("POST", "/version", StatusResponse, VersionAnnouncement(version=version, policy=self.policy))

    def report_step(self, record: dict[str, Any]) -> None:
        """Send a step's metrics.jsonl record (its finite numbers) to the dashboard."""
        self._request("POST", f"{API_PREFIX}/trainer/steps", TrainerStep.from_record(record))

    def batch(self, trainer_version: int, request_id: str | None = None) -> TrainBatch | None:
        """The next batch for a trainer holding `trainer_version`; None if none came in time.

        One request id per call (or the caller's: the trainer names its step): if the answer is
        lost and the request retried, the orchestrator answers with the batch it already served
        instead of a second one.
        """
        query = _query(trainer_version=trainer_version, request_id=request_id or uuid.uuid4().hex, **self._of_policy())
        status, media, payload = self._request("GET", f"{API_PREFIX}/batch?{query}")
        return None if status == 204 else self._decode(TrainBatch, media, payload)

    # -- admins ---------------------------------------------------------------------------

    def list_tokens(self) -> TokenList:
        return self._call("GET", "/admin/tokens", TokenList)

    def create_token(self, name: str, role: str = "worker") -> TokenCreated:
        return self._call("POST", "/admin/tokens", TokenCreated, TokenCreate(name=name, role=role))  # type: ignore[arg-type]

    def revoke_token(self, name: str) -> TokenEntry:
        return self._call("DELETE", f"/admin/tokens/{_quote(name)}", TokenEntry)


def _quote(segment: str) -> str:
    return urllib.parse.quote(segment, safe="")


def _query(**params: object) -> str:
    return urllib.parse.urlencode(params)
