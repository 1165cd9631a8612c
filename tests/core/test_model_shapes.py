"""decentrl/model/chat_model.py's real model shapes (SmolLM2-135M, Qwen3-0.6B with random weights) and the
tied weights they bring to decentrl/store/weights.py: a shaped directory at a reduced size (2 layers,
hidden 64, vocabulary 512) has the shape's architecture, a tokenizer padded to the vocabulary
without changing its encoding, bf16 weights with lm_head saved once, and loads, directly and as a
pulled version, with lm_head still tied; the full shapes count the real models' parameters."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer
from typer.testing import CliRunner

from decentrl.cli.main import app
from decentrl.model.chat_model import END_OF_TEXT, IM_END, shape_config, train_chat_tokenizer, write_shaped_model
from decentrl.store.checkpoints import CheckpointStore
from decentrl.store.weights import WEIGHTS_NAME, CheckpointError, copy_into, load_pretrained

ROOT = Path(__file__).parents[2]
REDUCED = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)
VOCAB = 512
OVERRIDES: dict[str, dict[str, object]] = {
    "smollm2-135m": {**REDUCED, "vocab_size": VOCAB},  # Llama derives head_dim
    "qwen3-0.6b": {**REDUCED, "vocab_size": VOCAB, "head_dim": 16},
}
ARCHITECTURES = {"smollm2-135m": "LlamaForCausalLM", "qwen3-0.6b": "Qwen3ForCausalLM"}
# Parameters of the full shapes, tied embeddings counted once: SmolLM2-135M's, and Qwen3-0.6B's
# published 596,049,920 (its model card's 0.6B).
PARAMETERS = {"smollm2-135m": 134_515_008, "qwen3-0.6b": 596_049_920}
KNOWN = "smollm2-135m, qwen3-0.6b"
# Countdown-like prompts: words that merge, digits that never do.
TEXTS = [
    f"Using the numbers {a}, {b} and {c}, create an equation that equals {a + b * c}."
    for a in (3, 17, 42) for b in (5, 8, 61, 90) for c in (2, 7, 13, 25, 44)
]
Q_PROJ = "model.layers.0.self_attn.q_proj.weight"


@pytest.fixture(scope="module", params=sorted(OVERRIDES))
def shaped(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    """(shape, directory) of each shape at the reduced size, written once for the module."""
    shape = request.param
    return shape, write_shaped_model(TEXTS, str(tmp_path_factory.mktemp(shape)), shape, **OVERRIDES[shape])


def test_shaped_tokenizer_is_padded_to_the_vocabulary_and_encodes_as_before(shaped: tuple[str, Path]) -> None:
    _, directory = shaped
    tokenizer = AutoTokenizer.from_pretrained(directory)
    learned = train_chat_tokenizer(TEXTS, 320)
    assert len(learned) < VOCAB == len(tokenizer)
    chat = learned.apply_chat_template([{"role": "user", "content": TEXTS[0]}], tokenize=False, add_generation_prompt=True)
    for text in (TEXTS[0], TEXTS[-1], chat, "<|reserved_300|>"):
        assert tokenizer(text).input_ids == learned(text).input_ids
    assert len(learned(TEXTS[0]).input_ids) < len(TEXTS[0])  # merges happened: the comparison means something
    assert tokenizer.decode([len(learned)]) == f"<|reserved_{len(learned)}|>"
    assert tokenizer.decode([VOCAB - 1]) == f"<|reserved_{VOCAB - 1}|>"
    assert tokenizer.convert_tokens_to_ids([IM_END, END_OF_TEXT]) == learned.convert_tokens_to_ids([IM_END, END_OF_TEXT])


def test_shaped_config_and_weights(shaped: tuple[str, Path]) -> None:
    shape, directory = shaped
    tokenizer = AutoTokenizer.from_pretrained(directory)
    config = json.loads((directory / "config.json").read_text())
    assert config["architectures"] == [ARCHITECTURES[shape]]
    assert config["tie_word_embeddings"] is True
    assert (config["vocab_size"], config["num_hidden_layers"], config["hidden_size"]) == (VOCAB, 2, 64)
    assert config["eos_token_id"] == tokenizer.convert_tokens_to_ids(IM_END)
    assert config["pad_token_id"] == tokenizer.convert_tokens_to_ids(END_OF_TEXT)
    assert config["dtype"] == "bfloat16"
    generation = json.loads((directory / "generation_config.json").read_text())
    assert generation["eos_token_id"] == tokenizer.convert_tokens_to_ids([IM_END, END_OF_TEXT])

    weights = load_file(directory / WEIGHTS_NAME)
    assert {t.dtype for t in weights.values()} == {torch.bfloat16}
    # The tied output projection is saved once, as the input embedding.
    assert "lm_head.weight" not in weights
    assert tuple(weights["model.embed_tokens.weight"].shape) == (VOCAB, 64)


def test_unknown_shape_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=f"unknown model shape 'nope': choose one of {KNOWN}"):
        shape_config("nope")
    with pytest.raises(ValueError, match=f"unknown model shape 'nope': choose one of {KNOWN}"):
        write_shaped_model(TEXTS, str(tmp_path / "model"), "nope")
    assert not (tmp_path / "model").exists()


def test_tokenizer_larger_than_the_vocabulary_is_refused(tmp_path: Path) -> None:
    # 256 bytes and 3 specials before any merge: 258 ids cannot hold it.
    overrides = {**OVERRIDES["smollm2-135m"], "vocab_size": 258}
    with pytest.raises(ValueError, match=r"the tokenizer has \d+ ids, more than the shape's vocabulary of 258"):
        write_shaped_model(TEXTS, str(tmp_path / "model"), "smollm2-135m", **overrides)


def test_model_vocabulary_and_tokenizer_vocabulary_are_separate(tmp_path: Path) -> None:
    """`vocab_size` sizes the model (and the padded tokenizer), `tokenizer_vocab` the learned BPE."""
    directory = write_shaped_model(TEXTS, str(tmp_path), "smollm2-135m", tokenizer_vocab=270, **OVERRIDES["smollm2-135m"])
    assert json.loads((directory / "config.json").read_text())["vocab_size"] == VOCAB
    assert len(AutoTokenizer.from_pretrained(directory)) == VOCAB
    assert AutoTokenizer.from_pretrained(directory).decode([270]) == "<|reserved_270|>"


@pytest.mark.parametrize("shape", sorted(PARAMETERS))
def test_full_shapes_have_the_real_models_parameter_counts(shape: str) -> None:
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(shape_config(shape))
    assert type(model).__name__ == ARCHITECTURES[shape]
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert sum(p.numel() for p in model.parameters()) == PARAMETERS[shape]


# -- tied weights through decentrl/store/weights.py -------------------------------------------------


def test_tied_model_loads_from_its_directory(shaped: tuple[str, Path]) -> None:
    _, directory = shaped
    saved = load_file(directory / WEIGHTS_NAME)
    model = load_pretrained(str(directory))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    state = model.state_dict()
    for name, tensor in saved.items():
        torch.testing.assert_close(state[name], tensor.float(), rtol=0, atol=0)


def test_pulled_tied_version_loads_as_published(shaped: tuple[str, Path], tmp_path: Path) -> None:
    _, directory = shaped
    store = CheckpointStore(f"file://{tmp_path}/store")  # as benchmarks/gpu_check.py pulled_model
    store.publish(0, str(directory))
    pulled = store.pull(0, str(tmp_path / "cache"))
    model = load_pretrained(pulled, as_published=True)
    saved = load_file(directory / WEIGHTS_NAME)
    state = model.state_dict()
    assert {t.dtype for t in state.values() if t.is_floating_point()} == {torch.bfloat16}
    assert state.keys() == saved.keys() | {"lm_head.weight"}
    for name, tensor in saved.items():
        torch.testing.assert_close(state[name], tensor, rtol=0, atol=0)
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_copy_into_a_tied_model_still_requires_every_untied_tensor(shaped: tuple[str, Path]) -> None:
    _, directory = shaped
    model = load_pretrained(str(directory))
    before = {name: t.clone() for name, t in model.state_dict().items()}
    torch.manual_seed(1)
    new = {name: torch.randn_like(t) for name, t in load_file(directory / WEIGHTS_NAME).items()}
    new = {name: t.float() for name, t in new.items()}

    without_q = {name: t for name, t in new.items() if name != Q_PROJ}
    with pytest.raises(CheckpointError, match=f"missing {Q_PROJ}"):
        copy_into(model, without_q)
    for name, tensor in model.state_dict().items():  # all or nothing: nothing copied
        torch.testing.assert_close(tensor, before[name], rtol=0, atol=0)

    # A state that also names the tied lm_head (one that was not saved by save_pretrained) loads.
    copy_into(model, {**new, "lm_head.weight": new["model.embed_tokens.weight"]})
    for name, tensor in new.items():
        torch.testing.assert_close(model.state_dict()[name], tensor, rtol=0, atol=0)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    torch.testing.assert_close(model.lm_head.weight, new["model.embed_tokens.weight"], rtol=0, atol=0)


# -- the CLI ----------------------------------------------------------------------------------


def test_model_init_refuses_an_unknown_shape(tmp_path: Path) -> None:
    result = CliRunner().invoke(
        app, ["model", "init", str(ROOT / "configs" / "gpu1.toml"), "--out", str(tmp_path / "model"), "--shape", "nope"]
    )
    assert result.exit_code == 2
    assert f"--shape 'nope' is not a known shape: choose one of {KNOWN}" in result.output
    assert not (tmp_path / "model").exists()
