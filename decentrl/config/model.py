"""`[model]`: the policy every role builds or loads (decentrl/model/build.py reads it).

The trainer builds version 0 from it, the orchestrator and the verifier load its tokenizer and
architecture; workers never read it: they load whatever version the store holds.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from decentrl.config.base import Section, keyed_union


class TinyMoEConfig(Section):
    """Make the tiny model a mixture of experts: a transformers Qwen3-MoE built from config."""

    num_experts: int = Field(8, ge=2, le=65535, description="Experts per sparse layer.")
    top_k: int = Field(2, ge=1, le=64, description="Experts each token is routed to.")
    expert_intermediate_size: int = Field(64, ge=8, description="Width of each expert's MLP.")
    sparse_every: int = Field(
        1, ge=1, description="Layer i is sparse when (i + 1) is a multiple of this (Qwen3-MoE's decoder_sparse_step)."
    )
    dense_layers: tuple[int, ...] = Field(
        (), description="Layer indices kept dense whatever sparse_every says (mlp_only_layers)."
    )
    normalize_top_k: bool = Field(True, description="Renormalize the top-k gate weights to sum to 1 (norm_topk_prob).")

    @model_validator(mode="after")
    def _top_k_fits(self) -> TinyMoEConfig:
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k ({self.top_k}) must be at most num_experts ({self.num_experts})")
        return self


KEEP_ROUTING = (
    "Record each token's experts at inference and replay them in training and verification "
    "(docs/routing.md). None: on for mixture-of-experts models, off for dense ones."
)


class TinyModelConfig(Section):
    """A small Qwen2-style model built from a config, with a tokenizer made locally (no hub);
    a Qwen3-MoE one with a `[model.moe]` table."""

    type: Literal["tiny"] = "tiny"
    hidden_size: int = Field(128, ge=16, le=4096, description="Width of the residual stream.")
    num_layers: int = Field(2, ge=1, le=64, description="Number of transformer blocks.")
    num_heads: int = Field(4, ge=1, le=64, description="Attention heads; must divide hidden_size.")
    intermediate_size: int = Field(256, ge=16, description="Width of the MLP.")
    seed: int = Field(0, ge=0, description="Seed of the random initial weights (version 0).")
    moe: TinyMoEConfig | None = Field(None, description="Experts, top-k and sparse layers; None: a dense model.")
    keep_routing: bool | None = Field(None, description=KEEP_ROUTING)

    @model_validator(mode="after")
    def _heads_divide(self) -> TinyModelConfig:
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be a multiple of num_heads ({self.num_heads})"
            )
        if self.moe is not None and any(not 0 <= i < self.num_layers for i in self.moe.dense_layers):
            raise ValueError(f"moe.dense_layers must be layer indices in [0, {self.num_layers})")
        if self.keep_routing and self.moe is None:
            raise ValueError("keep_routing = true needs a mixture-of-experts model: add a [model.moe] table or drop it")
        return self


class PretrainedModelConfig(Section):
    """A Hugging Face causal LM directory (config.json, safetensors, tokenizer) on local disk."""

    type: Literal["pretrained"] = "pretrained"
    path: str = Field(description="Local directory of an HF causal LM with its tokenizer.")
    keep_routing: bool | None = Field(None, description=KEEP_ROUTING)


ModelConfig = keyed_union(TinyModelConfig, PretrainedModelConfig)
