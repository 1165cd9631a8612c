"""Bring a model in: an HF directory or a GGUF file -> a model directory every role loads.

Called by `decentrl model import` (decentrl/cli/model.py). transformers reads the source (its own
GGUF support dequantizes a GGUF file; the optional `gguf` package, extra `model`, does the
reading); the weights are written by decentrl/store/weights.py `write_hf_dir`, the module that
writes every checkpoint, so the directory has the layout a published version has: config.json
(no quantization flag: transformers refuses to save or train a model it marks as quantized),
safetensors in the chosen dtype, tokenizer files with the chat template, generation_config.json.
The directory is then loaded back the way the roles load it and compared with what was written.
Every way the source is unusable is one ModelImportError whose message names the file and why.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

Dtype = Literal["bf16", "fp32", "fp16"]
_DTYPES = {"bf16": "bfloat16", "fp32": "float32", "fp16": "float16"}
GGUF_MAGIC = b"GGUF"
_CHECKED_TENSORS = 4  # tensors compared after loading back: the first, the last and two between
_SAMPLE_TEXT = "What is 37 + 8? Answer with the number only."


class ModelImportError(ValueError):
    """The source cannot be imported; the message names the file and the cause."""


@dataclass(frozen=True)
class ImportReport:
    """What `import_model` wrote."""

    out: str
    architecture: str
    parameters: int
    dtype: Dtype
    weight_bytes: int
    chat_template: bool


def import_model(src: str, out: str, dtype: Dtype = "bf16") -> ImportReport:
    """Read `src` (an HF model directory or a GGUF file), write `out`, load it back and check it."""
    import torch

    target = getattr(torch, _DTYPES[dtype])
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise ModelImportError(f"{out}: already exists and is not an empty directory; choose another --out")
    if not os.path.exists(src):
        raise ModelImportError(f"{src}: no such file or directory")
    model, tokenizer = read_hf_dir(src) if os.path.isdir(src) else read_gguf(src)
    state = {name: t.to(target) if t.is_floating_point() else t for name, t in untied_state(model).items()}
    write_model_dir(out, model, tokenizer, state, target)
    verify(out, state, tokenizer)
    return ImportReport(
        out=out, architecture=type(model).__name__, parameters=sum(p.numel() for p in model.parameters()),
        dtype=dtype, weight_bytes=sum(f.stat().st_size for f in Path(out).glob("*.safetensors")),
        chat_template=bool(tokenizer.chat_template),
    )


def read_hf_dir(src: str) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """An HF causal LM directory (config.json, weights, tokenizer), loaded in float32 on CPU."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not os.path.isfile(os.path.join(src, "config.json")):
        raise ModelImportError(f"{src}: no config.json: not an HF model directory (give its directory, or a .gguf file)")
    try:
        model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(src)
    except (OSError, ValueError, KeyError) as exc:  # missing weights or tokenizer, unknown architecture
        raise ModelImportError(f"{src}: transformers cannot load it ({_first_line(exc)})") from None
    return model, tokenizer


def read_gguf(src: str) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A GGUF file, dequantized to float32 by transformers (reading it needs the `gguf` package)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with open(src, "rb") as file:
        magic = file.read(len(GGUF_MAGIC))
    if magic != GGUF_MAGIC:
        raise ModelImportError(f"{src}: not a GGUF file (it starts with {magic!r}, a GGUF file with {GGUF_MAGIC!r})")
    try:
        from gguf import GGUFReader
    except ImportError:
        raise ModelImportError(
            f"{src}: reading GGUF needs the gguf package: pip install -e '.[model]' (or pip install gguf)"
        ) from None
    try:  # the gguf package's reader maps every tensor: a file cut short fails here, not half-way through
        reader = GGUFReader(src)
        architecture = reader.fields["general.architecture"].contents()
    except Exception as exc:  # the reader raises ValueError, IndexError, struct.error...: one message
        raise ModelImportError(f"{src}: a truncated or corrupt GGUF file ({type(exc).__name__}: {exc})") from None
    del reader
    directory, name = os.path.split(os.path.abspath(src))
    try:
        model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    except (ValueError, NotImplementedError, KeyError, TypeError) as exc:  # an architecture or quantization it lacks
        raise ModelImportError(
            f"{src}: transformers cannot load a GGUF model of architecture {architecture!r} ({_first_line(exc)})"
        ) from None
    return model, tokenizer


def untied_state(model: PreTrainedModel) -> dict[str, torch.Tensor]:
    """The state dict with each tied tensor once (an output head tied to the embeddings keeps the
    embeddings' name): from_pretrained ties it again, as config.json's tie_word_embeddings says,
    and written twice it would add the embedding's bytes to the directory (57 MB for SmolLM2-135M)."""
    from decentrl.store.weights import tied_aliases

    state = model.state_dict()
    aliases = tied_aliases(state)
    return {name: tensor for name, tensor in state.items() if name not in aliases}


def write_model_dir(
    out: str, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, state: dict[str, torch.Tensor],
    dtype: torch.dtype,
) -> None:
    """config.json without the quantization flag, the weights in `dtype`, tokenizer files (the chat
    template with them) and generation_config.json."""
    from decentrl.store.weights import write_hf_dir

    config = copy.deepcopy(model.config)
    # A GGUF-loaded model's config says `quantization_config = gguf`; its weights are dequantized,
    # and a directory carrying the flag is one transformers will neither save again nor train.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    os.makedirs(out, exist_ok=True)
    tokenizer.save_pretrained(out)
    model.generation_config.save_pretrained(out)
    write_hf_dir(out, state, config, extras_from=out, dtype=dtype)


def verify(out: str, state: dict[str, torch.Tensor], tokenizer: PreTrainedTokenizerBase) -> None:
    """Load `out` as the roles do (AutoModelForCausalLM, AutoTokenizer, CPU) and compare a few
    tensors with what was written, and the tokenizer's ids for a sample text with the source's."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    loaded = AutoModelForCausalLM.from_pretrained(out, dtype="auto")
    if loaded.config.to_dict().get("quantization_config") is not None:
        raise ModelImportError(f"{out}: config.json still carries a quantization flag")
    weights = loaded.state_dict()
    names = list(state)
    step = max(1, (len(names) - 1) // (_CHECKED_TENSORS - 1))
    for name in dict.fromkeys([*names[::step][: _CHECKED_TENSORS - 1], names[-1]]):
        if name not in weights or not torch.equal(weights[name], state[name]):
            raise ModelImportError(f"{out}: tensor {name} loaded back differs from the one converted")
    ids = AutoTokenizer.from_pretrained(out)(_SAMPLE_TEXT).input_ids
    if ids != tokenizer(_SAMPLE_TEXT).input_ids:
        raise ModelImportError(f"{out}: the tokenizer loaded back encodes text differently from the source's")


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"
