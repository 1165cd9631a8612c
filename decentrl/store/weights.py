"""Checkpoint weights: the one module that writes them and reads them back.

A published version (decentrl/store/checkpoints.py adds its manifest.json) is either
- an HF directory: `config.json`, the weights as `model.safetensors` or as shards listed by
  `model.safetensors.index.json`, tokenizer files; `AutoModelForCausalLM.from_pretrained` loads it;
- in LoRA runs, a peft adapter (`adapter_config.json`, `adapter_model.safetensors`) whose manifest
  names its base version; `CheckpointStore.pull` brings that base into the same cache, beside it.

Here: the write side (`write_hf_dir`, `write_adapter_weights`, called by the trainer's publisher,
decentrl/trainer/publisher.py and lora.py), the read side (`read_weights`: a pulled version as one
full state dict, an adapter merged onto its base; `weights_from_files`: the same from bytes read
into memory), `load_pretrained` (a model built from a directory) and `copy_into` (new weights into
a built model, in place, all or nothing: keys, shapes and dtypes are all checked before the
first tensor is copied). A pulled version is read as its manifest lists it, never as its
directory is found, and anything wrong with a version's weights (an unreadable file, a tensor
that does not fit) is one CheckpointError, which the worker's swapper and the verifier catch
to refuse the version and keep their loaded weights whole. Callers: the trainer (decentrl/trainer/train.py), the
HF worker backend's loads and weight swaps (workers/backends/hf.py), the orchestrator's verifier
(orchestrator/verify.py) and decentrl/model/build.py. torch is imported here: import this module
lazily from code that runs without it (the orchestrator with verification off).
"""

from __future__ import annotations

import copy
import json
import os
import shutil
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors
from safetensors.torch import load_file, save_file

from decentrl.config import StoreConfig
from decentrl.store.cache import read_cached_manifest, read_regular
from decentrl.store.manifest import MANIFEST_NAME, version_dirname

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

WEIGHTS_NAME = "model.safetensors"  # transformers' SAFE_WEIGHTS_NAME: the weights when they fit one shard
INDEX_NAME = "model.safetensors.index.json"  # transformers' SAFE_WEIGHTS_INDEX_NAME: tensor name -> shard
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json", "chat_template.jinja"
)
ADAPTER_CONFIG = "adapter_config.json"  # peft's CONFIG_NAME
ADAPTER_WEIGHTS = "adapter_model.safetensors"  # peft's SAFETENSORS_WEIGHTS_NAME
ADAPTER_PREFIX = "base_model.model."  # peft's prefix of saved adapter weight names
DEFAULT_SHARD_BYTES = StoreConfig.model_fields["shard_size_mb"].default * 2**20
_NAMED = 8  # offending keys named in an error message; the rest are counted

StateDict = dict[str, torch.Tensor]


class CheckpointError(ValueError):
    """A checkpoint's weights cannot be used: a file is missing, or its tensors do not fit the model."""


# -- write ------------------------------------------------------------------------------------


TIED_HEAD = "lm_head.weight"  # the output head transformers ties to the input embeddings


def write_hf_dir(
    directory: str,
    state: Mapping[str, torch.Tensor],
    model_config: PretrainedConfig,
    extras_from: str,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    dtype: torch.dtype | None = None,
) -> None:
    """An HF-loadable checkpoint: config.json, tokenizer files copied from `extras_from`, and the
    weights as `model.safetensors` when they fit one shard, else `model-00001-of-0000N.safetensors`
    ... plus `model.safetensors.index.json`, the layout `from_pretrained` reads. `dtype`: the
    floating-point tensors are written in it (store.publish_dtype; the trainer's own stay float32),
    and config.json says so."""
    from huggingface_hub import split_torch_state_dict_into_shards

    if getattr(model_config, "tie_word_embeddings", False) and TIED_HEAD in state:
        # The head is the embeddings (SmolLM2, Qwen3): written once, under the embeddings' name, as
        # save_pretrained does; a gathered or converted state holds it as a tensor of its own.
        state = {name: tensor for name, tensor in state.items() if name != TIED_HEAD}
    if dtype is not None:
        state = {name: t.to(dtype) if t.is_floating_point() else t for name, t in state.items()}
        model_config = copy.deepcopy(model_config)
        model_config.dtype = dtype
    model_config.save_pretrained(directory)
    split = split_torch_state_dict_into_shards(dict(state), max_shard_size=max_shard_bytes)
    for filename, names in split.filename_to_tensors.items():
        shard = {name: state[name].contiguous() for name in names}
        save_file(shard, os.path.join(directory, filename), metadata={"format": "pt"})
    if split.is_sharded:
        index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
        Path(directory, INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True))
    for name in TOKENIZER_FILES:
        source = Path(extras_from) / name
        if source.is_file() and source.resolve() != (Path(directory) / name).resolve():
            shutil.copy(source, Path(directory) / name)


def write_adapter_weights(directory: str, adapter: Mapping[str, torch.Tensor]) -> None:
    """`adapter_model.safetensors` from adapter weights under peft's saved names
    (`base_model.model.<module>.lora_A.weight`); peft writes `adapter_config.json` beside it."""
    tensors = {name: tensor.contiguous() for name, tensor in adapter.items()}
    save_file(tensors, os.path.join(directory, ADAPTER_WEIGHTS), metadata={"format": "pt"})


# -- read -------------------------------------------------------------------------------------
#
# Which files hold the weights is decided from names alone (`weight_shards`): a pulled version's
# names are its manifest's (decentrl/store/cache.py `read_cached_manifest`), never a listing of its
# directory, so a file planted beside them is never read; a directory that was not pulled (the
# trainer's own, a test's) is listed, as `from_pretrained` would. Every way a weight file can be
# bad (a header-size bomb, a malformed header, truncated data, a tensor in two files) is one
# CheckpointError naming it.


def is_pulled(directory: str) -> bool:
    """Whether `directory` is a pulled version: it holds the manifest its pull kept."""
    return os.path.lexists(os.path.join(directory, MANIFEST_NAME))


def _index_shards(index: bytes) -> list[str]:
    try:
        weight_map = json.loads(index)["weight_map"]
    except (ValueError, KeyError, TypeError, RecursionError) as exc:  # not JSON, not an object, no weight_map
        raise CheckpointError(f"{INDEX_NAME}: not a safetensors index ({type(exc).__name__}: {exc})") from None
    if not isinstance(weight_map, dict) or not all(isinstance(shard, str) for shard in weight_map.values()):
        raise CheckpointError(f"{INDEX_NAME}: weight_map is not a map of tensor names to file names")
    return sorted(set(weight_map.values()))


def weight_shards(names: Collection[str], index: bytes | None) -> list[str]:
    """The files holding an HF checkpoint's weights, given the names in its directory and its
    index: the shards the index maps tensors to, else the single `model.safetensors`."""
    if index is not None:
        return _index_shards(index)
    if WEIGHTS_NAME in names:
        return [WEIGHTS_NAME]
    raise CheckpointError(f"neither {WEIGHTS_NAME} nor {INDEX_NAME} in the checkpoint")


def _safetensors(where: str, load: Callable[[], StateDict]) -> StateDict:
    try:
        return load()
    except SafetensorError as exc:  # header too large, malformed header, truncated data
        raise CheckpointError(f"{where}: not a readable safetensors file ({exc})") from None


def _add(state: StateDict, found: StateDict, where: str) -> None:
    if twice := sorted(found.keys() & state.keys()):
        raise CheckpointError(f"{where}: tensors also in another file: {_listed(twice)}")
    state.update(found)


def read_hf_weights(directory: str) -> StateDict:
    """The state dict of an HF checkpoint directory (one file, or shards + index). A pulled
    version is read as its manifest lists it: only its files, each a regular file (a pull makes
    no symlinks); a directory that was not pulled as it is found."""
    if is_pulled(directory):
        listed = {entry.path: entry for entry in read_cached_manifest(directory).files}
        entry = listed.get(INDEX_NAME)
        index = None if entry is None else read_regular(os.path.join(directory, INDEX_NAME), limit=entry.size)
        if entry is not None and index is None:
            raise CheckpointError(f"{directory}: {INDEX_NAME} is missing (or not a regular file); pull the version again")
        names: Collection[str] = listed.keys()
    else:
        path = Path(directory, INDEX_NAME)
        index, names = (path.read_bytes() if path.is_file() else None), os.listdir(directory)
    state: StateDict = {}
    for name in weight_shards(names, index):
        path = os.path.join(directory, name)
        if name not in names or not os.path.isfile(path):
            raise CheckpointError(f"{directory}: {name}, named by {INDEX_NAME}, is missing")
        if is_pulled(directory) and os.path.islink(path):
            raise CheckpointError(f"{path}: a symlink, not a file the pull made; pull the version again")
        _add(state, _safetensors(path, lambda path=path: load_file(path)), path)
    return state


def weights_from_files(files: Mapping[str, bytes]) -> StateDict:
    """The state dict of an HF checkpoint whose files (file name -> bytes) were read into memory:
    `CheckpointStore.read_verified` of its safetensors and index."""
    state: StateDict = {}
    for name in weight_shards(files.keys(), files.get(INDEX_NAME)):
        if name not in files:
            raise CheckpointError(f"{name}, named by {INDEX_NAME}, is missing")
        _add(state, _safetensors(name, lambda name=name: load_safetensors(files[name])), name)
    return state


@dataclass(frozen=True)
class Adapter:
    """A LoRA adapter as stored: its A and B matrices under peft's saved names, and its scale."""

    tensors: StateDict
    scale: float  # lora_alpha / r: the merged weight is W0 + scale * B @ A


def read_adapter(directory: str) -> Adapter:
    path, config_path = os.path.join(directory, ADAPTER_WEIGHTS), os.path.join(directory, ADAPTER_CONFIG)
    try:
        config = json.loads(Path(config_path).read_bytes())
        scale = float(config["lora_alpha"]) / float(config["r"])
    except (ValueError, KeyError, TypeError, ZeroDivisionError, RecursionError) as exc:
        raise CheckpointError(f"{config_path}: not a LoRA adapter config ({type(exc).__name__}: {exc})") from None
    return Adapter(_safetensors(path, lambda: load_file(path)), scale)


def adapter_base_dir(checkpoint_dir: str) -> str | None:
    """The cached base version directory when `checkpoint_dir` (pulled) is an adapter version, else None."""
    if not os.path.isfile(os.path.join(checkpoint_dir, ADAPTER_CONFIG)):
        return None
    base = read_cached_manifest(checkpoint_dir).base_version
    if base is None:
        raise CheckpointError(f"{checkpoint_dir} holds a LoRA adapter but its manifest names no base_version")
    return os.path.join(os.path.dirname(checkpoint_dir), version_dirname(base))


def merge_adapter(base: Mapping[str, torch.Tensor], adapter: Adapter) -> StateDict:
    """`base` with each adapted Linear's weight replaced by W0 + scale * B @ A, under the base
    model's names: peft's `merge_and_unload`, so a model runs the adapted policy with no adapter
    layers and a version swap stays an in-place copy."""
    # "model.layers.0.self_attn.q_proj" for each adapted module
    modules = [
        name.removeprefix(ADAPTER_PREFIX).removesuffix(".lora_A.weight")
        for name in adapter.tensors
        if name.endswith(".lora_A.weight")
    ]
    missing = [f"{module}.weight" for module in modules if f"{module}.weight" not in base]
    missing += [name for module in modules if (name := f"{ADAPTER_PREFIX}{module}.lora_B.weight") not in adapter.tensors]
    if missing:
        raise CheckpointError(f"the adapter does not fit its base: missing {_listed(missing)}")
    wrong = []
    for module in modules:  # B @ A must have W0's shape: (out, r) @ (r, in)
        a = adapter.tensors[f"{ADAPTER_PREFIX}{module}.lora_A.weight"]
        b = adapter.tensors[f"{ADAPTER_PREFIX}{module}.lora_B.weight"]
        w0 = base[f"{module}.weight"]
        if a.dim() != 2 or b.dim() != 2 or b.shape[1] != a.shape[0] or (b.shape[0], a.shape[1]) != tuple(w0.shape):
            wrong.append(f"{module} A {tuple(a.shape)} B {tuple(b.shape)} (base: {tuple(w0.shape)})")
    if wrong:
        raise CheckpointError(f"the adapter does not fit its base: wrong shape {_listed(wrong)}")
    merged = dict(base)
    for module in modules:
        a = adapter.tensors[f"{ADAPTER_PREFIX}{module}.lora_A.weight"]
        b = adapter.tensors[f"{ADAPTER_PREFIX}{module}.lora_B.weight"]
        w0 = base[f"{module}.weight"]
        merged[f"{module}.weight"] = w0 + (b.to(w0.dtype) @ a.to(w0.dtype)) * adapter.scale
    return merged


def read_weights(checkpoint_dir: str) -> StateDict:
    """A pulled version's full state dict: an HF directory's weights, or an adapter version's
    merged onto its base (pulled beside it)."""
    base_dir = adapter_base_dir(checkpoint_dir)
    if base_dir is None:
        return read_hf_weights(checkpoint_dir)
    return merge_adapter(read_hf_weights(base_dir), read_adapter(checkpoint_dir))


def model_dir(checkpoint_dir: str) -> str:
    """The HF directory holding a pulled version's config and tokenizer: its own, or its base's."""
    return adapter_base_dir(checkpoint_dir) or checkpoint_dir


def load_pretrained(directory: str, *, as_published: bool = False) -> PreTrainedModel:
    """A model built from a checkpoint directory on CPU: an HF directory (a published version, or
    a downloaded pretrained model in any layout transformers reads), or a pulled adapter version
    (its base, with the merged weights copied in). A pulled version's weights are read as every
    later version's are (`read_weights`) and copied over what from_pretrained built, checked:
    from_pretrained fills a missing tensor with random values and reads whichever weight files it
    finds in the directory, not only the manifest's. float32 (the trainer's master weights), or
    with `as_published` in the dtype the version was published in (store.publish_dtype: workers
    sample with exactly the published weights)."""
    from transformers import AutoModelForCausalLM

    base_dir = adapter_base_dir(directory)
    model = AutoModelForCausalLM.from_pretrained(base_dir or directory, dtype=torch.float32)
    if is_pulled(directory):  # an adapter version always is: its manifest names its base
        weights = read_weights(directory)
        if as_published:
            adopt_dtype(model, weights)
        else:  # the trainer's float32 master weights start from the published (maybe bf16) version 0
            weights = {name: t.float() if t.is_floating_point() else t for name, t in weights.items()}
        copy_into(model, weights)
    return model


# -- into a built model -----------------------------------------------------------------------


def mismatches(expected: Mapping[str, torch.Tensor], given: Mapping[str, torch.Tensor], *, dtypes: bool = True) -> list[str]:
    """What keeps `given` from replacing `expected` tensor for tensor: missing and unexpected
    keys, and keys whose shape (or, with `dtypes`, dtype) differs. Empty when it fits."""
    problems = []
    if missing := sorted(expected.keys() - given.keys()):
        problems.append(f"missing {_listed(missing)}")
    if unexpected := sorted(given.keys() - expected.keys()):
        problems.append(f"unexpected {_listed(unexpected)}")
    wrong = [
        f"{name} {tuple(given[name].shape)} {given[name].dtype} (model: {tuple(tensor.shape)} {tensor.dtype})"
        for name, tensor in expected.items()
        if name in given and (given[name].shape != tensor.shape or (dtypes and given[name].dtype != tensor.dtype))
    ]
    if wrong:
        problems.append(f"wrong shape or dtype {_listed(wrong)}")
    return problems


def published_dtype(state: Mapping[str, torch.Tensor]) -> torch.dtype:
    """The one floating-point dtype of a version's tensors (its store.publish_dtype)."""
    found = {t.dtype for t in state.values() if t.is_floating_point()}
    if len(found) != 1:
        raise CheckpointError(f"a version's floating-point tensors share one dtype; found {sorted(map(str, found))}")
    return found.pop()


def adopt_dtype(model: torch.nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """Convert `model` (built in float32) to the dtype `state` was published in, before its first
    `copy_into`; every later version of the run comes in that dtype, and `copy_into` refuses any
    tensor of another."""
    model.to(published_dtype(state))


def copy_into(model: torch.nn.Module, state: Mapping[str, torch.Tensor], *, published: torch.dtype | None = None) -> None:
    """Overwrite every parameter and buffer of `model` with `state`'s tensor of the same name, in
    place (on the model's device), all or nothing: keys, shapes and dtypes are all checked before
    the first copy, so weights that do not fit raise CheckpointError and leave the model holding
    its old weights (a worker keeps generating with its loaded version). With `published`, the
    state must be in that dtype and the model may compute in another (a role computing in fp32
    from bf16 versions, decentrl/model/devices.py `compute_dtype`): the copy upcasts exactly."""
    targets = model.state_dict()  # tensors aliasing the model's own storage
    # A tied weight (lm_head.weight is embed_tokens.weight in SmolLM2, Qwen3 and most small models)
    # is saved once by save_pretrained: copying its twin fills it, so its absence is no gap.
    aliases = tied_aliases(targets)
    targets = {name: t for name, t in targets.items() if name in state or name not in aliases}
    if published is not None and (found := published_dtype(state)) != published:
        raise CheckpointError(f"the weights are {found}, the run's versions {published}: every version of a run "
                              "is published in one dtype (store.publish_dtype)")
    if problems := mismatches(targets, state, dtypes=published is None):
        raise CheckpointError("the weights do not fit the model: " + "; ".join(problems))
    with torch.no_grad():
        for name, tensor in state.items():
            targets[name].copy_(tensor)


def tied_aliases(state: Mapping[str, torch.Tensor]) -> set[str]:
    """Names whose tensor is the same memory as an earlier name's (tied weights)."""
    seen: set[tuple[int, int, tuple[int, ...]]] = set()
    aliases = set()
    for name, tensor in state.items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if key in seen:
            aliases.add(name)
        seen.add(key)
    return aliases


def _listed(names: list[str]) -> str:
    more = f" and {len(names) - _NAMED} more" if len(names) > _NAMED else ""
    return ", ".join(names[:_NAMED]) + more
