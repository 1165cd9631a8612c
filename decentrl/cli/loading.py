"""The run config as every command reads it: a TOML file (or a run's config.json) with `--set`
overrides, or exit 2 with one line naming the bad key. Its own module so that the command groups
(main.py, model.py) share it without importing each other."""

from __future__ import annotations

from collections.abc import Sequence

import typer

from decentrl.config import ConfigError, RunConfig, load_config


def load_run_config(path: str | None, overrides: Sequence[str] | None = None) -> RunConfig:
    """The run config at `path` (None: the defaults) with `--set` overrides; exit 2 naming the bad key."""
    try:
        return load_config(path, overrides or ())
    except ConfigError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
