"""LoRA versions on a worker: a pulled adapter merged into its base model's weights.

In LoRA runs every version after 0 is a peft adapter (`adapter_config.json`,
`adapter_model.safetensors`; decentrl/trainer/lora.py) whose manifest names its base version;
`CheckpointStore.pull` brings that base into the same cache, beside it. A backend loads the base
weights with W = W0 + (alpha / r) * B @ A for each adapted Linear - the same merge as peft's
`merge_and_unload` - so generation runs at full-model speed with no adapter layers, and a swap is
an in-place weight copy like that of a full version. Called by workers/backends/hf.py.
"""

from __future__ import annotations

import json
import os

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from decentrl.store import MANIFEST_NAME, Manifest, version_dirname

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_PREFIX = "base_model.model."  # peft's prefix of saved adapter weight names


def adapter_base_dir(checkpoint_dir: str) -> str | None:
    """The cached base version directory when `checkpoint_dir` is an adapter version, else None."""
    if not os.path.isfile(os.path.join(checkpoint_dir, ADAPTER_CONFIG)):
        return None
    with open(os.path.join(checkpoint_dir, MANIFEST_NAME), "rb") as f:
        base = Manifest.model_validate_json(f.read()).base_version
    if base is None:
        raise ValueError(f"{checkpoint_dir} holds a LoRA adapter but its manifest names no base_version")
    return os.path.join(os.path.dirname(checkpoint_dir), version_dirname(base))


def weight_files(version_dir: str) -> list[str]:
    """The safetensors files of a pulled version as its manifest lists them (never a glob: a file
    planted beside them is not the version's)."""
    with open(os.path.join(version_dir, MANIFEST_NAME), "rb") as f:
        files = Manifest.model_validate_json(f.read()).files
    return [os.path.join(version_dir, entry.path) for entry in files if entry.path.endswith(".safetensors")]


def merged_weights(base_dir: str, adapter_dir: str) -> dict[str, torch.Tensor]:
    """The adapted Linears' weights, W0 + scale * B @ A, under the base model's names."""
    with open(os.path.join(adapter_dir, ADAPTER_CONFIG), encoding="utf-8") as f:
        config = json.load(f)
    scale = config["lora_alpha"] / config["r"]
    adapter = load_file(os.path.join(adapter_dir, ADAPTER_WEIGHTS))
    # "model.layers.0.self_attn.q_proj" for each adapted module
    modules = [name.removeprefix(_PREFIX).removesuffix(".lora_A.weight") for name in adapter if name.endswith(".lora_A.weight")]
    wanted = {f"{module}.weight": module for module in modules}
    merged: dict[str, torch.Tensor] = {}
    for shard in weight_files(base_dir):
        with safe_open(shard, framework="pt") as base:
            for name in wanted.keys() & set(base.keys()):
                module = wanted[name]
                a, b = adapter[f"{_PREFIX}{module}.lora_A.weight"], adapter[f"{_PREFIX}{module}.lora_B.weight"]
                w0 = base.get_tensor(name)
                merged[name] = w0 + (b.to(w0.dtype) @ a.to(w0.dtype)) * scale
    if len(merged) != len(wanted):
        raise ValueError(f"{adapter_dir}: adapted weights missing from the base in {base_dir}: {sorted(wanted.keys() - merged.keys())}")
    return merged
