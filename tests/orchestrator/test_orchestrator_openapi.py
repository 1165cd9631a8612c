"""/openapi.json describes every route, and schemathesis finds no server error against the live app.

The app runs on loopback in a background thread (its own event loop, a real journal in a temp
dir, a real file:// store holding version 0); schemathesis generates requests from the served
description, valid and invalid, once with each token role (worker, trainer, admin) and once with
none, and checks every answer: never a 5xx, each status, content type and body as described, and
a 401/403 wherever the role may not call the route. EXAMPLES per route, mode and role keeps the
run to a few minutes in CI; DECENTRL_SCHEMATHESIS_EXAMPLES=N runs N each (issue 21's long run).
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from aiohttp import web
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)
from schemathesis.generation import GenerationMode
from transformers import PreTrainedTokenizerBase

from decentrl.store.checkpoints import CheckpointStore
from decentrl.tasks import build_task
from orchestrator.app import ROUTES, create_app, openapi_spec
from orchestrator.auth import TokenRegistry
from orchestrator.journal import Journal
from orchestrator.protocol import OrchestratorRunner
from orchestrator.state import RunState

WORKER, TRAINER, ADMIN = "worker-token-0123456789", "trainer-token-0123456789", "admin-token-0123456789"
TOKENS = [
    {"name": "alice", "role": "worker", "token": WORKER},
    {"name": "trainer", "role": "trainer", "token": TRAINER},
    {"name": "root", "role": "admin", "token": ADMIN},
]
ROLE_TOKEN = {"worker": WORKER, "trainer": TRAINER, "admin": ADMIN}
EXAMPLES = int(os.environ.get("DECENTRL_SCHEMATHESIS_EXAMPLES", "8"))  # per route, mode and role


class LiveServer:
    """The app on 127.0.0.1:<free port>, served by an event loop in a daemon thread."""

    def __init__(self, app: web.Application) -> None:
        self.app = app
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.url = ""
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.runner = OrchestratorRunner(self.app)
        self.loop.run_until_complete(self.runner.setup())
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"
        self.ready.set()
        self.loop.run_forever()
        self.loop.run_until_complete(self.runner.cleanup())
        self.loop.close()

    def __enter__(self) -> LiveServer:
        self.thread.start()
        assert self.ready.wait(30), "the app did not start"
        return self

    def __exit__(self, *_: object) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory, tokenizer: PreTrainedTokenizerBase) -> Iterator[LiveServer]:
    from decentrl.config import parse_config

    config = parse_config(
        {
            "run_name": "unit", "group_size": 3, "trainer_ranks": 1,
            "model": {"type": "tiny", "hidden_size": 32, "num_layers": 1, "num_heads": 2, "intermediate_size": 64},
            "task": {"type": "sorting", "num_digits": 4, "num_prompts": 64},
            "sampling": {"temperature": 1.0, "max_tokens": 6},
            "orchestrator": {"batch_wait_s": 0.05, "rate_limit_per_s": 0, "max_buffer_groups": 64},
            "trainer": {"groups_per_step": 2},
        },
        "unit",
    )
    run_dir: Path = tmp_path_factory.mktemp("openapi-run")
    journal = Journal(str(run_dir / "journal.sqlite"), run_name=config.run_name)
    state = RunState(config=config, task=build_task(config.task), tokenizer=tokenizer, journal=journal)
    version_files = run_dir / "v0-files"
    version_files.mkdir()
    (version_files / "config.json").write_text("{}")
    store = CheckpointStore(str(run_dir / "store"))
    store.publish(0, str(version_files))
    state.announce(0)
    tokens_file = run_dir / "tokens.json"
    tokens_file.write_text('{"tokens": []}')
    registry = TokenRegistry(path=str(tokens_file), env_entries=TOKENS)
    with LiveServer(create_app(state=state, tokens=registry, store_url=store.url, store=store)) as server:
        yield server
    journal.close()


def test_every_route_is_described(live: LiveServer) -> None:
    import json
    import urllib.request

    spec = json.loads(urllib.request.urlopen(f"{live.url}/openapi.json", timeout=10).read())
    described = {(method.upper(), path) for path, ops in spec["paths"].items() for method in ops}
    registered = {
        (route.method, route.resource.canonical)
        for route in live.app.router.routes()
        if route.method != "HEAD" and route.resource is not None
    }
    assert registered == described
    assert len(described) == len(ROUTES)
    for path, ops in spec["paths"].items():
        for method, op in ops.items():
            assert op["summary"] and "200" in op["responses"] or "201" in op["responses"], (method, path)
            if op["security"]:
                assert {"401", "403"} <= op["responses"].keys(), (method, path)
            if "requestBody" in op:
                assert {"400", "413", "415"} <= op["responses"].keys(), (method, path)
    rollout = spec["components"]["schemas"]["Rollout"]
    assert {"rollout_id", "lease_id", "completion_token_ids", "logprobs"} <= rollout["properties"].keys()


# Built at collection time from the same route table the app serves (the pytest plugin of
# schemathesis does not support this pytest); each operation and mode is one test.
SCHEMA = schemathesis.openapi.from_dict(openapi_spec())
OPERATIONS = {op.ok().label: op.ok() for op in SCHEMA.get_all_operations()}


@pytest.mark.parametrize("role", ["worker", "trainer", "admin", "none"])
@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=["valid", "invalid"])
@pytest.mark.parametrize("label", sorted(OPERATIONS))
def test_no_server_error_on_generated_requests(live: LiveServer, label: str, mode: GenerationMode, role: str) -> None:
    operation = OPERATIONS[label]
    if mode is GenerationMode.NEGATIVE and not (operation.body or any(True for _ in operation.iter_parameters())):
        pytest.skip("takes no input: nothing to make invalid")
    roles = next(spec.roles for spec, _ in ROUTES if spec.method == operation.method.upper() and spec.path == operation.path)
    if roles is None and role != "none":
        pytest.skip("needs no token: the run without one covers it")
    headers = {"Authorization": f"Bearer {ROLE_TOKEN[role]}"} if role != "none" else {}
    allowed = roles is None or role in roles
    calls = []

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True, database=None)
    def check(case: Any) -> None:
        wait_s = (case.query or {}).get("wait_s") if label in ("GET /v1/version", "GET /v1/verdicts") else None
        if isinstance(wait_s, (int, float)) and not isinstance(wait_s, bool) and 0.2 < wait_s <= 60:
            case.query["wait_s"] = 0.2  # a valid wait of a long-poll would outlast the call's timeout
        response = case.call(base_url=live.url, headers=headers, timeout=10)
        calls.append(response.status_code)
        assert response.status_code < 500, f"{case.method} {case.formatted_path}: {response.status_code} {response.text}"
        for token in ROLE_TOKEN.values():
            assert token not in response.text
        if not allowed:
            # Auth comes first: whatever the request, the answer is only that the caller may not
            # (401 where invalid generation dropped or garbled the Authorization header itself).
            expected = {401} if role == "none" else {403} if mode is GenerationMode.POSITIVE else {401, 403}
            assert response.status_code in expected, response.text
            case.validate_response(response, checks=[not_a_server_error, status_code_conformance,
                                                     content_type_conformance, response_schema_conformance])
        elif mode is GenerationMode.POSITIVE:
            # Valid requests: the answer matches the description (status, content type, schema).
            case.validate_response(response, checks=[not_a_server_error, status_code_conformance,
                                                     content_type_conformance, response_schema_conformance])
        else:
            case.validate_response(response, checks=[not_a_server_error, status_code_conformance])

    check()
    assert calls, "no request was generated"
