"""`decentrl` command line: one thin command per role, plus `run`, `store` (decentrl/cli/store.py)
and `token`.

Each command parses its config and calls one function; torch, transformers and aiohttp are
imported inside commands so `decentrl --help` stays fast. Settings come from the run config
(decentrl/config/), changed on the command line with `--set key=value`; flags are kept for
what is not a run setting: where to connect, with which token, and where this process keeps
its files.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Annotated

import typer

from decentrl.cli.loading import load_run_config
from decentrl.cli.model import model_app
from decentrl.cli.store import store_app
from decentrl.config import RunConfig, StoreConfig

# rich_markup_mode=None: help texts are plain text, so "[sampling]" or "decentrl[wandb]" stay as
# written (rich markup would take them for style tags and drop them).
app = typer.Typer(
    no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False, rich_markup_mode=None,
    help="Decentralized asynchronous RL for language models.")
token_app = typer.Typer(no_args_is_help=True, rich_markup_mode=None, help="Manage the orchestrator's bearer tokens.")
app.add_typer(store_app, name="store")
app.add_typer(token_app, name="token")
app.add_typer(model_app, name="model")

ConfigArg = Annotated[str, typer.Argument(help="Run config: a TOML file from configs/ or a resolved config.json.")]
TokenOpt = Annotated[str, typer.Option(envvar="DECENTRL_TOKEN", help="Bearer token (or env DECENTRL_TOKEN).")]
SetOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--set", metavar="KEY=VALUE",
        help="Override one config setting by its dotted key (repeatable), e.g. --set worker.concurrency=4 "
        "--set trainer.lr=1e-4; a value is read as TOML (4, 1e-4, true, [1, 2]), else as text (cuda:0, s3://b/run).",
    ),
]


def _setup_logging(role: str) -> None:
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s {role} %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)


def _resolve_store(config: RunConfig, run_dir: str) -> RunConfig:
    """An empty store URL means the run dir's own checkpoints folder."""
    if config.store.url:
        return config
    return config.with_store_url(os.path.abspath(os.path.join(run_dir, "checkpoints")))


@app.command()
def orchestrator(
    config: ConfigArg,
    run_dir: Annotated[str, typer.Option(help="Run directory (tokens file, journal.sqlite, default store).")] = ".",
    host: Annotated[str | None, typer.Option(help="Overrides orchestrator.host.")] = None,
    port: Annotated[int | None, typer.Option(help="Overrides orchestrator.port.")] = None,
    tokens_file: Annotated[str | None, typer.Option(help="Tokens JSON; default RUN_DIR/tokens.json.")] = None,
    overrides: SetOpt = None,
) -> None:
    """Serve the run's HTTP API: leases, rollout ingest, batches, versions (docs/api.md).

    With orchestrator.journal (the default) every acknowledged rollout, lease and version is
    journaled in RUN_DIR/journal.sqlite; run the same command again after a crash and it
    recovers. Tokens come from the tokens file and from env DECENTRL_TOKENS (name:role:token,...).
    """
    _setup_logging("orchestrator")
    from orchestrator.app import StartupError, serve

    cfg = _resolve_store(load_run_config(config, overrides), run_dir)
    try:
        served_to_the_end = serve(cfg, run_dir=run_dir, host=host, port=port, tokens_file=tokens_file)
    except StartupError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    if not served_to_the_end:  # the journal failed: a restart recovers what was committed
        raise typer.Exit(1)


@app.command()
def worker(
    orchestrator_url: Annotated[str, typer.Option("--orchestrator", help="Orchestrator URL, e.g. http://host:8740.")],
    token: TokenOpt,
    config: Annotated[
        str | None,
        typer.Option(help="Run config (TOML, or the config.json of a run dir): its worker, store and simulation "
                     "sections. Default: the built-in defaults; the run itself comes from the orchestrator."),
    ] = None,
    overrides: SetOpt = None,
    worker_id: Annotated[str | None, typer.Option(help="Stable worker name; default host-pid.")] = None,
    cache_dir: Annotated[str, typer.Option(help="Local cache of pulled versions.")] = "~/.cache/decentrl",
    spool_dir: Annotated[str | None, typer.Option(help="Unacknowledged rollouts; default CACHE_DIR/spool/WORKER_ID.")] = None,
) -> None:
    """Generate rollouts for a run: needs only the orchestrator URL and a worker token.

    Settings are the config's worker section (backend, device, slots, swap deadline; see
    docs/workers.md), e.g. --set worker.backend=openai --set worker.openai.url=http://127.0.0.1:8000
    --set worker.openai.model=NAME, or --set store.public_key=trainer.pub to refuse unsigned versions.
    """
    _setup_logging("worker")
    from workers.lease_loop import default_id
    from workers.main import run_worker

    cfg = load_run_config(config, overrides)
    run_worker(
        cfg, orchestrator_url=orchestrator_url, token=token, worker_id=worker_id or default_id(),
        cache_dir=os.path.expanduser(cache_dir), spool_dir=spool_dir,
    )


@app.command()
def scorer(
    orchestrator_url: Annotated[str, typer.Option("--orchestrator", help="Orchestrator URL, e.g. http://host:8740.")],
    token: TokenOpt,
    config: Annotated[
        str | None,
        typer.Option(help="Run config (TOML, or the config.json of a run dir): its [scorer] section. Without one, "
                     "give the backend with --set scorer.type=... and its keys."),
    ] = None,
    overrides: SetOpt = None,
    scorer_id: Annotated[str | None, typer.Option(help="Stable scorer name; default host-pid.")] = None,
) -> None:
    """Score samples for a run with a reward model, an LLM judge or a function; needs a scorer token.

    The backend is the config's [scorer] section (docs/rewards.md, "Scorer backends"), e.g.
    --set scorer.type=hf --set scorer.path=DIR --set scorer.device=cuda, or --set scorer.type=openai
    --set scorer.base_url=http://127.0.0.1:8000/v1 --set scorer.model=NAME --set scorer.api_key_env=OPENAI_API_KEY.
    """
    _setup_logging("scorer")
    from workers.lease_loop import default_id
    from workers.scorer import run_scorer
    from workers.scorers import BackendConfigError

    cfg = load_run_config(config, overrides)
    if cfg.scorer is None:
        typer.echo("error: no [scorer] section: add one to the config, or --set scorer.type=hf|openai|python "
                   "with its keys (docs/rewards.md)", err=True)
        raise typer.Exit(2)
    try:
        run_scorer(cfg.scorer, orchestrator_url=orchestrator_url, token=token, scorer_id=scorer_id or default_id())
    except BackendConfigError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None


@app.command()
def trainer(
    config: ConfigArg,
    orchestrator_url: Annotated[str, typer.Option("--orchestrator", help="Orchestrator URL.")],
    token: TokenOpt,
    overrides: SetOpt = None,
    run_dir: Annotated[
        str, typer.Option(help="Run directory: metrics.jsonl, cache, default store, trainer/ (checkpoints to resume from).")
    ] = ".",
) -> None:
    """Train with FSDP2; launch under torchrun for several ranks (gloo on CPU, NCCL on GPU).

    Run the same command again after a crash: it resumes from the last checkpoint in RUN_DIR/trainer.
    """
    _setup_logging(f"trainer[{os.environ.get('RANK', '0')}]")
    from decentrl.trainer.train import TrainerOptions, train

    cfg = _resolve_store(load_run_config(config, overrides), run_dir)
    if cfg.policies and cfg.trainer.policy is None:
        typer.echo(f"error: this run has two policies {list(cfg.policies)}: set trainer.policy (--set trainer.policy=...)", err=True)
        raise typer.Exit(2)
    suffix = f"-{cfg.trainer.policy}" if cfg.trainer.policy else ""  # a run of two policies: a trainer's own files
    options = TrainerOptions(
        orchestrator_url=orchestrator_url,
        token=token,
        metrics_path=os.path.join(run_dir, f"metrics{suffix}.jsonl"),
        cache_dir=os.path.join(run_dir, "cache", f"trainer{suffix}"),
        state_dir=os.path.join(run_dir, f"trainer{suffix}"),
    )
    from decentrl.model.build import ModelPathError
    from decentrl.trainer.distributed import PeerLost

    try:
        train(cfg, options)
    except ModelPathError as exc:  # the model directory is not on this machine: one line, not a traceback
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    except PeerLost as exc:  # the other trainer nodes are gone: what happened and what to do, not a traceback
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(3) from None


@app.command()
def run(
    config: ConfigArg,
    overrides: SetOpt = None,
    run_dir: Annotated[str | None, typer.Option(help="Run directory; default runs/NAME-TIMESTAMP.")] = None,
) -> None:
    """Start every role locally as separate processes and show live progress until done.

    The config, with any --set applied, is resolved into RUN_DIR/config.json, which every role reads.
    """
    from decentrl.cli.launch import launch

    raise typer.Exit(launch(load_run_config(config, overrides), run_dir))


@app.command()
def status(
    url: Annotated[str, typer.Argument(help="The orchestrator's URL, e.g. http://host:8400.")],
    token: TokenOpt,
    as_json: Annotated[bool, typer.Option("--json", help="Print GET /v1/status as JSON instead.")] = False,
) -> None:
    """Print a run's state (versions, counters, workers by token name); any token will do."""
    from decentrl.cli.status import print_status

    raise typer.Exit(print_status(url, token, as_json=as_json))


@app.command("eval")
def evaluate(
    config: ConfigArg,
    overrides: SetOpt = None,
    store_url: Annotated[
        str | None, typer.Option("--store", help="Store URL; default the config's store.url (or RUN_DIR/checkpoints).")
    ] = None,
    run_dir: Annotated[str | None, typer.Option(help="The run's directory, for a config whose store.url is empty.")] = None,
    version: Annotated[int | None, typer.Option(min=0, help="Version; default the newest.")] = None,
    prompts: Annotated[int, typer.Option(min=1, help="Prompts evaluated.")] = 512,
    samples: Annotated[int, typer.Option(min=1, help="Samples per prompt (1 with --greedy).")] = 4,
    split: Annotated[str, typer.Option(help="heldout (the task reseeded, minus training prompts) or train.")] = "heldout",
    greedy: Annotated[bool, typer.Option(help="Greedy decoding instead of the run's [sampling].")] = False,
    seed: Annotated[int, typer.Option(min=0, help="Seed of the prompt choice and of sampling.")] = 0,
    cache_dir: Annotated[str, typer.Option(help="Local cache of pulled versions.")] = "~/.cache/decentrl",
) -> None:
    """Score a published version on held-out prompts with the task's reward; prints one JSON line.

    Reads the config's task, sampling and store sections (store.public_key: refuse unsigned
    versions) and generates on worker.device in worker.compute_dtype; e.g. --set worker.device=cuda --set
    store.public_key=trainer.pub.
    """
    import json

    from transformers.utils import logging as hf_logging

    from decentrl.store.checkpoints import StoreError
    from decentrl.tasks.prompts import PromptError
    from workers.evaluate import EvalError
    from workers.evaluate import evaluate as run_eval

    if split not in ("heldout", "train"):
        typer.echo(f"error: --split must be heldout or train (got {split!r})", err=True)
        raise typer.Exit(2)
    hf_logging.disable_progress_bar()  # stdout carries the JSON line only
    loaded = load_run_config(config, overrides)
    url = store_url or loaded.store.url or (run_dir and _resolve_store(loaded, run_dir).store.url)
    if not url:
        typer.echo("error: the config's store.url is empty: pass --store URL or --run-dir RUN_DIR", err=True)
        raise typer.Exit(2)
    store = _open_store_config(loaded.store.for_reader(url), run_name=loaded.run_name)
    try:
        chosen = store.latest() if version is None else version
        if chosen is None:
            raise StoreError(f"no versions in {url}")
        local = store.pull(chosen, os.path.expanduser(cache_dir))
        result = run_eval(
            loaded, local, chosen, prompts=prompts, samples_per_prompt=samples, split=split,  # type: ignore[arg-type]
            greedy=greedy, seed=seed, device=loaded.worker.device, compute=loaded.worker.compute_dtype,
        )
    except (StoreError, EvalError, PromptError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    typer.echo(json.dumps(result.as_dict()))


def _open_store_config(config: StoreConfig, *, run_name: str):  # noqa: ANN202 - CheckpointStore, imported lazily
    """A store as a run config describes it (`decentrl eval`): its key and cache settings, and
    its run, which signed versions must name."""
    from decentrl.store.checkpoints import CheckpointStore
    from decentrl.store.signing import SigningKeyError

    try:
        return CheckpointStore.from_config(config, run_name=run_name)
    except SigningKeyError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None


AdminUrlOpt = Annotated[
    str | None, typer.Option("--orchestrator", help="Ask a running orchestrator (admin token) instead of editing --file.")
]
AdminTokenOpt = Annotated[
    str | None, typer.Option("--token", envvar="DECENTRL_ADMIN_TOKEN", help="Admin token (or env DECENTRL_ADMIN_TOKEN).")
]
TokensFileOpt = Annotated[str, typer.Option(help="Tokens file the orchestrator reads (without --orchestrator).")]


def _admin_client(url: str, token: str | None):  # noqa: ANN202 - OrchestratorClient, imported lazily
    from decentrl.api.client import OrchestratorClient

    if not token:
        typer.echo("error: --orchestrator needs an admin token: --token or env DECENTRL_ADMIN_TOKEN", err=True)
        raise typer.Exit(2)
    return OrchestratorClient(url, token, timeout_s=10.0, max_wait_s=10.0)


@contextmanager
def _token_errors() -> Iterator[None]:
    """A bad token file or an orchestrator's refusal: `error: ...` and exit code 2."""
    from decentrl.api.client import OrchestratorError

    try:
        yield
    except (ValueError, OrchestratorError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None


@token_app.command("create")
def token_create(
    name: Annotated[str, typer.Option(help="Who holds the token (worker name).")],
    role: Annotated[str, typer.Option(help="worker, trainer, scorer or admin.")] = "worker",
    file: TokensFileOpt = "tokens.json",
    orchestrator_url: AdminUrlOpt = None,
    token: AdminTokenOpt = None,
) -> None:
    """Add a token and print it (once: it is not shown again).

    Edits the tokens file directly (on the orchestrator's host; a running orchestrator sees it
    at its next request), or with --orchestrator asks the running orchestrator (admin token).
    """
    from orchestrator.auth import add_token

    with _token_errors():
        if orchestrator_url:
            typer.echo(_admin_client(orchestrator_url, token).create_token(name, role).token)
        else:
            typer.echo(add_token(file, name=name, role=role))  # type: ignore[arg-type]


@token_app.command("revoke")
def token_revoke(
    name: Annotated[str, typer.Option(help="The token's name.")],
    file: TokensFileOpt = "tokens.json",
    orchestrator_url: AdminUrlOpt = None,
    token: AdminTokenOpt = None,
) -> None:
    """Revoke a token: the orchestrator refuses it (401) from its next request on."""
    from orchestrator.auth import revoke_token

    with _token_errors():
        if orchestrator_url:
            _admin_client(orchestrator_url, token).revoke_token(name)
        elif not revoke_token(file, name=name):
            typer.echo(f"error: {file}: no token named {name!r}", err=True)
            raise typer.Exit(1)
    typer.echo(f"revoked {name}")


@token_app.command("list")
def token_list(
    file: TokensFileOpt = "tokens.json",
    orchestrator_url: AdminUrlOpt = None,
    token: AdminTokenOpt = None,
) -> None:
    """List token names and roles (never the tokens)."""
    from orchestrator.auth import list_tokens

    with _token_errors():
        if orchestrator_url:
            rows = [(e.name, e.role) for e in _admin_client(orchestrator_url, token).list_tokens().tokens]
        else:
            rows = list_tokens(file)
    for name, role in rows:
        typer.echo(f"{name}\t{role}")
