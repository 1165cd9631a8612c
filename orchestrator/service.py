"""The orchestrator as a process: `serve` opens a run directory and serves its app until stopped.

Called by `decentrl orchestrator` (decentrl/cli/main.py), which only parses its arguments.
`serve` builds everything the app needs from the run's config: the tokens (RUN_DIR/tokens.json
and env DECENTRL_TOKENS), the journal (RUN_DIR/journal.sqlite, from which RunState recovers a
crashed run), the task and tokenizer, the verifier when verification is enabled, the store (an
announced version must exist in it); then tunes the garbage collector and runs the app
(orchestrator/app.py) on uvloop where it installs, until SIGINT or SIGTERM (stopped within 2 s).
A journal failure stops the process: a restart recovers what was committed.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal

from aiohttp import web

from decentrl.config import RunConfig
from decentrl.model.build import build_model, load_text_tokenizer
from decentrl.store.checkpoints import CheckpointStore
from decentrl.tasks import build_task
from orchestrator.app import create_app
from orchestrator.auth import ENV_VAR, TokenRegistry
from orchestrator.journal import Journal, JournalError, JournalMismatch
from orchestrator.protocol import OrchestratorRunner
from orchestrator.state import RunState
from orchestrator.verify import Verifier

log = logging.getLogger("decentrl.orchestrator")
STOP_S = 1.0  # the most a request may hold up a stop (SIGTERM ends the process within 2 s)


class StartupError(Exception):
    """The run directory or config cannot be served (a broken tokens file, a journal of another
    run); the message says what to fix."""


def tune_gc() -> None:
    """Fewer cyclic garbage collections for a long-running service.

    The buffer holds many container objects (token lists) that are never part of a cycle, and
    every full collection walks all of them: freeze what startup built and collect less often
    (about a tenth less CPU per rollout under load; docs/api.md). Also called by
    benchmarks/ingest.py, to measure what `serve` runs.
    """
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 50, 100)


def open_tokens(run_dir: str, tokens_file: str | None) -> TokenRegistry:
    """The tokens file (default RUN_DIR/tokens.json) and the environment's tokens."""
    try:
        return TokenRegistry.from_file(tokens_file or os.path.join(run_dir, "tokens.json"), env=os.environ.get(ENV_VAR))
    except (FileNotFoundError, ValueError, KeyError) as exc:
        raise StartupError(str(exc)) from None


def open_state(config: RunConfig, run_dir: str) -> RunState:
    """The run's state, recovered from RUN_DIR/journal.sqlite when orchestrator.journal is on."""
    try:
        journal = None
        if config.orchestrator.journal:
            os.makedirs(run_dir, exist_ok=True)
            journal = Journal(
                os.path.join(run_dir, "journal.sqlite"), run_name=config.run_name, sync=config.orchestrator.journal_sync
            )
        return RunState(config=config, task=build_task(config.task), tokenizer=load_text_tokenizer(config.model),
                        journal=journal)
    except (JournalMismatch, JournalError, ValueError) as exc:
        raise StartupError(str(exc)) from None


def build_verifier(config: RunConfig, run_dir: str) -> Verifier | None:
    """The logprob spot-checker, when orchestrator.verification is enabled; its models are built
    from the run's model config at startup (orchestrator/verify.py)."""
    if not config.orchestrator.verification.enabled:
        return None
    return Verifier(
        config.orchestrator.verification, store=CheckpointStore.from_config(config.store, run_name=config.run_name),
        cache_dir=os.path.join(run_dir, "verifier-cache"), build=lambda: build_model(config.model),
        run_seed=config.seed if config.deterministic else None,
    )


def _event_loop() -> asyncio.AbstractEventLoop | None:
    """uvloop's event loop where it installs (Linux, macOS), else None: aiohttp's default."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop()


async def _run(app: web.Application, host: str, port: int) -> None:
    """Serve `app` until SIGINT or SIGTERM, then stop within STOP_S: the long-polls answer at once
    (orchestrator/appstate.py, `stop_waiting`) and any other request still running after that is
    cancelled, so a supervisor's SIGTERM never waits for batch_wait_s."""
    runner = OrchestratorRunner(app, access_log=None, shutdown_timeout=STOP_S)
    await runner.setup()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    try:
        await web.TCPSite(runner, host, port).start()
        log.info("serving on http://%s:%d", host, runner.addresses[0][1])
        await stop.wait()
        log.info("stopping")
    finally:
        await runner.cleanup()


def serve(config: RunConfig, *, run_dir: str, host: str | None = None, port: int | None = None,
          tokens_file: str | None = None) -> bool:
    """Serve the run until SIGINT or SIGTERM. Returns False when it stopped because the journal
    failed; raises StartupError when it cannot start. `config.store.url` must be resolved."""
    tokens = open_tokens(run_dir, tokens_file)
    state = open_state(config, run_dir)
    failed: list[BaseException] = []

    def on_fatal(exc: BaseException) -> None:
        """The journal failed: stop serving; a restart recovers what was committed."""
        log.critical("journal failed (%s): shutting down so that a restart recovers from the journal", exc)
        failed.append(exc)
        os.kill(os.getpid(), signal.SIGTERM)

    tune_gc()
    app = create_app(
        state=state, tokens=tokens, store_url=config.store.url, on_fatal=on_fatal,
        verifier=build_verifier(config, run_dir), store=CheckpointStore.from_config(config.store),
    )
    where = (host or config.orchestrator.host, config.orchestrator.port if port is None else port)
    loop = _event_loop() or asyncio.new_event_loop()
    try:
        loop.run_until_complete(_run(app, *where))
    finally:
        loop.close()
    state.journal.close()
    return not failed
