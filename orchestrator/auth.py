"""Bearer-token auth with roles. Tokens live in a JSON file the operator controls.

File format: {"tokens": [{"name": "alice", "role": "worker", "token": "..."}]}.
Comparison is constant-time and tokens are never logged; only names are.
"""

from __future__ import annotations

import hmac
import json
import os
import re
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

Role = Literal["worker", "trainer", "admin"]
ROLES: tuple[Role, ...] = ("worker", "trainer", "admin")
NAME = re.compile(r"^[A-Za-z0-9._:@-]{1,64}$")  # no "/": lease holders are "token-name/worker-id"


@dataclass(frozen=True)
class Identity:
    name: str
    role: Role


class TokenRegistry:
    def __init__(self, entries: list[dict[str, str]]) -> None:
        self._entries: list[tuple[bytes, Identity]] = []
        for entry in entries:
            if not NAME.match(entry["name"]):
                raise ValueError(f"token name {entry['name']!r} must match {NAME.pattern}")
            if entry["role"] not in ROLES:
                raise ValueError(f"token {entry['name']!r}: role must be one of {ROLES}, got {entry['role']!r}")
            self._entries.append((entry["token"].encode(), Identity(entry["name"], entry["role"])))  # type: ignore[arg-type]

    @classmethod
    def from_file(cls, path: str) -> TokenRegistry:
        if not Path(path).is_file():
            raise FileNotFoundError(
                f"{path}: no tokens file; create one with `decentrl token create --file {path} --role worker --name NAME`"
            )
        return cls(json.loads(Path(path).read_text())["tokens"])

    def identify(self, token: str) -> Identity | None:
        presented = token.encode()
        found: Identity | None = None
        # Compare against every entry so timing does not reveal which prefix matched.
        for secret, identity in self._entries:
            if hmac.compare_digest(secret, presented):
                found = identity
        return found


def add_token(path: str, *, name: str, role: Role) -> str:
    """Append a new random token to the file (created with mode 0600) and return it."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    if not NAME.match(name):
        raise ValueError(f"name {name!r} must match {NAME.pattern}")
    file = Path(path)
    data = json.loads(file.read_text()) if file.is_file() else {"tokens": []}
    if any(entry["name"] == name for entry in data["tokens"]):
        raise ValueError(f"{path}: a token named {name!r} already exists; pick another --name")
    token = secrets.token_urlsafe(32)
    data["tokens"].append({"name": name, "role": role, "token": token})
    file.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(file.with_suffix(".tmp"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        json.dump(data, out, indent=1)
    os.replace(file.with_suffix(".tmp"), file)
    return token
