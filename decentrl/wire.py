"""The HTTP wire contract between workers, the orchestrator and the trainer.

Every request and response body is one of these pydantic models; the orchestrator validates
with them, workers and the trainer build them. Bodies travel as JSON or as msgpack (see
"Encodings" at the end): the same objects, with the long token id and logprob lists packed as
typed little-endian arrays. docs/api.md describes every route.
"""

from __future__ import annotations

import math
import sys
from array import array
from collections.abc import Sequence
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidatorFunctionWrapHandler, WrapValidator, model_validator

API_PREFIX = "/v1"
WORKER_ID = r"^[A-Za-z0-9._:@-]{1,128}$"  # no "/": lease holders are "token-name/worker-id"
TOKEN_NAME = r"^[A-Za-z0-9._:@-]{1,64}$"  # no "/" either, for the same reason
MAX_VERSION = 2**31 - 1  # versions and prompt ids fit the journal's integers with room to spare


class Wire(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _keep_typed_ints(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
    # A non-empty TypedList decoded from an int32/int64 array holds ints by construction: kept
    # as it is (C-speed checks of its values: `value_range`) instead of validating each
    # element again, about 20 ns a number. Anything else, an empty one included, is validated.
    if type(value) is TypedList and value and value.ext.code in (EXT_INT32, EXT_INT64):
        return value
    return handler(value)


def _keep_typed_floats(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
    if type(value) is TypedList and value and value.ext.code in (EXT_FLOAT32, EXT_FLOAT64):
        return value
    return handler(value)


# list[int] / list[float] on the wire and in /openapi.json; a msgpack typed array of the right
# kind skips per-element validation (see "Encodings").
IntArray = Annotated[list[int], WrapValidator(_keep_typed_ints)]
FloatArray = Annotated[list[float], WrapValidator(_keep_typed_floats)]


class SamplingParams(Wire):
    """The sampling the worker actually applied; logprobs are of this distribution."""

    temperature: float = Field(gt=0, description="Softmax temperature.")
    max_tokens: int = Field(ge=1, description="Most completion tokens.")
    top_k: int = Field(0, ge=0, description="0 = no top-k truncation.")
    top_p: float = Field(1.0, gt=0, le=1, description="1.0 = no nucleus truncation.")
    stop: list[str] = Field(
        default_factory=list, description="Stop strings; the token completing one is the last token kept."
    )


class RunInfo(Wire):
    """GET /v1/info: what a worker needs to join with only a URL and a token."""

    run_name: str
    store_url: str = Field(description="fsspec URL of the checkpoint store.")
    policy_version: int | None = Field(description="Newest published version; None before v0 exists.")
    max_staleness: int = Field(ge=0)
    group_size: int = Field(ge=1)
    episode_task: dict[str, Any] | None = Field(
        None, description="The run's [task] config when it is multi-turn: workers build its environment from it "
        "(decentrl/tasks/episodes.py). None for single-turn tasks."
    )


class LeaseRequest(Wire):
    worker_id: str = Field(pattern=WORKER_ID, description="Stable name of the worker.")
    max_groups: int = Field(ge=1, le=1024, description="Most prompt groups wanted.")


class Lease(Wire):
    """One prompt leased to one worker: it owes `group_size` samples before `deadline`."""

    lease_id: str
    prompt_id: int = Field(ge=0, le=MAX_VERSION)
    prompt_token_ids: IntArray
    group_size: int = Field(ge=1)
    deadline: float = Field(description="Unix time after which the prompt is leased again.")


class LeaseResponse(Wire):
    policy_version: int | None = Field(description="Newest published version; generate with it.")
    sampling: SamplingParams
    leases: list[Lease] = Field(description="Empty when the run needs no more rollouts right now.")
    retry_after_s: float = Field(0.0, ge=0, description="When empty: wait this long before asking again.")


FinishReason = Literal["stop", "length"]


class Rollout(Wire):
    """One sample of a group, as the worker produced it."""

    rollout_id: str = Field(min_length=1, max_length=128, description="Unique; resends are idempotent.")
    run_name: str
    lease_id: str = Field(max_length=128, description="The lease this sample answers; also its group id.")
    prompt_id: int = Field(ge=0, le=MAX_VERSION)
    worker_id: str = Field(pattern=WORKER_ID)
    policy_version: int = Field(
        ge=0, le=MAX_VERSION, description="Version of the weights that sampled the first token."
    )
    token_versions: IntArray | None = Field(
        None, description="Per completion token version, when generation spanned a weight swap."
    )
    prompt_token_ids: IntArray = Field(min_length=1)
    completion_token_ids: IntArray = Field(min_length=1)
    logprobs: FloatArray = Field(description="Sampling logprob of each completion token.")
    finish_reason: FinishReason
    sampling: SamplingParams
    sampling_mask: list[list[int]] | None = Field(
        None, description="Per token, the vocabulary ids kept by top-k/top-p truncation (None: all)."
    )
    expert_routing: list[list[int]] | None = Field(None, description="MoE routing per token, if any.")
    claimed_reward: float | None = Field(None, description="The worker's own reward; never trusted.")
    loss_mask: list[Literal[0, 1]] | None = Field(
        None, description="Multi-turn episodes: per completion token 1 if the model sampled it, 0 if the "
        "environment inserted it (feedback, tool output; not trained, logprob unused). None: all 1."
    )

    @model_validator(mode="after")
    def _lengths_agree(self) -> Rollout:
        n = len(self.completion_token_ids)
        for name in ("logprobs", "token_versions", "sampling_mask", "loss_mask"):
            values = getattr(self, name)
            if values is not None and len(values) != n:
                raise ValueError(f"{name} has {len(values)} entries but completion_token_ids has {n}")
        if not _valid_logprobs(self.logprobs):
            raise ValueError("logprobs must be finite and <= 0 (log of a probability)")
        return self


def _valid_logprobs(logprobs: list[float]) -> bool:
    """Every value finite and <= 0 (1e-4 of rounding allowed): one NaN or -inf would otherwise
    reach the trainer's loss."""
    if not logprobs:
        return True
    if type(logprobs) is TypedList:
        low, high = value_range(logprobs)  # numpy's min and max propagate NaN
        return math.isfinite(low) and high <= 1e-4
    # NaN compares false with everything, so Python's max alone would miss it. A sum is finite
    # only if every term is (NaN and infinities propagate); only when it is not (or a huge sum
    # overflowed) is each value checked in Python.
    if math.isfinite(sum(logprobs)) and max(logprobs) <= 1e-4:
        return True
    return all(math.isfinite(lp) and lp <= 1e-4 for lp in logprobs)


class RolloutBatch(Wire):
    """POST /v1/rollouts body."""

    rollouts: list[Rollout] = Field(min_length=1, max_length=4096)


class Rejection(Wire):
    rollout_id: str
    reason: str


class IngestResponse(Wire):
    accepted: int = Field(ge=0)
    duplicates: int = Field(0, ge=0, description="Already acknowledged earlier; counted once.")
    rejected: list[Rejection] = Field(default_factory=list)


class TrainSample(Wire):
    """One sample as the trainer consumes it: tokens, sampling logprobs and its advantage."""

    prompt_token_ids: IntArray
    completion_token_ids: IntArray
    logprobs: FloatArray
    advantage: float
    reward: float
    policy_version: int
    group_id: str | None = Field(None, description="The group (lease) it belongs to; the trainer filters by group.")
    rollout_id: str | None = Field(None, description="The worker's rollout id, to trace a sample back.")
    sampling_mask: list[list[int]] | None = Field(
        None, description="The rollout's sampling mask: per completion token, the vocabulary ids kept by "
        "top-k/top-p (None: no truncation). The trainer truncates its distribution the same way."
    )
    loss_mask: list[Literal[0, 1]] | None = Field(
        None, description="The rollout's loss mask (multi-turn): 0 marks environment tokens the trainer skips."
    )


class TrainBatch(Wire):
    """GET /v1/batch answer: complete groups, fresh for the trainer's current version."""

    trainer_version: int = Field(ge=0)
    samples: list[TrainSample]
    staleness_histogram: dict[str, int] = Field(description="Samples per (trainer_version - policy_version).")
    rollouts_accepted: int = Field(ge=0, description="Run total acknowledged so far.")
    stale_dropped: int = Field(ge=0, description="Run total dropped as stale (ingest or buffer).")
    batch_id: str | None = Field(
        None, description="Unique per batch; a resent request (same request_id) gets the same batch again."
    )


class VersionAnnouncement(Wire):
    """POST /v1/version (trainer): version N is complete in the store."""

    version: int = Field(ge=0, le=MAX_VERSION)


class StatusResponse(Wire):
    """GET /v1/status: counters for progress displays."""

    run_name: str
    policy_version: int | None
    trainer_version: int
    rollouts_accepted: int
    rollouts_rejected: dict[str, int]
    stale_dropped: int
    groups_ready: int
    groups_served: int
    leases_active: int
    leases_expired: int
    reward_mean_recent: float | None
    uptime_s: float
    rollouts_duplicate: int = Field(0, description="Resends of rollouts already acknowledged (counted once).")
    dropped: dict[str, int] = Field(
        default_factory=dict, description="Accepted samples dropped later, per reason (stale, lease expired, ...)."
    )
    buffer_limit: int | None = Field(None, description="Depth bound: ready groups plus open leases.")
    journal: bool = Field(False, description="Whether acknowledged state is journaled on disk.")
    recoveries: int = Field(0, description="How many times this run's state was recovered from the journal.")
    groups_verifying: int = Field(0, description="Complete groups held back until their logprob spot-check is done.")
    verification: dict[str, float] | None = Field(
        None, description="Logprob spot-checks: rollouts_checked, checks, loads, compute_s, cpu_s, load_s, load_cpu_s, "
        "forward_s, forward_cpu_s, startup_s, largest_passing_diff, tolerance (None when verification is off; "
        "docs/security.md).",
    )
    workers: dict[str, dict[str, Any]] = Field(
        default_factory=dict,
        description="Per token: rollouts, checked, passed (held-back groups whose check passed), strikes, "
        "reward_mismatches (claimed reward disagreed; never used), served, rejections by reason, banned. "
        "See docs/security.md.",
    )


class LeaseState(Wire):
    """GET /v1/leases/{lease_id}: where one lease stands (its holder only)."""

    lease_id: str
    prompt_id: int
    state: Literal["open", "complete", "served", "expired", "released", "dropped"]
    samples: int = Field(ge=0, description="Samples acknowledged for it so far.")
    group_size: int = Field(ge=1)
    deadline: float = Field(description="Unix time; for an open lease, when it expires.")


class ErrorBody(Wire):
    """Every 4xx/5xx answer: one human-readable sentence saying what to fix."""

    error: str


class TokenCreate(Wire):
    """POST /v1/admin/tokens (admin): a new bearer token."""

    name: str = Field(pattern=TOKEN_NAME, description="Who holds it; unique.")
    role: Literal["worker", "trainer", "admin"] = "worker"


class TokenCreated(Wire):
    name: str
    role: Literal["worker", "trainer", "admin"]
    token: str = Field(description="Shown once: the orchestrator keeps only the tokens file.")


class TokenEntry(Wire):
    name: str
    role: Literal["worker", "trainer", "admin"]
    source: Literal["file", "env", "memory"]


class TokenList(Wire):
    """GET /v1/admin/tokens (admin): names and roles, never the tokens."""

    tokens: list[TokenEntry]


class Health(Wire):
    """GET /healthz: liveness for load balancers; 503 when the journal has failed."""

    ok: bool
    journal: bool


# -- Encodings ------------------------------------------------------------------------------
#
# JSON (application/json) is the reference. msgpack (application/msgpack) carries the same
# objects; the lists named in ARRAY_FIELDS travel as msgpack ext types holding little-endian
# typed arrays: 4 bytes a token id instead of up to 6 characters, 4 (or 8) bytes a logprob
# instead of about 20. Either may be gzip-compressed (Content-Encoding: gzip). Decoding turns
# every ext into a list (a TypedList that keeps the bytes): the pydantic models see the same
# objects from both encodings, except that an IntArray or FloatArray field takes a typed array
# of its kind without checking each element (an int32 array holds ints), and value checks
# (ranges, finiteness) run over its bytes with numpy.

MEDIA_JSON = "application/json"
MEDIA_MSGPACK = "application/msgpack"
MSGPACK_TYPES = frozenset({MEDIA_MSGPACK, "application/x-msgpack", "application/vnd.msgpack"})
EXT_INT32, EXT_INT64, EXT_FLOAT32, EXT_FLOAT64 = 1, 2, 3, 4
_EXT_TYPECODES = {EXT_INT32: "i", EXT_INT64: "q", EXT_FLOAT32: "f", EXT_FLOAT64: "d"}
ARRAY_FIELDS = {"prompt_token_ids": "int", "completion_token_ids": "int", "token_versions": "int", "logprobs": "float"}
_SWAP = sys.byteorder != "little"


class EncodingError(ValueError):
    """A body that is not valid msgpack (or uses an unknown ext type)."""


def _typed(values: list[Any], kind: str, exact_floats: bool) -> Any:
    """A list as an ext-typed array where that is lossless, else the list itself."""
    import msgpack

    try:
        if kind == "int":
            try:
                packed, code = array("i", values), EXT_INT32
            except OverflowError:
                packed, code = array("q", values), EXT_INT64
        elif exact_floats:
            packed, code = array("d", values), EXT_FLOAT64
        else:
            packed, code = array("f", values), EXT_FLOAT32
            if packed.tolist() != values:  # not exactly representable in float32 (or NaN)
                packed, code = array("d", values), EXT_FLOAT64
    except (OverflowError, TypeError):
        return values  # out of range or not numbers: plain msgpack, the receiver validates it
    if _SWAP:
        packed.byteswap()
    return msgpack.ExtType(code, packed.tobytes())


def _pack_arrays(value: Any, exact_floats: bool) -> Any:
    if isinstance(value, dict):
        return {
            k: _typed(v, ARRAY_FIELDS[k], exact_floats)
            if k in ARRAY_FIELDS and isinstance(v, list) and v
            else _pack_arrays(v, exact_floats)
            for k, v in value.items()
        }
    if isinstance(value, list) and value and isinstance(value[0], (dict, list)):
        return [_pack_arrays(v, exact_floats) for v in value]
    return value


class TypedList(list):  # type: ignore[type-arg]
    """A list decoded from a typed array; `ext` keeps the array as received, to store or send on
    as is, and to check its values at C speed (`value_range`). IntArray and FloatArray fields
    keep it without validating each element: its type says what they are."""

    __slots__ = ("ext",)


_EXT_DTYPES = {EXT_INT32: "<i4", EXT_INT64: "<i8", EXT_FLOAT32: "<f4", EXT_FLOAT64: "<f8"}


def value_range(values: Sequence[Any]) -> tuple[Any, Any]:
    """(min, max) of a non-empty list: from the packed bytes with numpy for a TypedList (about
    8x faster than Python's min and max over a list; a NaN propagates to both), else min, max."""
    if type(values) is TypedList:
        import numpy as np

        packed = np.frombuffer(values.ext.data, dtype=_EXT_DTYPES[values.ext.code])
        return packed.min().item(), packed.max().item()
    return min(values), max(values)


def _ext_hook(code: int, data: bytes) -> list[Any]:
    import msgpack

    typecode = _EXT_TYPECODES.get(code)
    if typecode is None:
        raise EncodingError(f"unknown msgpack ext type {code}")
    values = array(typecode)
    if len(data) % values.itemsize:
        raise EncodingError(f"msgpack ext type {code}: {len(data)} bytes is not a whole number of items")
    values.frombytes(data)
    if _SWAP:
        values.byteswap()
    decoded = TypedList(values.tolist())
    decoded.ext = msgpack.ExtType(code, data)
    return decoded


def pack_msgpack(obj: Any, *, exact_floats: bool = False) -> bytes:
    """msgpack bytes of a JSON-like object; ARRAY_FIELDS lists become typed arrays.

    Floats go as float32 where that is exact (logprobs computed in float32 are), else float64;
    `exact_floats` skips the check and always sends float64 (cheaper to encode, larger).
    """
    import msgpack

    return msgpack.packb(_pack_arrays(obj, exact_floats), use_bin_type=True)


def unpack_msgpack(data: bytes) -> Any:
    """The JSON-like object of msgpack bytes (typed arrays back to lists); EncodingError if bad."""
    import msgpack

    try:
        return msgpack.unpackb(data, raw=False, ext_hook=_ext_hook, strict_map_key=True)
    except EncodingError:
        raise
    except Exception as exc:  # msgpack raises several unrelated types on bad input
        raise EncodingError(f"not valid msgpack: {exc}") from None


def encode_model(model: BaseModel, media_type: str) -> bytes:
    """A model's body in `media_type` (MEDIA_JSON or MEDIA_MSGPACK)."""
    if media_type in MSGPACK_TYPES:
        return pack_msgpack(model.model_dump(mode="json"))
    return model.model_dump_json().encode()
