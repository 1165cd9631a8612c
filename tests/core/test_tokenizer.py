"""decentrl/model/tokenizer.py: the orchestrator's tokenizer without transformers answers what
transformers' tokenizer over the same files answers, and falls back to it where it would not."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tokenizers import Tokenizer

from decentrl.config import PretrainedModelConfig, TinyModelConfig
from decentrl.model.build import build_tiny_tokenizer, end_of_sequence_ids, load_text_tokenizer
from decentrl.model.tokenizer import RustTokenizer
from orchestrator.tokenizer import make_decoder, make_encoder

TEXTS = ["", "1234", "12=34", "9" * 50, "x1", "</s>12", "<s><pad>3"]
SEQUENCES = [[], [1], [4, 5, 6, 2], [0, 1, 2, 3, 4], list(range(14)) * 3, [13, 2, 2, 1]]


def assert_same(ours: RustTokenizer, theirs: object) -> None:
    assert len(ours) == len(theirs)
    assert ours.eos_token_id == theirs.eos_token_id
    assert ours.all_special_ids == sorted(theirs.all_special_ids)
    for text in TEXTS:
        for special in (True, False):
            assert ours(text, add_special_tokens=special).input_ids == theirs(text, add_special_tokens=special).input_ids
        assert make_encoder(ours)(text) == make_encoder(theirs)(text)
    for ids in SEQUENCES:
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)
    assert ours.batch_decode(SEQUENCES, skip_special_tokens=True) == theirs.batch_decode(SEQUENCES, skip_special_tokens=True)
    assert make_decoder(ours)(SEQUENCES) == make_decoder(theirs)(SEQUENCES)


def test_tiny_tokenizer_answers_as_transformers_does() -> None:
    ours = load_text_tokenizer(TinyModelConfig())
    assert isinstance(ours, RustTokenizer)
    assert_same(ours, build_tiny_tokenizer())
    assert end_of_sequence_ids(TinyModelConfig(), ours) == end_of_sequence_ids(TinyModelConfig(), build_tiny_tokenizer())


def test_a_pretrained_tokenizer_is_transformers_own(tmp_path: Path) -> None:
    """transformers 5 picks the tokenizer by model type and may rebuild it: the tiny tokenizer's
    files under a qwen2 config encode an unknown character differently than tokenizer.json alone
    would, which is why a pretrained model's tokenizer stays transformers'."""
    tokenizer = build_tiny_tokenizer()
    tokenizer.save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2", "eos_token_id": 2}))
    loaded = load_text_tokenizer(PretrainedModelConfig(path=str(tmp_path)))
    assert not isinstance(loaded, RustTokenizer)
    assert loaded("x1").input_ids != Tokenizer.from_file(str(tmp_path / "tokenizer.json")).encode("x1").ids


def test_the_orchestrator_starts_without_importing_transformers_or_torch() -> None:
    code = (
        "import sys\n"
        "from decentrl.config import TinyModelConfig\n"
        "import orchestrator.app\n"
        "from decentrl.model.build import load_text_tokenizer\n"
        "load_text_tokenizer(TinyModelConfig())\n"
        "print(sorted(m for m in ('transformers', 'torch', 'numpy') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
