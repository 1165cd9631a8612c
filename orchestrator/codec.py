"""The orchestrator's hot path over the msgpack encoding (decentrl/api/encoding.py): a rollout's
completion ids and logprobs keep the typed arrays a msgpack body carried them in (`pack_sample`; a
JSON body's lists are packed there), and the journal (`encode_rollout`) and the batch answer
(`train_batch_msgpack`) write those bytes as they are, exactly what `encode_model` produces, so
the big lists are never walked again in Python.
"""

from __future__ import annotations

from typing import Any

import msgpack
from pydantic import BaseModel

from decentrl.api.encoding import TypedList, pack_ints, pack_routes, pack_sample, unpack_msgpack
from decentrl.api.wire import ExpertRouting, Rollout, RolloutNode, SamplingParams, TrainBatch

# Rollout fields the lease row already holds (or that are the same for the whole run).
_NOT_IN_BODY = {"rollout_id", "lease_id", "run_name", "prompt_token_ids"}


def train_batch_msgpack(batch: TrainBatch, prompts: dict[str, msgpack.ExtType], prompt_lengths: dict[str, int]) -> bytes:
    """`encode_model(batch, MEDIA_MSGPACK)`, built from the samples' arrays as they came (`prompts`:
    group id -> its packed prompt, of `prompt_lengths` ids; a tree's branch sample, whose prompt is
    longer, packs its own)."""
    samples: list[dict[str, Any]] = []
    names = list(type(batch.samples[0]).model_fields) if batch.samples else []
    for sample in batch.samples:
        fields = {name: getattr(sample, name) for name in names}
        prompt = prompts.get(sample.group_id) if sample.group_id is not None else None
        if prompt is None or len(sample.prompt_token_ids) != prompt_lengths[sample.group_id]:  # a branch's own prompt
            prompt = pack_ints(sample.prompt_token_ids)
        fields["prompt_token_ids"] = prompt
        fields["completion_token_ids"], fields["logprobs"] = pack_sample(sample.completion_token_ids, sample.logprobs)
        if (routing := sample.expert_routing) is not None:  # the expert ids as they came, else packed (uint8 or uint16)
            experts = routing.experts.ext if type(routing.experts) is TypedList else pack_routes(routing.experts)
            fields["expert_routing"] = {"layers": routing.layers, "top_k": routing.top_k, "experts": experts}
        samples.append(fields)
    body = {name: getattr(batch, name) for name in type(batch).model_fields}
    body.update((name, value.model_dump()) for name, value in body.items() if isinstance(value, BaseModel))
    body["samples"] = samples
    return msgpack.packb(body, use_bin_type=True)


def encode_rollout(rollout: Rollout) -> bytes:
    """A rollout's journal body: msgpack with its typed arrays, without what its lease row holds."""
    body = {}
    for name in type(rollout).model_fields:
        if name not in _NOT_IN_BODY:
            value = getattr(rollout, name)
            body[name] = value.model_dump() if isinstance(value, BaseModel) else value
    body["completion_token_ids"], body["logprobs"] = pack_sample(rollout.completion_token_ids, rollout.logprobs)
    if rollout.node is not None and rollout.node.parent is not None:  # a branch: its prompt holds its prefix
        body["prompt_token_ids"] = pack_ints(rollout.prompt_token_ids)
    return msgpack.packb(body, use_bin_type=True)


def decode_rollout(data: bytes, *, rollout_id: str, lease_id: str, run_name: str, prompt_token_ids: list[int]) -> Rollout:
    """A journaled rollout, built without validating it again (it was validated at ingest)."""
    body = unpack_msgpack(data)
    body.setdefault("prompt_token_ids", prompt_token_ids)  # the lease's, but a branch's own
    body.update(rollout_id=rollout_id, lease_id=lease_id, run_name=run_name)
    body["sampling"] = SamplingParams.model_construct(**body["sampling"])
    if body.get("node") is not None:
        body["node"] = RolloutNode.model_validate(body["node"])  # small: its parent's kind is validated
    if body.get("expert_routing") is not None:
        body["expert_routing"] = ExpertRouting.model_construct(**body["expert_routing"])
    return Rollout.model_construct(**body)
