"""Bearer-token auth with roles (worker, trainer, scorer, admin), from a tokens file and the environment.

File: {"tokens": [{"name": "alice", "role": "worker", "token": "..."}]}, mode 0600; DECENTRL_TOKENS
is read once (docs/api.md). Tokens are looked up by SHA-256 digest and confirmed with
`hmac.compare_digest`; only names are logged. The file is re-read whenever it changed, so a
revocation applies to the next request; writers lock `<file>.lock` and replace it atomically.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import hmac
import json
import logging
import os
import re
import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from aiohttp import web

Role = Literal["worker", "trainer", "scorer", "admin"]
ROLES: tuple[Role, ...] = ("worker", "trainer", "scorer", "admin")
NAME = re.compile(r"^[A-Za-z0-9._:@-]{1,64}$")  # no "/": lease holders are "token-name/worker-id"
ENV_VAR = "DECENTRL_TOKENS"

log = logging.getLogger("decentrl.orchestrator.auth")


@dataclass(frozen=True)
class Identity:
    name: str
    role: Role


IDENTITY = web.RequestKey("identity", Identity)  # the caller's token, set by the auth middleware


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


def _check_entry(entry: dict[str, str], where: str) -> None:
    if not isinstance(entry, dict) or not {"name", "role", "token"} <= entry.keys():
        raise ValueError(f"{where}: every token needs name, role and token")
    if not NAME.fullmatch(str(entry["name"])):
        raise ValueError(f"{where}: token name {entry['name']!r} must match {NAME.pattern}")
    if entry["role"] not in ROLES:
        raise ValueError(f"{where}: token {entry['name']!r}: role must be one of {ROLES}, got {entry['role']!r}")
    if not isinstance(entry["token"], str) or not entry["token"]:
        raise ValueError(f"{where}: token {entry['name']!r} is empty")
    if not entry["token"].isascii() or not entry["token"].isprintable() or " " in entry["token"]:
        # An HTTP header carries nothing else intact; such a token could never be presented.
        raise ValueError(f"{where}: token {entry['name']!r} must be printable ASCII without spaces")


def parse_env_tokens(text: str) -> list[dict[str, str]]:
    """DECENTRL_TOKENS: `name:role:token` entries separated by commas, or the tokens file's JSON."""
    text = text.strip()
    if not text:
        return []
    if text[0] in "[{":
        data = json.loads(text)
        entries = data["tokens"] if isinstance(data, dict) else data
    else:
        entries = []
        for item in filter(None, (part.strip() for part in text.split(","))):
            name, role, token = (item.split(":", 2) + ["", ""])[:3]
            entries.append({"name": name, "role": role, "token": token})
    for entry in entries:
        _check_entry(entry, ENV_VAR)
    return entries


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(f"{path}.lock", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _read_file(path: Path) -> list[dict[str, str]]:
    if not path.is_file():
        return []
    entries = json.loads(path.read_text())["tokens"]
    for entry in entries:
        _check_entry(entry, str(path))
    return entries


def _write_file(path: Path, entries: list[dict[str, str]]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        json.dump({"tokens": entries}, out, indent=1)
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp, path)


def _new_entry(name: str, role: Role) -> dict[str, str]:
    entry = {"name": name, "role": role, "token": secrets.token_urlsafe(32)}
    _check_entry(entry, "new token")
    return entry


def add_token(path: str, *, name: str, role: Role) -> str:
    """Append a new random token to the file (created with mode 0600) and return it."""
    entry = _new_entry(name, role)
    file = Path(path)
    with _locked(file):
        entries = _read_file(file)
        if any(existing["name"] == name for existing in entries):
            raise ValueError(f"{path}: a token named {name!r} already exists; pick another --name")
        _write_file(file, [*entries, entry])
    return entry["token"]


def revoke_token(path: str, *, name: str) -> bool:
    """Remove the token called `name` from the file; False if there was none."""
    file = Path(path)
    with _locked(file):
        entries = _read_file(file)
        kept = [entry for entry in entries if entry["name"] != name]
        if len(kept) == len(entries):
            return False
        _write_file(file, kept)
    return True


def list_tokens(path: str) -> list[tuple[str, Role]]:
    return [(entry["name"], entry["role"]) for entry in _read_file(Path(path))]  # type: ignore[misc]


class TokenRegistry:
    """Who may call what. `identify` is called once per request, on the event loop."""

    def __init__(self, entries: list[dict[str, str]] | None = None, *, path: str | None = None,
                 env_entries: list[dict[str, str]] | None = None) -> None:
        self.path = Path(path) if path is not None else None
        self._memory = list(entries or [])
        for entry in self._memory:
            _check_entry(entry, "tokens")
        self._env = list(env_entries or [])
        self._file: list[dict[str, str]] = []
        self._file_key: tuple[int, int, int] | None = None
        self._by_digest: dict[bytes, tuple[bytes, Identity, str]] = {}
        self._reload(force=True)

    @classmethod
    def from_file(cls, path: str, *, env: str | None = None) -> TokenRegistry:
        """The tokens of `path` (which must exist unless `env` provides some) and of `env`."""
        env_entries = parse_env_tokens(env) if env else []
        if not Path(path).is_file() and not env_entries:
            raise FileNotFoundError(
                f"{path}: no tokens file; create one with `decentrl token create --file {path} --role worker --name NAME`"
                f" (or set {ENV_VAR})"
            )
        return cls(path=path, env_entries=env_entries)

    def _reload(self, force: bool = False) -> None:
        """Re-read the tokens file if it changed. A broken file keeps the tokens read before;
        `force` (start-up, after a write) raises instead."""
        key = None
        if self.path is not None:
            with contextlib.suppress(FileNotFoundError):
                st = os.stat(self.path)
                key = (st.st_mtime_ns, st.st_size, st.st_ino)
        if key == self._file_key and not force:
            return
        try:
            self._file = _read_file(self.path) if key is not None else []  # type: ignore[arg-type]
        except (ValueError, KeyError, TypeError) as exc:
            if force:
                raise ValueError(f"{self.path}: {exc}") from None
            log.error("tokens file %s is invalid (%s); keeping the tokens read before", self.path, exc)
            self._file_key = key
            return
        if key is None and self._file_key is not None:
            log.warning("tokens file %s was removed: its tokens are revoked", self.path)
        self._file_key = key
        self._rebuild()

    def _rebuild(self) -> None:
        table: dict[bytes, tuple[bytes, Identity, str]] = {}
        names: set[str] = set()
        for source, entries in (("env", self._env), ("memory", self._memory), ("file", self._file)):
            for entry in entries:
                if entry["name"] in names:
                    log.error("token name %r is defined twice; the %s entry is ignored", entry["name"], source)
                    continue
                names.add(entry["name"])
                digest = _digest(entry["token"])
                table[digest] = (digest, Identity(entry["name"], entry["role"]), source)  # type: ignore[arg-type]
        self._by_digest = table

    def identify(self, token: str) -> Identity | None:
        self._reload()
        if not token.isascii():  # header bytes that are not ASCII (aiohttp keeps them as surrogates): no token is
            return None
        presented = _digest(token)
        found = self._by_digest.get(presented)  # a lookup by digest: timing says nothing of the token
        if found is None:
            return None
        stored, identity, _ = found
        return identity if hmac.compare_digest(stored, presented) else None

    def entries(self) -> list[tuple[str, Role, str]]:
        """(name, role, source) of every token; never the tokens."""
        self._reload()
        return [(identity.name, identity.role, source) for _, identity, source in self._by_digest.values()]

    def create(self, name: str, role: Role) -> str:
        """A new token: written to the tokens file (kept in memory only without one)."""
        if any(existing == name for existing, _, _ in self.entries()):
            raise ValueError(f"a token named {name!r} already exists; pick another name")
        if self.path is None:
            entry = _new_entry(name, role)
            self._memory.append(entry)
            self._rebuild()
            return entry["token"]
        token = add_token(str(self.path), name=name, role=role)
        self._reload(force=True)
        return token

    def revoke(self, name: str) -> bool:
        """Revoke at once; False if no such token. Environment tokens cannot be revoked here."""
        source = next((source for n, _, source in self.entries() if n == name), None)
        if source is None:
            return False
        if source == "env":
            raise PermissionError(f"token {name!r} comes from {ENV_VAR}; remove it there and restart")
        if source == "memory":
            self._memory = [entry for entry in self._memory if entry["name"] != name]
            self._rebuild()
            return True
        removed = revoke_token(str(self.path), name=name)
        self._reload(force=True)
        return removed
