"""`decentrl store ls | pull | verify | keygen`: a store's versions inspected, pulled and checked
by hand, outside any run (decentrl/store/checkpoints.py does the work). Added to the `decentrl` command line by
decentrl/cli/main.py; as there, heavy imports happen inside the commands.
"""

from __future__ import annotations

from typing import Annotated

import typer

store_app = typer.Typer(no_args_is_help=True, rich_markup_mode=None, help="Inspect, pull and verify versioned checkpoints in a store.")

StoreUrlArg = Annotated[str, typer.Argument(help="Store URL (path, file://, s3://, ...); s3 reads the AWS environment.")]
PublicKeyOpt = Annotated[
    str | None, typer.Option(help="Trainer's ed25519 public key file: unsigned or wrongly signed versions fail.")
]
RunOpt = Annotated[
    str | None, typer.Option(help="With --public-key: the run the versions must be signed for (default: any run).")
]


def _open_store(url: str, public_key: str | None = None, run: str | None = None):  # noqa: ANN202 - CheckpointStore, imported lazily
    from decentrl.store.checkpoints import CheckpointStore
    from decentrl.store.signing import SigningKeyError, load_public_key

    try:
        return CheckpointStore(url, public_key=load_public_key(public_key) if public_key else None, run_name=run)
    except SigningKeyError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None


@store_app.command("ls")
def store_ls(url: StoreUrlArg) -> None:
    """List the published versions with their sizes."""
    from decentrl.store.checkpoints import StoreError

    store = _open_store(url)
    versions = store.versions()
    if not versions:
        typer.echo(f"no versions in {url}")
    for version in versions:
        try:
            manifest = store.manifest(version)
        except StoreError as exc:  # deleted meanwhile, or a corrupt manifest: list the rest
            typer.echo(f"v{version:06d}  error: {exc}")
            continue
        size = sum(f.size for f in manifest.files)
        signed = "signed" if manifest.signature else "unsigned"
        typer.echo(f"v{version:06d}  parent={manifest.parent}  files={len(manifest.files)}  bytes={size}  {signed}")


@store_app.command("pull")
def store_pull(
    url: StoreUrlArg,
    dest: Annotated[str, typer.Option(help="Local directory; the version lands in DEST/vNNNNNN.")],
    version: Annotated[int | None, typer.Option(min=0, help="Version; default the newest.")] = None,
    public_key: PublicKeyOpt = None,
    run: RunOpt = None,
) -> None:
    """Download a version (resuming an interrupted pull into DEST) and verify every file's digest."""
    from decentrl.store.checkpoints import StoreError

    store = _open_store(url, public_key, run)
    try:
        chosen = store.latest() if version is None else version
        if chosen is None:
            raise StoreError(f"no versions in {url}")
        typer.echo(store.pull(chosen, dest))
    except StoreError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None


@store_app.command("verify")
def store_verify(
    url: StoreUrlArg,
    version: Annotated[int | None, typer.Option(min=0, help="Version; default all.")] = None,
    public_key: PublicKeyOpt = None,
    run: RunOpt = None,
) -> None:
    """Check every file of a version (or all) against its manifest and say which digest it uses
    (blake3, or sha256 for versions published before it); non-zero exit on any mismatch."""
    from decentrl.store.checkpoints import StoreError

    store = _open_store(url, public_key, run)
    problems: list[str] = []
    try:
        versions = store.versions() if version is None else [version]
        for v in versions:
            found = store.verify(v)
            problems += found
            if not found:  # which digest: BLAKE3 for new versions, sha256 for older ones
                digests = sorted({entry.algorithm for entry in store.manifest(v).files})
                typer.echo(f"v{v:06d}  ok  ({', '.join(digests)})")
    except StoreError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    for problem in problems:
        typer.echo(problem, err=True)
    if problems:
        raise typer.Exit(1)
    typer.echo(f"ok: {len(versions)} version(s) verified")


@store_app.command("keygen")
def store_keygen(
    private_key: Annotated[str, typer.Option(help="Where to write the private key (trainer only; mode 600).")] = "decentrl-signing.key",
    public_key: Annotated[str, typer.Option(help="Where to write the public key (give it to workers).")] = "decentrl-signing.pub",
) -> None:
    """Create an ed25519 key pair for signed manifests (the trainer's store.signing_key, the workers' store.public_key)."""
    from decentrl.store.signing import SigningKeyError, write_keypair

    try:
        write_keypair(private_key, public_key)
    except SigningKeyError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    typer.echo(f"private key: {private_key}  (set store.signing_key; keep it secret)")
    typer.echo(f"public key:  {public_key}  (workers: store.public_key, e.g. --set store.public_key={public_key})")
