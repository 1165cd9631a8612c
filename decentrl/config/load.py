"""Reading a run config: a TOML file (or the resolved JSON `decentrl run` writes), then
`--set key=value` overrides, validated together, with errors that name the file and the key.

Called by every `decentrl` command that takes a config (decentrl/cli/main.py) and by tests and
benchmarks that build configs from dicts (`parse_config`).
"""

from __future__ import annotations

import copy
import json
import tomllib
import types
from collections.abc import Sequence
from pathlib import Path
from typing import Union, get_args, get_origin

from pydantic import BaseModel, ValidationError

from decentrl.config.base import union_members
from decentrl.config.run import RunConfig


class ConfigError(Exception):
    """A config that cannot be used; the message names the file, the field and what is allowed."""


def load_config(path: str | None, overrides: Sequence[str] = ()) -> RunConfig:
    """Read a TOML (or resolved JSON) run config, or start from the defaults when `path` is None,
    and apply `overrides` ("key.path=value"); raises ConfigError with a fixable message."""
    data = _read(path) if path is not None else {}
    source = path or "the default config"
    if overrides:
        data = apply_overrides(data, overrides)
        source += " with " + " ".join(f"--set {item}" for item in overrides)
    return parse_config(data, source=source)


def parse_config(data: dict[str, object], source: str = "config") -> RunConfig:
    try:
        return RunConfig.model_validate(data)
    except ValidationError as error:
        raise ConfigError(_format_error(source, error)) from None


def apply_overrides(data: dict[str, object], overrides: Sequence[str]) -> dict[str, object]:
    """`data` with each "a.b.c=value" set at that dotted key (sections are made as needed).

    A value is read as a TOML value (4, 1e-4, true, "text", [1, 2], { worker-0 = 10.0 }), and as
    plain text when it is not one (cuda:0, s3://bucket/run), so paths and URLs need no quotes.
    Keys are not checked here: validation rejects an unknown one with its full dotted name."""
    result = copy.deepcopy(data)
    for item in overrides:
        key, equals, text = item.partition("=")
        parts = key.strip().split(".")
        if not equals or not all(parts):
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE with a dotted key, e.g. --set worker.concurrency=4")
        section = result
        for depth, part in enumerate(parts[:-1]):
            child = section.get(part)
            if child is None:  # absent, or null in a resolved JSON (an optional section left out)
                child = section[part] = {}
            if not isinstance(child, dict):
                raise ConfigError(f"--set {key}: {'.'.join(parts[: depth + 1])} is a value, not a section")
            section = child
        section[parts[-1]] = _value(text)
    return result


def _value(text: str) -> object:
    try:
        return tomllib.loads(f"value = {text}")["value"]
    except tomllib.TOMLDecodeError:  # not TOML: the text itself (a device name, a URL, a path)
        return text


def _read(path: str) -> dict[str, object]:
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"{path}: no such config file")
    try:
        text = file.read_text(encoding="utf-8")
        data = json.loads(text) if file.suffix == ".json" else tomllib.loads(text)
    except (UnicodeDecodeError, tomllib.TOMLDecodeError, json.JSONDecodeError) as error:
        raise ConfigError(f"{path}: not valid {file.suffix.lstrip('.').upper() or 'TOML'}: {error}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a config is a table of sections, not a {type(data).__name__}")
    return data


def _format_error(source: str, error: ValidationError) -> str:
    lines = [f"{source}: invalid config"]
    for item in error.errors():
        # A check across sections (the whole config as its input) names its values itself: no dump.
        shown = item["type"] != "missing" and "input" in item and not (
            isinstance(item["input"], dict) and len(repr(item["input"])) > SHOWN
        )
        got = f" (got {_short(item['input'])})" if shown else ""
        message = item["msg"].removeprefix("Value error, ")  # our validators' messages stand alone
        lines.append(f"  {path_in_file(item['loc'])}: {message}{got}")
    return "\n".join(lines)


SHOWN = 200  # characters of a bad value shown in an error


def _short(value: object, limit: int = SHOWN) -> str:
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def path_in_file(loc: Sequence[int | str]) -> str:
    """A validation error's location as the file spells it: "task.max_turns", not pydantic's
    "task.guess.max_turns". The location is walked along the models, and an entry that is the
    tag pydantic adds under a keyed union is dropped (a key of the same name elsewhere stays)."""
    parts: list[str] = []
    annotation: object = RunConfig
    for part in loc:
        members = union_members(annotation)
        if str(part) in members:
            annotation = members[str(part)]
            continue
        parts.append(str(part))
        annotation = _field_annotation(annotation, part)
    return ".".join(parts) or "(top level)"


def _field_annotation(annotation: object, key: int | str) -> object:
    """The annotation of field `key` of a section (or of an optional section); None past a list
    or a dict, whose entries are no sections to walk."""
    if get_origin(annotation) in (Union, types.UnionType):
        sections = [arg for arg in get_args(annotation) if isinstance(arg, type) and issubclass(arg, BaseModel)]
        if len(sections) == 1 and not union_members(annotation):  # `Section | None`
            annotation = sections[0]
    if isinstance(annotation, type) and issubclass(annotation, BaseModel) and isinstance(key, str):
        field = annotation.model_fields.get(key)
        return field.annotation if field is not None else None
    return None
