"""HTTP client of the orchestrator's API, used by workers and the trainer.

Standard library only (urllib), so a worker needs nothing beyond what it generates with.
Connection failures are retried with exponential backoff and jitter; an HTTP error from the
orchestrator is raised as OrchestratorError carrying the server's message.
"""

from __future__ import annotations

import json
import logging
import random
import time
import urllib.error
import urllib.request
from typing import TypeVar

from pydantic import BaseModel

from decentrl.wire import (
    API_PREFIX,
    IngestResponse,
    LeaseRequest,
    LeaseResponse,
    RolloutBatch,
    RunInfo,
    StatusResponse,
    TrainBatch,
    VersionAnnouncement,
)

log = logging.getLogger("decentrl.client")
M = TypeVar("M", bound=BaseModel)


class OrchestratorError(Exception):
    """The orchestrator answered with an error status; the message says why."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"orchestrator answered {status}: {message}")
        self.status = status


class OrchestratorClient:
    def __init__(self, url: str, token: str, *, timeout_s: float = 60.0, max_wait_s: float = 120.0) -> None:
        self.url = url.rstrip("/")
        self._token = token
        self.timeout_s = timeout_s
        self.max_wait_s = max_wait_s  # give up on an unreachable orchestrator after this long

    def _request(self, method: str, path: str, body: BaseModel | None = None) -> tuple[int, bytes]:
        data = body.model_dump_json().encode() if body is not None else None
        request = urllib.request.Request(
            self.url + API_PREFIX + path,
            data=data,
            method=method,
            headers={"Authorization": f"Bearer {self._token}", "Content-Type": "application/json"},
        )
        delay, waited = 0.2, 0.0
        while True:
            try:
                with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                    return response.status, response.read()
            except urllib.error.HTTPError as exc:
                text = exc.read().decode(errors="replace")
                try:
                    message = json.loads(text)["error"]
                except (ValueError, KeyError, TypeError):
                    message = text or exc.reason
                raise OrchestratorError(exc.code, message) from None
            except (urllib.error.URLError, ConnectionError, TimeoutError) as exc:
                if waited >= self.max_wait_s:
                    raise ConnectionError(f"orchestrator at {self.url} unreachable for {waited:.0f}s: {exc}") from None
                sleep = delay * (0.5 + random.random())
                log.warning("orchestrator unreachable (%s); retrying in %.1fs", exc, sleep)
                time.sleep(sleep)
                waited += sleep
                delay = min(delay * 2, 5.0)

    def _call(self, method: str, path: str, answer: type[M], body: BaseModel | None = None) -> M:
        _, payload = self._request(method, path, body)
        return answer.model_validate_json(payload)

    def info(self) -> RunInfo:
        return self._call("GET", "/info", RunInfo)

    def status(self) -> StatusResponse:
        return self._call("GET", "/status", StatusResponse)

    def lease(self, request: LeaseRequest) -> LeaseResponse:
        return self._call("POST", "/leases", LeaseResponse, request)

    def post_rollouts(self, batch: RolloutBatch) -> IngestResponse:
        return self._call("POST", "/rollouts", IngestResponse, batch)

    def announce(self, version: int) -> StatusResponse:
        return self._call("POST", "/version", StatusResponse, VersionAnnouncement(version=version))

    def batch(self, trainer_version: int) -> TrainBatch | None:
        """The next batch for a trainer holding `trainer_version`; None if none came in time."""
        status, payload = self._request("GET", f"/batch?trainer_version={trainer_version}")
        return None if status == 204 else TrainBatch.model_validate_json(payload)
