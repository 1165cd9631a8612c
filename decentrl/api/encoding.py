"""Body encodings of the wire contract: JSON and msgpack with typed arrays.

Every role reads and writes bodies through this module: workers and the trainer
(`decentrl/api/client.py`), the orchestrator (`orchestrator/body.py` for HTTP bodies, its journal
and batch answers through `orchestrator/codec.py`). The models the bodies carry are in
`decentrl/api/wire.py`.

JSON (application/json) is the reference. msgpack (application/msgpack) carries the same
objects; the lists named in ARRAY_FIELDS travel as msgpack ext types holding little-endian
typed arrays: 4 bytes a token id instead of up to 6 characters, 4 (or 8) bytes a logprob
instead of about 20. Either may be gzip-compressed (Content-Encoding: gzip). Decoding turns
every ext into a list (a TypedList that keeps the bytes): the pydantic models see the same
objects from both encodings, except that an IntArray or FloatArray field (decentrl/api/wire.py)
takes a typed array of its kind without checking each element (an int32 array holds ints), and
value checks (ranges, finiteness) run over its bytes with numpy (`value_range`).
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence
from typing import Any

import msgpack
from pydantic import BaseModel

MEDIA_JSON = "application/json"
MEDIA_MSGPACK = "application/msgpack"
MSGPACK_TYPES = frozenset({MEDIA_MSGPACK, "application/x-msgpack", "application/vnd.msgpack"})
EXT_INT32, EXT_INT64, EXT_FLOAT32, EXT_FLOAT64, EXT_UINT8, EXT_UINT16 = 1, 2, 3, 4, 5, 6
INT_EXTS = frozenset({EXT_INT32, EXT_INT64, EXT_UINT8, EXT_UINT16})
_EXT_TYPECODES = {EXT_INT32: "i", EXT_INT64: "q", EXT_FLOAT32: "f", EXT_FLOAT64: "d", EXT_UINT8: "B", EXT_UINT16: "H"}
_EXT_DTYPES = {EXT_INT32: "<i4", EXT_INT64: "<i8", EXT_FLOAT32: "<f4", EXT_FLOAT64: "<f8", EXT_UINT8: "<u1", EXT_UINT16: "<u2"}
# "route": MoE expert ids (decentrl/model/routing.py), one byte each while every id is below 256.
ARRAY_FIELDS = {
    "prompt_token_ids": "int", "completion_token_ids": "int", "token_versions": "int", "logprobs": "float",
    "token_advantages": "float", "token_logprobs": "float",
    "experts": "route",
}
_SWAP = sys.byteorder != "little"  # the wire is little-endian whatever the machine


class EncodingError(ValueError):
    """A body that is not valid msgpack (or uses an unknown ext type)."""


class TypedList(list):  # type: ignore[type-arg]
    """A list decoded from a typed array; `ext` keeps the array as received, to store or send on
    as is, and to check its values at C speed (`value_range`). IntArray and FloatArray fields
    keep it without validating each element: its type says what they are."""

    __slots__ = ("ext",)


# A sample's completion ids and logprobs as typed arrays, as a msgpack body carries them and as
# the orchestrator keeps and journals them (orchestrator/codec.py).
Packed = tuple[msgpack.ExtType, msgpack.ExtType]


def _ext(packed: array, code: int) -> msgpack.ExtType:  # type: ignore[type-arg]
    if _SWAP:
        packed.byteswap()
    return msgpack.ExtType(code, packed.tobytes())


def pack_ints(values: Sequence[int]) -> msgpack.ExtType:
    """Integers as an int32 array, or int64 where one does not fit (OverflowError past that)."""
    try:
        return _ext(array("i", values), EXT_INT32)
    except OverflowError:
        return _ext(array("q", values), EXT_INT64)


def pack_sample(completion_token_ids: Sequence[int], logprobs: Sequence[float]) -> Packed:
    """A sample's completion ids and logprobs as the orchestrator journals and serves them: the
    typed arrays a msgpack body carried them in (a TypedList keeps its bytes), else packed now."""
    ids, floats = completion_token_ids, logprobs
    return (
        ids.ext if type(ids) is TypedList and ids.ext.code in (EXT_INT32, EXT_INT64) else pack_ints(ids),
        floats.ext if type(floats) is TypedList and floats.ext.code in (EXT_FLOAT32, EXT_FLOAT64) else pack_floats(floats),
    )


def pack_routes(values: Sequence[int]) -> msgpack.ExtType:
    """Expert ids as a uint8 array, or uint16 where one is 256 or more (OverflowError past 65535
    or below 0: such ids then travel as a plain list and the receiver rejects them)."""
    try:
        return _ext(array("B", values), EXT_UINT8)
    except OverflowError:
        return _ext(array("H", values), EXT_UINT16)


def pack_floats(values: Sequence[float]) -> msgpack.ExtType:
    """Floats as a float64 array: exact, and cheaper to build than checking float32 first."""
    return _ext(array("d", values), EXT_FLOAT64)


def _pack_float32_where_exact(values: list[float]) -> msgpack.ExtType:
    packed = array("f", values)
    if packed.tolist() != values:  # not exactly representable in float32 (or NaN)
        return pack_floats(values)
    return _ext(packed, EXT_FLOAT32)


def _typed(values: list[Any], kind: str, exact_floats: bool) -> Any:
    """A list as an ext-typed array where that is lossless, else the list itself."""
    try:
        if kind == "int":
            return pack_ints(values)
        if kind == "route":
            return pack_routes(values)
        return pack_floats(values) if exact_floats else _pack_float32_where_exact(values)
    except (OverflowError, TypeError):
        return values  # out of range or not numbers: plain msgpack, the receiver validates it


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


def value_range(values: Sequence[Any]) -> tuple[Any, Any]:
    """(min, max) of a non-empty list: from the packed bytes with numpy for a TypedList (about
    8x faster than Python's min and max over a list; a NaN propagates to both), else min, max."""
    if type(values) is TypedList:
        import numpy as np  # not at import time: `decentrl --help` stays fast

        packed = np.frombuffer(values.ext.data, dtype=_EXT_DTYPES[values.ext.code])
        return packed.min().item(), packed.max().item()
    return min(values), max(values)


def _ext_hook(code: int, data: bytes) -> list[Any]:
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
    return msgpack.packb(_pack_arrays(obj, exact_floats), use_bin_type=True)


def unpack_msgpack(data: bytes) -> Any:
    """The JSON-like object of msgpack bytes (typed arrays back to lists); EncodingError if bad."""
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
