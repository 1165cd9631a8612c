"""The orchestrator's tokenizer fast paths: prompts encoded for leases, completions decoded for scoring.

RunState (orchestrator/state.py) builds one encoder and one decoder at startup: the lease book
encodes each prompt it leases (orchestrator/leases.py), the scorer decodes every accepted
completion (orchestrator/scoring.py) and integrity decodes stop strings (orchestrator/integrity.py).
Both give exactly what the Hugging Face tokenizer methods give; they only skip layers of Python
where that cannot change the result. The per-token join behind the decoder is in
orchestrator/detokenize.py.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from decentrl.model.tokenizer import RustTokenizer
from orchestrator.detokenize import piece_table, table_decoder

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

Encoder = Callable[[str], list[int]]
Decoder = Callable[[list[list[int]]], list[str]]


def _plain_fast_tokenizer(tokenizer: PreTrainedTokenizerBase | RustTokenizer, *methods: str) -> Any:
    """The Rust tokenizer behind `tokenizer` if calling it directly gives what the HF methods
    would (the methods are not overridden by a subclass), else None."""
    if isinstance(tokenizer, RustTokenizer):  # decentrl/model/tokenizer.py: the Rust tokenizer itself
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
    """`tokenizer.batch_decode(ids, skip_special_tokens=True)`, calling the Rust tokenizer directly
    when that gives the same text (a plain fast tokenizer without clean-up): half the cost; and
    where its decode is a join of per-token pieces, joining them (orchestrator/detokenize.py): a
    quarter of that again."""
    backend = _plain_fast_tokenizer(tokenizer, "_decode", "decode", "batch_decode")
    if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        table = piece_table(backend)
        if table is not None:
            return table_decoder(table)
        return lambda sequences: backend.decode_batch(sequences, skip_special_tokens=True)
    return lambda sequences: tokenizer.batch_decode(sequences, skip_special_tokens=True)


def make_encoder(tokenizer: PreTrainedTokenizerBase | RustTokenizer) -> Encoder:
    """`tokenizer(text).input_ids`, calling the Rust tokenizer directly when that gives the same ids
    (a plain fast tokenizer with no truncation or padding of its own): half the cost."""
    backend = _plain_fast_tokenizer(tokenizer, "__call__", "_encode_plus")
    if backend is not None and backend.truncation is None and backend.padding is None:
        return lambda text: backend.encode(text).ids
    return lambda text: tokenizer(text).input_ids
