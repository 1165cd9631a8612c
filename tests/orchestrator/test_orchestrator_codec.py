"""Pieces of the orchestrator service without HTTP: the msgpack encoding (decentrl/api/encoding.py),
the fast paths that must agree with the slow ones, the token registry, the rate limiter and the
`token` CLI."""

from __future__ import annotations

import hmac
import json
import math
import random
import struct
from pathlib import Path
from typing import Any

import msgpack
import pytest
from pydantic import ValidationError
from transformers import PreTrainedTokenizerBase
from typer.testing import CliRunner

from decentrl.api.encoding import (
    EXT_FLOAT32,
    EXT_FLOAT64,
    EXT_INT32,
    EXT_INT64,
    MEDIA_MSGPACK,
    EncodingError,
    TypedList,
    encode_model,
    pack_ints,
    pack_msgpack,
    pack_sample,
    unpack_msgpack,
    value_range,
)
from decentrl.api.wire import Rollout, SamplingParams, TrainBatch, TrainSample
from decentrl.cli.main import app as cli
from orchestrator.auth import Identity, TokenRegistry, add_token, list_tokens, parse_env_tokens, revoke_token
from orchestrator.codec import train_batch_msgpack
from orchestrator.limits import RateLimiter, retry_after_header
from orchestrator.tokenizer import make_decoder, make_encoder, piece_table


def rollout(**fields: Any) -> Rollout:
    values: dict[str, Any] = {
        "rollout_id": "r1", "run_name": "unit", "lease_id": "l1", "prompt_id": 3, "worker_id": "w0",
        "policy_version": 2, "prompt_token_ids": [1, 7, 8, 3], "completion_token_ids": [4, 5, 2],
        "logprobs": [-0.5, -0.25, -3.0], "finish_reason": "stop",
        "sampling": SamplingParams(temperature=1.0, max_tokens=6),
    }
    values.update(fields)
    return Rollout(**values)


# -- msgpack ------------------------------------------------------------------------------


def test_msgpack_round_trip_uses_typed_arrays() -> None:
    original = rollout(token_versions=[2, 2, 2], claimed_reward=0.5, sampling_mask=[[4, 5], [], [2]])
    data = encode_model(original, MEDIA_MSGPACK)
    raw = msgpack.unpackb(data, raw=False)
    assert raw["completion_token_ids"] == msgpack.ExtType(EXT_INT32, b"\x04\x00\x00\x00\x05\x00\x00\x00\x02\x00\x00\x00")
    assert raw["logprobs"].code == EXT_FLOAT32  # exactly representable: 4 bytes a value
    assert Rollout.model_validate(unpack_msgpack(data)) == original
    assert len(data) < len(original.model_dump_json())


def test_msgpack_keeps_floats_exact_and_big_ints() -> None:
    values = {"logprobs": [-0.1, -1 / 3], "completion_token_ids": [1, 2**40]}
    raw = msgpack.unpackb(pack_msgpack(values), raw=False)
    assert raw["logprobs"].code == EXT_FLOAT64  # not exact in float32: 8 bytes, no loss
    assert raw["completion_token_ids"].code == EXT_INT64
    assert unpack_msgpack(pack_msgpack(values)) == values
    with pytest.raises(OverflowError):  # msgpack carries 64-bit integers at most (JSON has no limit)
        pack_msgpack({"prompt_token_ids": [2**70]})


def test_msgpack_leaves_odd_values_to_validation() -> None:
    values = {"logprobs": [float("nan"), "x"], "completion_token_ids": [1.5], "prompt_token_ids": []}
    back = unpack_msgpack(pack_msgpack(values))
    assert back["logprobs"][1] == "x" and math.isnan(back["logprobs"][0])
    assert back["completion_token_ids"] == [1.5] and back["prompt_token_ids"] == []


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"\xc1", "not valid msgpack"),
        (msgpack.packb(msgpack.ExtType(EXT_INT32, b"12345")), "whole number"),
        (msgpack.packb(msgpack.ExtType(42, b"")), "unknown msgpack ext type 42"),
        (msgpack.packb({1: 2}), "not valid msgpack"),  # map keys must be strings
    ],
)
def test_bad_msgpack_is_an_encoding_error(data: bytes, message: str) -> None:
    with pytest.raises(EncodingError, match=message):
        unpack_msgpack(data)


def test_the_trainers_msgpack_batch_is_the_generic_encoding() -> None:
    samples = [
        TrainSample(prompt_token_ids=[1, 9], completion_token_ids=[4, 2], logprobs=[-0.1, -2 / 3], advantage=0.5,
                    reward=1.0, policy_version=3, group_id="g1", rollout_id=f"r{i}")
        for i in range(3)
    ]
    batch = TrainBatch(trainer_version=4, samples=samples, staleness_histogram={"1": 3}, rollouts_accepted=9,
                       stale_dropped=1, batch_id="b1")
    fast = train_batch_msgpack(batch, {"g1": pack_ints([1, 9])}, {"g1": 2})
    assert TrainBatch.model_validate(unpack_msgpack(fast)) == batch
    assert unpack_msgpack(fast) == unpack_msgpack(encode_model(batch, MEDIA_MSGPACK))


def test_a_samples_arrays_go_on_as_a_msgpack_body_carried_them() -> None:
    body = pack_msgpack({"completion_token_ids": [4, 2], "logprobs": [-0.5, -0.25]})  # float32: exact
    decoded = unpack_msgpack(body)
    ids, logprobs = pack_sample(decoded["completion_token_ids"], decoded["logprobs"])
    assert (ids, logprobs) == (decoded["completion_token_ids"].ext, decoded["logprobs"].ext)
    assert logprobs.code == EXT_FLOAT32  # as sent, not widened to float64
    ids, logprobs = pack_sample([4, 2], [-0.5, -0.25])  # a JSON body's lists: packed now
    assert (ids.code, logprobs.code) == (EXT_INT32, EXT_FLOAT64)
    assert unpack_msgpack(msgpack.packb([ids, logprobs])) == [[4, 2], [-0.5, -0.25]]


# -- fast paths that must agree with the slow ones ----------------------------------------


def test_fast_decoder_and_encoder_agree_with_the_tokenizer(tokenizer: PreTrainedTokenizerBase) -> None:
    rng = random.Random(0)
    sequences = [[rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 40))] for _ in range(200)]
    assert make_decoder(tokenizer)(sequences) == tokenizer.batch_decode(sequences, skip_special_tokens=True)
    encode = make_encoder(tokenizer)
    for text in ["3141=", "", "=" * 7, "0123456789" * 30 + "=", "12 34"]:
        assert encode(text) == tokenizer(text).input_ids


def byte_level_bpe(decoder: Any = None) -> Any:
    """A GPT-2 style byte-level BPE tokenizer (as Qwen's, Llama 3's) trained here on mixed scripts,
    with special and added tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoder or decoders.ByteLevel()
    text = "héllo wörld, ünïcode ✓ 日本語のテキスト emoji 🎉 and plain ascii 12345 = sorted "
    trainer = trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=["<|endoftext|>"]
    )
    core.train_from_iterator([text * 3] * 50, trainer)
    core.add_tokens(["<think>", "a b"])
    return PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|endoftext|>")


def test_piece_table_decoder_agrees_with_a_byte_level_tokenizer() -> None:
    tokenizer = byte_level_bpe()
    assert piece_table(tokenizer.backend_tokenizer) is not None
    rng = random.Random(2)
    # Random ids split multi-byte characters: both must put the same replacement characters.
    sequences = [[rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 80))] for _ in range(300)]
    sequences.append(tokenizer("héllo 日本 🎉 <think> a b<|endoftext|>").input_ids)
    assert make_decoder(tokenizer)(sequences) == tokenizer.batch_decode(sequences, skip_special_tokens=True)


def test_piece_table_only_where_decode_is_a_join(monkeypatch: pytest.MonkeyPatch) -> None:
    from tokenizers import decoders

    import orchestrator.tokenizer as tokenizer_module

    assert piece_table(byte_level_bpe(decoders.Metaspace()).backend_tokenizer) is None  # strips, replaces
    broken = tokenizer_module._piece_bytes
    monkeypatch.setattr(tokenizer_module, "_piece_bytes", lambda kind, piece, byte_of: broken(kind, piece, byte_of)[:-1])
    tokenizer = byte_level_bpe()
    assert piece_table(tokenizer.backend_tokenizer) is None  # the self-check finds the difference
    ids = tokenizer("héllo wörld").input_ids
    assert make_decoder(tokenizer)([ids]) == ["héllo wörld"]  # and the tokenizer decodes


def test_fast_paths_step_aside_for_tokenizers_that_override_them(tokenizer: PreTrainedTokenizerBase) -> None:
    import copy

    class Custom(type(tokenizer)):  # type: ignore[misc]
        def _decode(self, *args: Any, **kwargs: Any) -> str:
            return "custom"

        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            from transformers import BatchEncoding

            return BatchEncoding({"input_ids": [42]})

    custom = copy.copy(tokenizer)
    custom.__class__ = Custom
    assert make_decoder(custom)([[4, 5]]) == ["custom"]
    assert make_encoder(custom)("12") == [42]


@pytest.mark.parametrize(
    ("logprobs", "valid"),
    [
        ([-0.5, -1.0, 0.0], True),
        ([-1e308, -1e308, -1e308], True),  # the sum overflows: the exact check decides
        ([-0.5, float("nan"), -1.0], False),
        ([float("-inf"), -1.0, -1.0], False),
        ([float("inf"), float("-inf"), -1.0], False),
        ([-0.5, 0.01, -1.0], False),
        ([-0.5, 1e-5, -1.0], True),  # rounding slack
    ],
)
@pytest.mark.parametrize("typed", [False, True])
def test_logprob_check(logprobs: list[float], valid: bool, typed: bool) -> None:
    if typed:  # as a msgpack body carries them: checked over the packed bytes
        logprobs = unpack_msgpack(pack_msgpack({"logprobs": logprobs}))["logprobs"]
        assert type(logprobs) is TypedList
    if valid:
        rollout(logprobs=logprobs)
    else:
        with pytest.raises(ValidationError, match="logprobs must be finite"):
            rollout(logprobs=logprobs)


def test_typed_arrays_skip_element_checks_only_when_their_kind_fits() -> None:
    def typed(code: int, values: list[Any]) -> Any:
        fmt = {EXT_INT32: "<i", EXT_INT64: "<q", EXT_FLOAT32: "<f", EXT_FLOAT64: "<d"}[code]
        data = b"".join(struct.pack(fmt, value) for value in values)
        return unpack_msgpack(msgpack.packb(msgpack.ExtType(code, data)))

    kept = rollout(completion_token_ids=typed(EXT_INT64, [4, 5, 2]), logprobs=typed(EXT_FLOAT32, [-0.5, -1, -2]))
    assert type(kept.completion_token_ids) is TypedList and type(kept.logprobs) is TypedList
    assert kept.completion_token_ids == [4, 5, 2]
    with pytest.raises(ValidationError, match="completion_token_ids.0"):  # floats are not token ids
        rollout(completion_token_ids=typed(EXT_FLOAT32, [4.5, 5, 2]))
    with pytest.raises(ValidationError, match="completion_token_ids\n.*at least 1 item"):
        rollout(completion_token_ids=typed(EXT_INT32, []), logprobs=[])
    ints_as_floats = rollout(logprobs=typed(EXT_INT32, [-1, -2, 0]))  # validated (and converted) element-wise
    assert type(ints_as_floats.logprobs) is list and ints_as_floats.logprobs == [-1.0, -2.0, 0.0]


def test_value_range_of_typed_arrays_matches_min_and_max() -> None:
    rng = random.Random(1)
    ids = [rng.randrange(-5, 2**31 - 1) for _ in range(100)]
    floats = [rng.uniform(-50, 0) for _ in range(100)]
    for values in (ids, floats, [2**40, -3]):
        typed = unpack_msgpack(pack_msgpack({"completion_token_ids" if values is not floats else "logprobs": values}))
        (packed,) = typed.values()
        assert type(packed) is TypedList and value_range(packed) == (min(values), max(values))
    with_nan = unpack_msgpack(pack_msgpack({"logprobs": [-1.0, float("nan"), -2.0]}))["logprobs"]
    assert all(math.isnan(bound) for bound in value_range(with_nan))  # unlike Python's min and max


# -- tokens -------------------------------------------------------------------------------


def test_tokens_file_add_list_revoke(tmp_path: Path) -> None:
    path = str(tmp_path / "sub" / "tokens.json")
    token = add_token(path, name="alice", role="worker")
    add_token(path, name="t", role="trainer")
    assert (tmp_path / "sub" / "tokens.json").stat().st_mode & 0o777 == 0o600
    assert list_tokens(path) == [("alice", "worker"), ("t", "trainer")]
    registry = TokenRegistry.from_file(path)
    assert registry.identify(token) == Identity("alice", "worker")
    assert registry.identify(token + "x") is None and registry.identify("") is None
    with pytest.raises(ValueError, match="already exists"):
        add_token(path, name="alice", role="worker")
    assert revoke_token(path, name="alice") and not revoke_token(path, name="alice")
    assert registry.identify(token) is None  # re-read at once


def test_identify_compares_in_constant_time(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr("orchestrator.auth.hmac.compare_digest", spy)
    registry = TokenRegistry([{"name": "a", "role": "admin", "token": "s3cret-s3cret"}])
    assert registry.identify("s3cret-s3cret") == Identity("a", "admin")
    assert calls and all(len(a) == len(b) == 32 for a, b in calls)  # digests, not the tokens


def test_environment_tokens() -> None:
    assert parse_env_tokens("a:worker:tok-a, b:admin:tok-b") == [
        {"name": "a", "role": "worker", "token": "tok-a"}, {"name": "b", "role": "admin", "token": "tok-b"}
    ]
    assert parse_env_tokens(json.dumps({"tokens": [{"name": "c", "role": "trainer", "token": "x:y"}]}))[0]["token"] == "x:y"
    with pytest.raises(ValueError, match="role must be one of"):
        parse_env_tokens("a:boss:tok")
    with pytest.raises(ValueError, match="needs name, role and token"):
        parse_env_tokens('[{"name": "a"}]')


def test_a_broken_tokens_file_keeps_the_tokens_read_before(tmp_path: Path) -> None:
    path = tmp_path / "tokens.json"
    token = add_token(str(path), name="alice", role="worker")
    registry = TokenRegistry.from_file(str(path))
    path.write_text("{not json")
    assert registry.identify(token) == Identity("alice", "worker")
    path.unlink()  # removing the file revokes its tokens
    assert registry.identify(token) is None


def test_token_cli_edits_the_file(tmp_path: Path) -> None:
    runner = CliRunner()
    path = str(tmp_path / "tokens.json")
    created = runner.invoke(cli, ["token", "create", "--file", path, "--name", "alice", "--role", "worker"])
    assert created.exit_code == 0, created.output
    assert TokenRegistry.from_file(path).identify(created.output.strip()) == Identity("alice", "worker")
    listed = runner.invoke(cli, ["token", "list", "--file", path])
    assert listed.output.strip() == "alice\tworker" and created.output.strip() not in listed.output
    assert runner.invoke(cli, ["token", "create", "--file", path, "--name", "alice"]).exit_code == 2
    assert runner.invoke(cli, ["token", "create", "--file", path, "--name", "x", "--role", "boss"]).exit_code == 2
    assert runner.invoke(cli, ["token", "revoke", "--file", path, "--name", "alice"]).exit_code == 0
    assert runner.invoke(cli, ["token", "revoke", "--file", path, "--name", "alice"]).exit_code == 1
    needs_admin = runner.invoke(cli, ["token", "list", "--orchestrator", "http://127.0.0.1:1"], env={"DECENTRL_ADMIN_TOKEN": ""})
    assert needs_admin.exit_code == 2 and "admin token" in needs_admin.output


# -- rate limiter -------------------------------------------------------------------------


def test_token_bucket() -> None:
    now = [0.0]
    limiter = RateLimiter(2.0, 3, clock=lambda: now[0])
    assert [limiter.check("a") for _ in range(3)] == [0.0, 0.0, 0.0]
    wait = limiter.check("a")
    assert wait == pytest.approx(0.5) and retry_after_header(wait) == "1"
    assert limiter.check("b") == 0.0  # per key
    now[0] += 0.5
    assert limiter.check("a") == 0.0
    now[0] += 100
    assert [limiter.check("a") for _ in range(4)][-1] > 0  # refills to the burst, no further
    assert RateLimiter(0, 1).check("a") == 0.0  # 0 = no limit
