"""`[model]`: the policy every role builds or loads (decentrl/model.py reads it).

The trainer builds version 0 from it, the orchestrator and the verifier load its tokenizer and
architecture; workers never read it: they load whatever version the store holds.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from decentrl.config.base import Section, keyed_union


class TinyModelConfig(Section):
    """A small Qwen2-style model built from a config, with a tokenizer made locally (no hub)."""

    type: Literal["tiny"] = "tiny"
    hidden_size: int = Field(128, ge=16, le=4096, description="Width of the residual stream.")
    num_layers: int = Field(2, ge=1, le=64, description="Number of transformer blocks.")
    num_heads: int = Field(4, ge=1, le=64, description="Attention heads; must divide hidden_size.")
    intermediate_size: int = Field(256, ge=16, description="Width of the MLP.")
    seed: int = Field(0, ge=0, description="Seed of the random initial weights (version 0).")

    @model_validator(mode="after")
    def _heads_divide(self) -> TinyModelConfig:
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be a multiple of num_heads ({self.num_heads})"
            )
        return self


class PretrainedModelConfig(Section):
    """A Hugging Face causal LM directory (config.json, safetensors, tokenizer) on local disk."""

    type: Literal["pretrained"] = "pretrained"
    path: str = Field(description="Local directory of an HF causal LM with its tokenizer.")


ModelConfig = keyed_union(TinyModelConfig, PretrainedModelConfig)
