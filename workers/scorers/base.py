"""What the scorer backends share: `Verdict`, the `ScoreBackend` protocol, `BackendConfigError`, and
the judge's and server teacher's POST (`post`), tries and headers. Its own module so that the
backends and the package's `build_scorer_backend` do not import each other."""

from __future__ import annotations

import http.client
import logging
import os
import random
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from decentrl.api.wire import RunInfo, ScoreItem
from decentrl.model.devices import available_gpus, compute_dtype, device_problem, limit_gpu_memory, machine

if TYPE_CHECKING:
    import torch

log = logging.getLogger("decentrl.scorer")
RETRIED_STATUSES = (408, 429)
ITEM_REFUSED_STATUSES = (400, 413, 422)
NO_ANSWER = (urllib.error.URLError, http.client.HTTPException, TimeoutError, ConnectionError)


class BackendConfigError(ValueError):
    """A backend cannot start as configured; the message says which [scorer] key to change (exit 2)."""


@dataclass(frozen=True)
class Verdict:
    """One item's score from a backend. `score` None: no score could be read (`error` says why)."""

    score: float | None
    step_scores: list[float] | None = None  # one per step of the item, when it has steps and the backend scores them
    error: str | None = None
    retries: int = 0  # replies that did not parse and were asked again (reported to the orchestrator)
    transient: bool = False  # no score for now (the judge unreachable): not posted, leased again after expiry
    token_logprobs: list[float] | None = None  # a distillation teacher's: one per completion token of the item


def take_device(device: str, gpu_memory: float | None, torch_threads: int) -> None:
    """Set up a backend that runs a model here: thread count, device checked, GPU memory share."""
    import torch  # only the backends that run a model load torch: `decentrl scorer --help` stays fast

    torch.set_num_threads(torch_threads)
    problem = device_problem("scorer.device", device, available_gpus())
    if problem:
        raise BackendConfigError(problem)
    limit_gpu_memory(torch.device(device), gpu_memory)


def model_dtype(setting: str, device: str, path: str) -> torch.dtype:
    """The dtype a scorer's model (the directory `path`) computes in: [scorer] dtype, or with "auto"
    its weights' own dtype where `device` computes it natively, else float32 (`compute_dtype`)."""
    import torch
    from transformers import AutoConfig

    if setting == "auto":
        declared = AutoConfig.from_pretrained(path).dtype or torch.float32
        dtype = compute_dtype("auto", torch.device(device), getattr(torch, declared) if isinstance(declared, str) else declared)
    else:
        dtype = getattr(torch, setting)
    log.info("scorer: %s ([scorer] dtype %s)", machine(device).line(str(dtype)[6:]), setting)
    return dtype


def distilled(run: RunInfo) -> tuple[int, str]:
    """The run's vocabulary size and digest, which a teacher's tokenizer must match; a run that does
    not distill has none, and no use for a teacher."""
    if run.vocab_size is None or run.vocab_digest is None:
        raise BackendConfigError(
            f"the run {run.run_name!r} does not distill (its /v1/info gives no vocab_digest): a teacher scorer serves "
            "runs with [orchestrator.advantages.distill] only"
        )
    return run.vocab_size, run.vocab_digest


def headers(api_key_env: str | None, section: str) -> dict[str, str]:
    """A JSON POST's headers, with the bearer key read from the variable `api_key_env` names (the
    key is never logged or put in an error)."""
    found = {"Content-Type": "application/json"}
    if api_key_env is not None:
        key = os.environ.get(api_key_env)
        if not key:
            raise BackendConfigError(f"{section} api_key_env = {api_key_env!r}: that environment variable is not set")
        found["Authorization"] = f"Bearer {key}"
    return found


def attempts(count: int, backoff_s: float) -> Iterator[int]:
    """Try numbers 0..count-1, sleeping before each retry: `backoff_s`, doubling, with jitter."""
    delay = backoff_s
    for attempt in range(count):
        if attempt:
            time.sleep(delay * (0.5 + random.random()))
            delay *= 2
        yield attempt


class Refused(Exception):
    """The server refused this request (400, 413, 422): asking again cannot help."""


class Unreachable(Exception):
    """No answer this time (timeout, connection, 408/429/5xx); asking again may help."""


def post(url: str, body: bytes, headers: dict[str, str], timeout_s: float, refuses_all: Callable[[str], Exception]) -> bytes:
    """POST `body` to an OpenAI-compatible server (the judge's, the teacher's); the answer's bytes.
    Raises Unreachable (ask again), Refused (not this request), or `refuses_all(message)` for any
    other status (a wrong key, model name or URL: the scorer cannot work)."""
    request = urllib.request.Request(url, data=body, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return response.read()
    except urllib.error.HTTPError as exc:
        message = exc.read()[:500].decode(errors="replace")
        if exc.code in RETRIED_STATUSES or exc.code >= 500:
            raise Unreachable(f"{exc.code} {message}") from None
        if exc.code in ITEM_REFUSED_STATUSES:
            raise Refused(f"{exc.code} {message}") from None
        raise refuses_all(f"{exc.code}: {message}") from None
    except NO_ANSWER as exc:
        raise Unreachable(str(exc)) from None


class ScoreBackend(Protocol):
    def score(self, items: list[ScoreItem]) -> list[Verdict]:
        """One verdict per item, in order. May block (the loop calls it in a thread); raises only
        when the backend cannot score at all (the lease is then left to expire and be reassigned)."""
        ...
