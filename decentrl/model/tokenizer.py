"""A tokenizer from the `tokenizers` library alone, for the orchestrator's start-up.

The orchestrator (orchestrator/app.py, `open_state`) needs of its tokenizer only the
vocabulary size, an encoder for prompts, a decoder for completions, and the special and
end-of-sequence ids; importing transformers for that cost about 1.4 s of every start-up and
restart (docs/benchmarks.md, recovery). `load_text_tokenizer` (decentrl/model/build.py) gives a `RustTokenizer`, which
answers the few PreTrainedTokenizerBase methods the orchestrator calls with exactly what
transformers' tokenizer answers (tests/core/test_tokenizer.py compares them), for the tiny model.

A pretrained model's tokenizer is transformers' AutoTokenizer (decentrl/model/build.py): transformers 5
picks the tokenizer class from the model type and may rebuild the tokenizer from its vocabulary
(Qwen2Tokenizer does), so tokenizer.json read alone is not always what it answers (the test shows
one such difference), and custom code, slow tokenizers and chat templates need it anyway.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerBase


@dataclass(frozen=True)
class Encoded:
    input_ids: list[int]


class RustTokenizer:
    """The calls the orchestrator makes of a tokenizer, answered by a `tokenizers.Tokenizer`."""

    clean_up_tokenization_spaces = False
    chat_template: str | None = None  # the tiny tokenizer has none: its prompts are raw text (decentrl/tasks/prompts.py)

    def __init__(self, backend: Tokenizer, *, special_tokens: Sequence[str], eos_token: str) -> None:
        self.backend_tokenizer = backend
        self.all_special_ids = sorted({backend.token_to_id(token) for token in special_tokens})
        self.eos_token_id = backend.token_to_id(eos_token)

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    def get_vocab(self) -> dict[str, int]:
        return self.backend_tokenizer.get_vocab(with_added_tokens=True)

    def __call__(self, text: str, add_special_tokens: bool = True) -> Encoded:
        return Encoded(self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.backend_tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def batch_decode(self, sequences: Sequence[Sequence[int]], skip_special_tokens: bool = False) -> list[str]:
        return self.backend_tokenizer.decode_batch([list(s) for s in sequences], skip_special_tokens=skip_special_tokens)


@functools.lru_cache(maxsize=8)
def vocab_digest(tokenizer: PreTrainedTokenizerBase | RustTokenizer) -> str:
    """sha256 of a tokenizer's vocabulary (every token and its id, added tokens included, in id
    order): two tokenizers with the same digest turn text into the same ids and back. The
    orchestrator sends its tokenizer's in /v1/info and a distillation teacher (workers/scorers/
    teacher.py) compares its own with it at start-up. Cached: /v1/info is asked often."""
    pairs = sorted(tokenizer.get_vocab().items(), key=lambda pair: (pair[1], pair[0]))
    return hashlib.sha256(json.dumps(pairs, ensure_ascii=False).encode()).hexdigest()
