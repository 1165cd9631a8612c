"""Fast paths of the msgpack encoding (decentrl/wire.py, "Encodings") for the orchestrator's hot data.

A rollout's completion ids and logprobs are packed into typed arrays once, when it is
accepted: the journal stores those bytes, and the batch answer to the trainer reuses them, so
the big lists are never walked again in Python. The wire format is exactly what
`wire.pack_msgpack` produces (int32 ids, float64 logprobs: exact), so any client decodes it.
"""

from __future__ import annotations

import sys
from array import array
from typing import Any

import msgpack

from decentrl.wire import EXT_FLOAT64, EXT_INT32, EXT_INT64, TrainBatch

_SWAP = sys.byteorder != "little"
Packed = tuple[msgpack.ExtType, msgpack.ExtType]  # (completion ids, logprobs)


def pack_ints(values: list[int]) -> msgpack.ExtType:
    try:
        packed, code = array("i", values), EXT_INT32
    except OverflowError:
        packed, code = array("q", values), EXT_INT64
    if _SWAP:
        packed.byteswap()
    return msgpack.ExtType(code, packed.tobytes())


def pack_floats(values: list[float]) -> msgpack.ExtType:
    packed = array("d", values)
    if _SWAP:
        packed.byteswap()
    return msgpack.ExtType(EXT_FLOAT64, packed.tobytes())


def train_batch_msgpack(batch: TrainBatch, packed: list[Packed], prompts: dict[str, msgpack.ExtType]) -> bytes:
    """`encode_model(batch, MEDIA_MSGPACK)`, built from the arrays packed at ingest.

    `packed[i]` belongs to `batch.samples[i]`; `prompts` maps a group id to its packed prompt.
    """
    samples: list[dict[str, Any]] = []
    names = list(type(batch.samples[0]).model_fields) if batch.samples else []
    for sample, (ids, logprobs) in zip(batch.samples, packed, strict=True):
        fields = {name: getattr(sample, name) for name in names}
        prompt = prompts.get(sample.group_id) if sample.group_id is not None else None
        fields["prompt_token_ids"] = prompt if prompt is not None else pack_ints(sample.prompt_token_ids)
        fields["completion_token_ids"] = ids
        fields["logprobs"] = logprobs
        samples.append(fields)
    body = {name: getattr(batch, name) for name in type(batch).model_fields}
    body["samples"] = samples
    return msgpack.packb(body, use_bin_type=True)
