"""A tiny chat model directory made locally: a byte-level BPE tokenizer trained with `tokenizers`
on a task's text, a ChatML chat template, and a small Qwen2 model from a config, saved in HF format.

It is an honest stand-in for an instruct model (Qwen2.5-style special tokens and template, an
end-of-turn token its generation config stops at), loaded with `[model] type = "pretrained"`.
Called by `decentrl model init` (decentrl/cli/model.py) and by tests; no hub, no download.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerFast

END_OF_TEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
# ChatML as Qwen2.5/Qwen3 write it; `enable_thinking = false` (prompt.template_options) pre-fills an
# empty thought, as Qwen3's template does.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)


@dataclass(frozen=True)
class ChatModelSpec:
    """Sizes of the tokenizer and the model (hidden 128, 2 layers: about 0.4M parameters at vocab 320)."""

    vocab_size: int = 320
    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    intermediate_size: int = 256
    max_positions: int = 512
    seed: int = 0


def train_chat_tokenizer(texts: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE (every byte is a token, so any text encodes) trained on `texts`; digits never merge."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = [END_OF_TEXT, IM_START, IM_END]
    core = Tokenizer(models.BPE())
    # Every digit its own token, as Qwen2.5's and Llama 3's tokenizers split numbers: no merged
    # token holds a digit, so numbers read digit by digit and a one-token answer is one digit.
    core.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token=IM_END, pad_token=END_OF_TEXT, chat_template=CHAT_TEMPLATE,
        additional_special_tokens=[IM_START],
    )


def write_chat_model(texts: list[str], out: str, spec: ChatModelSpec) -> Path:
    """Train the tokenizer on `texts`, build the model, save both to `out`; returns the directory."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    if len(set(texts)) < 2:
        raise ValueError("a tokenizer needs text to learn from: the task gave fewer than 2 distinct texts")
    tokenizer = train_chat_tokenizer(texts, spec.vocab_size)
    end_of_turn, end_of_text = tokenizer.convert_tokens_to_ids([IM_END, END_OF_TEXT])
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers, num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_heads,
        max_position_embeddings=spec.max_positions, tie_word_embeddings=False,
        eos_token_id=end_of_turn, pad_token_id=end_of_text, bos_token_id=None,
    )
    torch.manual_seed(spec.seed)
    return save_chat_model(Qwen2ForCausalLM(config).float(), tokenizer, out)


def save_chat_model(model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast, out: str) -> Path:
    """`model` and `tokenizer` saved to `out`, generation stopping at the end of a turn or a text."""
    from transformers import GenerationConfig

    end_of_turn, end_of_text = tokenizer.convert_tokens_to_ids([IM_END, END_OF_TEXT])
    # A chat model ends its turn with <|im_end|>; <|endoftext|> ends a document. Both stop generation.
    model.generation_config = GenerationConfig(eos_token_id=[end_of_turn, end_of_text], pad_token_id=end_of_text)
    directory = Path(out)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def task_texts(task_prompts: list[str], answers: list[str]) -> list[str]:
    """The text a task's tokenizer learns from: its prompts and, where it has them, its answers."""
    return task_prompts + answers


# Real model shapes built from their published configs with random weights (no download): the GPU
# configs and benchmarks/gpu_check.py measure at the sizes users train, whatever weights are at hand.
# Values from each model's config.json (HuggingFaceTB/SmolLM2-135M-Instruct, Qwen/Qwen3-0.6B).
SHAPES: dict[str, dict[str, object]] = {
    "smollm2-135m": dict(
        model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192, rope_theta=100000.0,
        rms_norm_eps=1e-5, tie_word_embeddings=True,
    ),
    "qwen3-0.6b": dict(
        model_type="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
        rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
    ),
}


def shape_config(shape: str, **overrides: object) -> PretrainedConfig:
    """The transformers config of a named shape (SHAPES), with `overrides` (e.g. fewer layers for a
    CPU check, or the tokenizer's special ids)."""
    from transformers import AutoConfig

    if shape not in SHAPES:
        raise ValueError(f"unknown model shape {shape!r}: choose one of {', '.join(SHAPES)}")
    values = {**SHAPES[shape], **overrides}
    return AutoConfig.for_model(str(values.pop("model_type")), **values)


def pad_vocabulary(tokenizer: PreTrainedTokenizerFast, size: int) -> PreTrainedTokenizerFast:
    """`tokenizer` with unused ids up to `size` (a model's embedding rows beyond its tokenizer, as
    Qwen's reserved ids are): plain vocabulary entries `<|reserved_N|>` that no merge produces, so
    encoding is unchanged and every id the model can sample decodes. The orchestrator counts them."""
    import json

    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    have = len(tokenizer)
    if have > size:
        raise ValueError(f"the tokenizer has {have} ids, more than the shape's vocabulary of {size}")
    state = json.loads(tokenizer.backend_tokenizer.to_str())
    vocab = state["model"]["vocab"]
    vocab.update({f"<|reserved_{i}|>": i for i in range(have, size)})
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(json.dumps(state)), eos_token=tokenizer.eos_token,
        pad_token=tokenizer.pad_token, chat_template=tokenizer.chat_template,
        additional_special_tokens=[IM_START],
    )


def write_shaped_model(
    texts: list[str], out: str, shape: str, *, seed: int = 0, tokenizer_vocab: int = 320, **overrides: object
) -> Path:
    """A model of a real shape (SHAPES) with random weights, saved in bf16 with a tokenizer of
    `tokenizer_vocab` BPE ids trained on `texts` and padded to the model's vocabulary (the shape's,
    or `overrides["vocab_size"]`); loaded like write_chat_model's directory."""
    import torch
    from transformers import AutoModelForCausalLM

    if shape not in SHAPES:
        raise ValueError(f"unknown model shape {shape!r}: choose one of {', '.join(SHAPES)}")
    if len(set(texts)) < 2:
        raise ValueError("a tokenizer needs text to learn from: the task gave fewer than 2 distinct texts")
    size = int(overrides.pop("vocab_size", SHAPES[shape]["vocab_size"]))  # type: ignore[arg-type]
    tokenizer = pad_vocabulary(train_chat_tokenizer(texts, tokenizer_vocab), size)
    end_of_turn, end_of_text = tokenizer.convert_tokens_to_ids([IM_END, END_OF_TEXT])
    config = shape_config(shape, **overrides, vocab_size=size, eos_token_id=end_of_turn, pad_token_id=end_of_text, bos_token_id=None)
    torch.manual_seed(seed)
    return save_chat_model(AutoModelForCausalLM.from_config(config, dtype=torch.float32).to(torch.bfloat16), tokenizer, out)
