"""Reading a version's weight files and checking them against a built model before any copy.

A swap copies new tensors into a model in place (workers/backends/hf.py; the orchestrator's
verifier, orchestrator/verify.py). A copy that fails part-way would leave a model holding some
tensors of the new version and some of the old, still reporting the old version; so every name,
shape and dtype is checked here first (`check_loadable`), and the copy that follows cannot fail
on the input. Weight files are read only as the manifest lists them (`read_weight_files`), and
any way a file can be bad (a header-size bomb, a malformed header) is one `LoadError` naming it.
Issue 13 moves checkpoint reading into one core module; this function is meant to fold into it.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


class LoadError(Exception):
    """A verified version's weights cannot go into the model; the message names what is wrong."""


def _listed(names: Iterable[str], limit: int = 5) -> str:
    names = sorted(names)
    return ", ".join(names[:limit]) + (f" (+{len(names) - limit} more)" if len(names) > limit else "")


def check_loadable(
    params: Mapping[str, torch.Tensor], tensors: Mapping[str, torch.Tensor], *, strict: bool = True, where: str
) -> None:
    """Raise LoadError unless every tensor names a parameter of the same shape and dtype, and -
    `strict` - every parameter has one (a LoRA merge replaces only the adapted weights)."""
    problems = []
    if missing := (params.keys() - tensors.keys() if strict else set()):
        problems.append(f"missing {_listed(missing)}")
    if unexpected := tensors.keys() - params.keys():
        problems.append(f"unexpected {_listed(unexpected)}")
    wrong = [
        f"{name} {tuple(tensors[name].shape)} {tensors[name].dtype} (model: {tuple(params[name].shape)} {params[name].dtype})"
        for name in sorted(tensors.keys() & params.keys())
        if tensors[name].shape != params[name].shape or tensors[name].dtype != params[name].dtype
    ]
    if wrong:
        problems.append("wrong shape or dtype: " + "; ".join(wrong[:3]) + (f" (+{len(wrong) - 3} more)" if len(wrong) > 3 else ""))
    if problems:
        raise LoadError(f"{where}: the weights do not fit the model: {'; '.join(problems)}")


def read_weight_files(directory: str, names: Iterable[str]) -> dict[str, torch.Tensor]:
    """The tensors of the named safetensors files of `directory` (the manifest's, never a glob)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for name in names:
        path = os.path.join(directory, name)
        if os.path.islink(path) or not os.path.isfile(path):
            raise LoadError(f"{path}: not a regular file; pull the version again")
        try:
            found = load_file(path)
        except SafetensorError as exc:  # header too large, malformed header, truncated data
            raise LoadError(f"{path}: not a readable safetensors file ({exc})") from None
        if twice := found.keys() & tensors.keys():
            raise LoadError(f"{path}: tensors also in another file: {_listed(twice)}")
        tensors.update(found)
    return tensors


def load_bytes(name: str, data: bytes) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file read into memory (the verifier's verified bytes)."""
    from safetensors import SafetensorError
    from safetensors.torch import load

    try:
        return load(data)
    except SafetensorError as exc:
        raise LoadError(f"{name}: not a readable safetensors file ({exc})") from None
