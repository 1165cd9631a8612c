"""The orchestrator's tokenizer fast paths: prompts encoded for leases, completions decoded for scoring.

Both give exactly what the Hugging Face tokenizer methods give; they only skip layers of Python
where that cannot change the result. Where a tokenizer's decode only concatenates per-token pieces
(`decoders.Fuse`, `decoders.ByteLevel`), the decoder joins a per-token table, used only if it
reproduces the tokenizer's own decode on every token and on random sequences (`piece_table`).
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from decentrl.model.tokenizer import RustTokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger("decentrl.orchestrator.tokenizer")

Encoder = Callable[[str], list[int]]
Decoder = Callable[[list[list[int]]], list[str]]


def _plain_fast_tokenizer(tokenizer: PreTrainedTokenizerBase | RustTokenizer, *methods: str) -> Any:
    """The Rust tokenizer behind `tokenizer` if calling it directly gives what the HF methods
    would (the methods are not overridden by a subclass), else None."""
    if isinstance(tokenizer, RustTokenizer):
        return tokenizer.backend_tokenizer
    backend = getattr(tokenizer, "backend_tokenizer", None)
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase as Base
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # an older transformers without the backend class: use the HF methods
        return None
    for name in methods:
        defined = getattr(TokenizersBackend, name, None) or getattr(Base, name, None)
        if defined is None or getattr(type(tokenizer), name, None) is not defined:
            return None
    return backend


def make_decoder(tokenizer: PreTrainedTokenizerBase | RustTokenizer) -> Decoder:
    """`tokenizer.batch_decode(ids, skip_special_tokens=True)`, from the Rust tokenizer directly
    or a per-token table (`piece_table`) where either gives the same text."""
    backend = _plain_fast_tokenizer(tokenizer, "_decode", "decode", "batch_decode")
    if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        table = piece_table(backend)
        if table is not None:
            return table_decoder(table)
        return lambda sequences: backend.decode_batch(sequences, skip_special_tokens=True)
    return lambda sequences: tokenizer.batch_decode(sequences, skip_special_tokens=True)


def make_encoder(tokenizer: PreTrainedTokenizerBase | RustTokenizer) -> Encoder:
    """`tokenizer(text).input_ids`, calling the Rust tokenizer directly when that gives the same ids
    (a plain fast tokenizer with no truncation or padding of its own)."""
    backend = _plain_fast_tokenizer(tokenizer, "__call__", "_encode_plus")
    if backend is not None and backend.truncation is None and backend.padding is None:
        return lambda text: backend.encode(text).ids
    return lambda text: tokenizer(text).input_ids


# -- the per-token join behind the decoder ------------------------------------------------

SELF_CHECK_SEQUENCES = 512  # random sequences (1-64 tokens) compared with the tokenizer at startup


def _byte_level_chars() -> dict[str, int]:
    """GPT-2's reversible byte -> printable character map, inverted (character -> byte): a printable
    byte stands for itself, each other byte for 256, 257, ... in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [byte for byte in range(256) if byte not in printable]
    return {chr(byte): byte for byte in printable} | {chr(256 + i): byte for i, byte in enumerate(others)}


def _piece_bytes(decoder_kind: str, piece: str, byte_of: dict[str, int]) -> bytes:
    if decoder_kind == "fuse":
        return piece.encode()
    try:
        return bytes(byte_of[char] for char in piece)
    except KeyError:  # not a byte-level piece (an added token): its text as it is
        return piece.encode()


def piece_table(backend: Any) -> list[bytes] | None:
    """Per token id, the bytes it contributes to `backend.decode(ids, skip_special_tokens=True)`,
    or None if that decode is not such a concatenation (or the self-check finds a difference)."""
    from tokenizers import decoders

    decoder = backend.decoder
    if isinstance(decoder, decoders.Fuse):
        kind = "fuse"
    elif isinstance(decoder, decoders.ByteLevel):
        kind = "byte_level"
    else:
        return None
    byte_of = _byte_level_chars()
    size = backend.get_vocab_size(with_added_tokens=True)
    singles = backend.decode_batch([[i] for i in range(size)], skip_special_tokens=True)
    table = []
    for token_id, text in enumerate(singles):
        piece = backend.id_to_token(token_id)
        # Skipped (special) tokens decode to nothing on their own, and so in any sequence.
        table.append(b"" if piece is None or text == "" else _piece_bytes(kind, piece, byte_of))
    rng = random.Random(0)
    sequences = [[i] for i in range(size)]
    sequences += [[rng.randrange(size) for _ in range(rng.randrange(1, 65))] for _ in range(SELF_CHECK_SEQUENCES)]
    expected = singles + backend.decode_batch(sequences[size:], skip_special_tokens=True)
    for ids, joined, text in zip(sequences, table_decoder(table)(sequences), expected, strict=True):
        if joined != text:
            log.info("tokenizer decode is not a plain join of its tokens (ids %s); scoring uses the tokenizer", ids[:8])
            return None
    return table


def table_decoder(table: list[bytes]) -> Decoder:
    """Batch decode through `table` (ids must be in range: ingest rejects the others first)."""
    return lambda sequences: [b"".join(map(table.__getitem__, ids)).decode("utf-8", "replace") for ids in sequences]
