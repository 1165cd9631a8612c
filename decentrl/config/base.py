"""What every config section shares: the `Section` base, unions keyed by a `type` literal, and
the error for a key that an older decentrl read in another place.

Imported by the section modules of this package and by `decentrl/config/load.py`, which uses
`union_members` to write error paths as they appear in the file.
"""

from __future__ import annotations

import types
from typing import Annotated, Any, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Discriminator, Tag


class Section(BaseModel):
    """Base for every config section: unknown keys are errors, so typos cannot pass silently."""

    model_config = ConfigDict(extra="forbid", frozen=True)


def type_tag(member: type[Section]) -> str:
    """A union member's key: the default of its `type` literal field."""
    return str(member.model_fields["type"].default)


def keyed_union(*members: type[Section]) -> Any:
    """A union of sections chosen by their `type` key; a section that leaves `type` out is the
    first member. Each member's tag is its own `type` default, so tags cannot drift from the
    models (error paths drop them: see `union_members`)."""
    default = type_tag(members[0])

    def discriminate(value: object) -> str:
        if isinstance(value, dict):
            return str(value.get("type", default))
        return str(getattr(value, "type", default))

    choices = tuple(Annotated[member, Tag(type_tag(member))] for member in members)
    return Annotated[Union[choices], Discriminator(discriminate)]  # noqa: UP007 - built from a tuple


def union_members(annotation: object) -> dict[str, type[BaseModel]]:
    """The members of a union built by `keyed_union`, by tag; {} for any other annotation.

    Pydantic puts the chosen member's tag into an error's location (`task.guess.max_turns`);
    the tag is not a key of the file, which is why error messages need to know it."""
    if get_origin(annotation) not in (Union, types.UnionType):
        return {}
    members: dict[str, type[BaseModel]] = {}
    for choice in get_args(annotation):
        if get_origin(choice) is Annotated:
            member, *metadata = get_args(choice)
            if get_origin(member) in (Union, types.UnionType):  # an optional keyed union: `keyed_union(...) | None`
                members.update(union_members(member))
            members.update((item.tag, member) for item in metadata if isinstance(item, Tag))
    return members


def reject_moved(data: object, moved: dict[str, str]) -> object:
    """For a `mode="before"` validator: a key that now lives elsewhere fails with where to write
    it, instead of the bare "extra inputs are not permitted" an old config would otherwise get."""
    if isinstance(data, dict):
        found = [f"{key} is now read from {moved[key]}" for key in moved if key in data]
        if found:
            raise ValueError("; ".join(found) + ": move it there")
    return data
