"""Build the initial policy (version 0): a tiny model from config or a pretrained directory.

Called by the trainer (to create version 0 and its own FSDP model), by the orchestrator
(for the tokenizer, to encode prompts and decode completions for rewards, and for the
end-of-sequence ids its checks of how generations ended accept) and by its verifier (models of
the run's architecture to copy versions into).
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING

from decentrl.config import PretrainedModelConfig, StoreConfig, TinyModelConfig
from decentrl.model.stopping import eos_id_set
from decentrl.model.tokenizer import RustTokenizer

if TYPE_CHECKING:
    import torch
    from tokenizers import Tokenizer
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

TINY_SPECIALS = ["<pad>", "<s>", "</s>"]
MAKE_MODEL_DIR = (
    "make one with `decentrl model init CONFIG --out DIR` (a tiny chat model for the config's task) or "
    "`decentrl model import SRC --out DIR` (from an HF model directory or a GGUF file), then set model.path = DIR"
)
TINY_EOS = "</s>"
TINY_SYMBOLS = ["="] + [str(d) for d in range(10)]


def tiny_tokenizer_core() -> Tokenizer:
    """The tiny tokenizer as a `tokenizers.Tokenizer`: character-level over digits and '='."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    vocab = {token: i for i, token in enumerate(TINY_SPECIALS + TINY_SYMBOLS)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    core.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", vocab["<s>"])]
    )
    core.decoder = decoders.Fuse()
    return core


def build_tiny_tokenizer() -> PreTrainedTokenizerBase:
    """A character-level tokenizer over digits and '=', made locally with `tokenizers` (the
    orchestrator uses `tiny_tokenizer_core` directly: decentrl/model/tokenizer.py)."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=tiny_tokenizer_core(), pad_token="<pad>", bos_token="<s>", eos_token=TINY_EOS, unk_token="<pad>"
    )


class ModelPathError(ValueError):
    """model.path is not a model directory on this machine; the message says how to make one."""


def pretrained_dir(config: PretrainedModelConfig) -> str:
    """model.path, checked to be a model directory before transformers reads it: transformers takes
    any other path for a model hub id and fails far from the cause. Checked where the roles first
    load the model (`load_tokenizer`, `build_model`), not when the config is read: a config is
    written on one machine and used on another."""
    if not os.path.isfile(os.path.join(config.path, "config.json")):
        what = "is not a model directory (no config.json in it)" if os.path.isdir(config.path) else "does not exist"
        raise ModelPathError(f"model.path = {config.path!r} {what}: {MAKE_MODEL_DIR}")
    return config.path


def load_tokenizer(config: TinyModelConfig | PretrainedModelConfig) -> PreTrainedTokenizerBase:
    if isinstance(config, TinyModelConfig):
        return build_tiny_tokenizer()
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(pretrained_dir(config))


def load_text_tokenizer(config: TinyModelConfig | PretrainedModelConfig) -> RustTokenizer | PreTrainedTokenizerBase:
    """The run's tokenizer for the orchestrator: without transformers for the tiny model,
    transformers' AutoTokenizer for a pretrained one (module docstring)."""
    from tokenizers import AddedToken

    if isinstance(config, TinyModelConfig):
        core = tiny_tokenizer_core()
        # As PreTrainedTokenizerFast does with its pad/bos/eos/unk: special added tokens, so
        # "</s>" in a text is one token and a decode can skip them.
        core.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in TINY_SPECIALS])
        return RustTokenizer(core, special_tokens=TINY_SPECIALS, eos_token=TINY_EOS)
    return load_tokenizer(config)


def end_of_sequence_ids(
    config: TinyModelConfig | PretrainedModelConfig, tokenizer: PreTrainedTokenizerBase | RustTokenizer
) -> set[int]:
    """The ids a worker's generation stops at: the tokenizer's end-of-sequence and the model's
    generation config's (transformers and vLLM stop at those; a chat model often lists several,
    e.g. end-of-turn and end-of-text). The tiny model's generation config is the tokenizer's."""
    if isinstance(tokenizer, RustTokenizer):  # the tiny model's (decentrl/model/tokenizer.py)
        return {tokenizer.eos_token_id}
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    if isinstance(config, PretrainedModelConfig):
        ids |= generation_eos_ids(config.path)
    return ids


def generation_eos_ids(path: str) -> set[int]:
    """The end-of-sequence ids of the generation config of the model at `path`."""
    from transformers import AutoConfig, GenerationConfig

    try:
        generation = GenerationConfig.from_pretrained(path)
    except OSError:  # no generation_config.json: transformers derives one from config.json, as here
        generation = GenerationConfig.from_model_config(AutoConfig.from_pretrained(path))
    return eos_id_set(generation.eos_token_id)


_PUBLISH_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def publish_dtype(store: StoreConfig, config: TinyModelConfig | PretrainedModelConfig) -> torch.dtype:
    """The dtype versions are published in (`publish_dtype_name`)."""
    import torch

    return getattr(torch, publish_dtype_name(store, config))


def publish_dtype_name(store: StoreConfig, config: TinyModelConfig | PretrainedModelConfig) -> str:
    """"float32", "bfloat16" or "float16": store.publish_dtype, else the model's own config dtype
    (a pretrained model's config.json, read without transformers; float32 for the tiny model,
    built in float32)."""
    if store.publish_dtype is not None:
        return _PUBLISH_DTYPES[store.publish_dtype]
    if isinstance(config, PretrainedModelConfig):
        with open(os.path.join(config.path, "config.json")) as file:
            declared = json.load(file)
        dtype = declared.get("dtype") or declared.get("torch_dtype")
        if dtype in _PUBLISH_DTYPES.values():
            return dtype
    return "float32"


def build_model(config: TinyModelConfig | PretrainedModelConfig) -> PreTrainedModel:
    """The version-0 weights, in float32 on CPU."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from decentrl.store.weights import load_pretrained

    if isinstance(config, PretrainedModelConfig):
        return load_pretrained(pretrained_dir(config))
    tokenizer = build_tiny_tokenizer()
    if config.moe is not None:
        torch.manual_seed(config.seed)
        return build_tiny_moe(config, tokenizer).float()
    model_config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_heads,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(config.seed)
    return Qwen2ForCausalLM(model_config).float()


def build_tiny_moe(config: TinyModelConfig, tokenizer: PreTrainedTokenizerBase) -> PreTrainedModel:
    """A Qwen3-MoE (transformers) built from `[model]` and `[model.moe]`; seeded by the caller."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    assert config.moe is not None
    moe = config.moe
    model_config = Qwen3MoeConfig(
        vocab_size=len(tokenizer),
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,  # the dense layers' MLP
        moe_intermediate_size=moe.expert_intermediate_size,
        num_experts=moe.num_experts,
        num_experts_per_tok=moe.top_k,
        decoder_sparse_step=moe.sparse_every,
        mlp_only_layers=list(moe.dense_layers),
        norm_topk_prob=moe.normalize_top_k,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_heads,
        head_dim=config.hidden_size // config.num_heads,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return Qwen3MoeForCausalLM(model_config)
