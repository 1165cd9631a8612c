"""LoRA training (`trainer.lora`): adapters injected by peft, and published alone.

The trainer wraps its policy with `add_adapters` before FSDP2 sharding: peft replaces each
targeted Linear in place (the module tree stays the transformers model, so sharding, the loss
and DCP checkpoints work unchanged) and freezes every base weight. Version 0 in the store is the
full base model; each later version is only `adapter_dir` files, as `PeftModel.save_pretrained`
writes them, so `PeftModel.from_pretrained(base, <pulled vN>)` loads one, and its manifest names
the base (`base_version`). Called by the training loop and the publisher.
"""

from __future__ import annotations

import torch
from peft import LoraConfig, get_peft_model
from transformers import PreTrainedModel

from decentrl.config import LoRAConfig
from decentrl.store.weights import ADAPTER_PREFIX, write_adapter_weights

BASE_VERSION = 0  # every adapter applies to the initial model; the KL reference is the same base
_ADAPTER_NAME = "default"  # peft's name for the one adapter; absent from saved key names


def peft_config(config: LoRAConfig) -> LoraConfig:
    return LoraConfig(
        task_type="CAUSAL_LM",
        r=config.rank,
        lora_alpha=config.alpha,
        lora_dropout=config.dropout,
        target_modules=list(config.target_modules),
    )


def add_adapters(model: PreTrainedModel, config: LoRAConfig) -> PreTrainedModel:
    """`model` itself with LoRA layers in place of the targeted Linears; only they train.
    The B matrices start at zero, so the adapted model starts as exactly the base."""
    get_peft_model(model, peft_config(config))  # injects in place; the PeftModel wrapper is not needed
    return model


def is_adapter_weight(name: str) -> bool:
    """A state-dict name of a LoRA weight (`...q_proj.lora_A.default.weight`)."""
    return ".lora_A." in name or ".lora_B." in name


def adapter_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapter weights of a full state dict, under the names peft saves and loads:
    `model.layers.0.self_attn.q_proj.lora_A.default.weight` ->
    `base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`."""
    return {
        ADAPTER_PREFIX + name.replace(f".{_ADAPTER_NAME}.", "."): tensor
        for name, tensor in state.items()
        if is_adapter_weight(name)
    }


def write_adapter_dir(directory: str, state: dict[str, torch.Tensor], config: LoRAConfig) -> None:
    """`adapter_config.json` (peft's) + `adapter_model.safetensors` (decentrl/store/weights.py) from a
    state dict holding the adapter weights (trainer names; other entries are ignored)."""
    peft_config(config).save_pretrained(directory)
    write_adapter_weights(directory, adapter_state(state))
