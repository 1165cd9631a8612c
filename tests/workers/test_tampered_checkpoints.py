"""Tampered checkpoints against the worker's real pull-and-swap path, on file:// and on S3 (moto).

A real orchestrator (aiohttp on loopback) announces each version; the worker's own `versions`
thread hears of it (its GET /v1/version long-poll) and its swapper thread pulls it through
`CheckpointStore` (signed, run-bound) and swaps it into the hf backend. Every tampered version
must be refused and skipped: the swapper stays alive, the admission gate open, the model exactly
the last good version's, generation goes on - and a good version published after all of them
still loads.
"""

from __future__ import annotations

import json
import os
import struct
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from decentrl.api.wire import SamplingParams
from decentrl.config import StoreConfig, TinyModelConfig, WorkerConfig
from decentrl.model.build import build_model, build_tiny_tokenizer
from decentrl.store import signing
from decentrl.store.checkpoints import MANIFEST_NAME, CheckpointStore, signed_payload, version_dirname
from decentrl.store.signing import load_private_key, write_keypair
from decentrl.store.weights import write_hf_dir
from tests.core.test_store_s3 import endpoint, new_bucket_url  # noqa: F401 - the moto fixture
from tests.workers.test_worker import TINY, TRAINER, WORKER, Orchestrator, run_config
from workers.backends.hf import HFBackend
from workers.worker import Worker

pytestmark = pytest.mark.integration  # a real orchestrator on loopback, a real S3 protocol server (moto)

RUN = "worker-test"  # run_config's run_name


class Harness:
    def __init__(self, tmp: str, url: str, options: dict[str, object] | None) -> None:
        self.tmp = tmp
        write_keypair(os.path.join(tmp, "trainer.key"), os.path.join(tmp, "trainer.pub"))
        self.key = load_private_key(os.path.join(tmp, "trainer.key"))
        self.options = options
        self.store = CheckpointStore(url, options, signing_key=self.key, run_name=RUN)
        self.orchestrator = Orchestrator(run_config(), url)
        self.orchestrator.start()
        self.trainer = self.orchestrator.client(TRAINER)
        self.models: dict[int, torch.nn.Module] = {}

    def directory(self, version: int, seed: int, edit: Callable[[dict[str, torch.Tensor]], None] | None = None) -> str:
        """An HF directory as the trainer writes it; `edit` changes the state dict before it is written."""
        model = build_model(TinyModelConfig(**{k: v for k, v in TINY.items() if k != "type"}, seed=seed)).eval()
        self.models[version] = model
        state = {name: tensor.clone() for name, tensor in model.state_dict().items()}
        if edit is not None:
            edit(state)
        directory = tempfile.mkdtemp(dir=self.tmp)
        build_tiny_tokenizer().save_pretrained(directory)
        model.generation_config.save_pretrained(directory)
        write_hf_dir(directory, state, model.config, extras_from=directory)
        return directory

    def publish(self, version: int, directory: str, store: CheckpointStore | None = None) -> None:
        (store or self.store).publish(version, directory, parent=version - 1 if version else None)

    def manifest(self, version: int) -> dict[str, Any]:
        return json.loads(self.store.fs.cat_file(f"{self.store.root}/{version_dirname(version)}/{MANIFEST_NAME}"))

    def write(self, version: int, name: str, data: bytes) -> None:
        self.store.fs.pipe_file(f"{self.store.root}/{version_dirname(version)}/{name}", data)

    def resign(self, version: int, manifest: dict[str, Any]) -> None:
        """The trainer's key signs an edited manifest: it verifies, so only parsing or loading can refuse it."""
        manifest["signature"] = signing.sign(self.key, signed_payload(manifest))
        self.write(version, MANIFEST_NAME, json.dumps(manifest).encode())

    def worker(self) -> Worker:
        """A worker reading the store the orchestrator announces, with the trainer's public key."""
        store = StoreConfig(storage_options=self.options or {}, public_key=os.path.join(self.tmp, "trainer.pub"))
        return Worker(
            WorkerConfig(groups_per_request=1, version_poll_s=0.1), worker_id="w0", cache_dir=os.path.join(self.tmp, "cache"),
            client=self.orchestrator.client(WORKER, max_wait_s=1.0), backend=HFBackend(seed=0), store=store,
        )

    def stop(self) -> None:
        if self.orchestrator.runner is not None:
            self.orchestrator.stop()
        self.orchestrator.loop.call_soon_threadsafe(self.orchestrator.loop.stop)


@pytest.fixture(params=["file", "s3"])
def harness(request: pytest.FixtureRequest, tmp_path: Any) -> Iterator[Harness]:
    if request.param == "file":
        made = Harness(str(tmp_path), f"file://{tmp_path}/store", None)
    else:
        url = new_bucket_url(request.getfixturevalue("endpoint"))
        options = {"key": "testing", "secret": "testing",
                   "client_kwargs": {"endpoint_url": request.getfixturevalue("endpoint"), "region_name": "us-east-1"}}
        made = Harness(str(tmp_path), url, options)
    try:
        yield made
    finally:
        made.stop()


def wait_until(done: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def weights_equal(model: torch.nn.Module, reference: torch.nn.Module) -> bool:
    ours = model.state_dict()
    return all(torch.equal(ours[name], tensor) for name, tensor in reference.state_dict().items())


def header_bomb() -> bytes:
    return struct.pack("<Q", 2**62) + b"{}"


def malformed_header() -> bytes:
    return struct.pack("<Q", 16) + b"{not json at all" + bytes(64)


def test_tampered_versions_are_refused_and_the_worker_generates_on(harness: Harness, tmp_path: Any) -> None:
    h = harness
    h.publish(0, h.directory(0, seed=0))
    h.trainer.announce(0)
    worker = h.worker()
    swapper = threading.Thread(target=worker._swapper, name="swapper", daemon=True)
    swapper.start()
    threading.Thread(target=worker._watch, name="versions", daemon=True).start()
    wait_until(lambda: worker.backend.version == 0, "version 0 loaded")
    sampling = SamplingParams(temperature=1.0, max_tokens=4)

    def shard_edit(edit: Callable[[dict[str, torch.Tensor]], None]) -> Callable[[int], None]:
        return lambda v: h.publish(v, h.directory(v, seed=v, edit=edit))

    def planted_file(data: bytes) -> Callable[[int], None]:
        def publish(v: int) -> None:  # a weight file that the signed manifest lists, but that is not safetensors
            directory = h.directory(v, seed=v)
            with open(os.path.join(directory, "model.safetensors"), "wb") as f:
                f.write(data)
            h.publish(v, directory)
        return publish

    def manifest_edit(edit: Callable[[dict[str, Any]], None], *, sign: bool) -> Callable[[int], None]:
        def publish(v: int) -> None:
            h.publish(v, h.directory(v, seed=v))
            manifest = h.manifest(v)
            edit(manifest)
            if sign:
                h.resign(v, manifest)
            else:
                h.write(v, MANIFEST_NAME, json.dumps(manifest).encode())
        return publish

    def raw_manifest(data: bytes) -> Callable[[int], None]:
        def publish(v: int) -> None:
            h.publish(v, h.directory(v, seed=v))
            h.write(v, MANIFEST_NAME, data)
        return publish

    def flipped_byte(v: int) -> None:
        h.publish(v, h.directory(v, seed=v))
        data = bytearray(h.store.fs.cat_file(f"{h.store.root}/{version_dirname(v)}/model.safetensors"))
        data[-3] ^= 0xFF
        h.write(v, "model.safetensors", bytes(data))

    def oversize(v: int) -> None:  # the object replaced by one 20x its declared size
        h.publish(v, h.directory(v, seed=v))
        size = len(h.store.fs.cat_file(f"{h.store.root}/{version_dirname(v)}/model.safetensors"))
        h.write(v, "model.safetensors", os.urandom(20 * size))

    def unsigned(v: int) -> None:
        h.publish(v, h.directory(v, seed=v), CheckpointStore(h.store.url, h.options))

    def other_run(v: int) -> None:  # the same trainer key, another run
        h.publish(v, h.directory(v, seed=v), CheckpointStore(h.store.url, h.options, signing_key=h.key, run_name="other"))

    def drop_first(state: dict[str, torch.Tensor]) -> None:
        del state[sorted(state)[0]]

    def reshape_first(state: dict[str, torch.Tensor]) -> None:
        name = sorted(state)[0]
        state[name] = torch.zeros(state[name].shape[0] + 1, *state[name].shape[1:])

    def add_tensor(state: dict[str, torch.Tensor]) -> None:
        state["planted.weight"] = torch.zeros(2, 2)

    def cast_first(state: dict[str, torch.Tensor]) -> None:
        name = sorted(state)[0]
        state[name] = state[name].double()

    cases: dict[str, Callable[[int], None]] = {
        "safetensors header-size bomb": planted_file(header_bomb()),
        "malformed safetensors header": planted_file(malformed_header()),
        "tensor of the wrong shape": shard_edit(reshape_first),
        "tensor of the wrong dtype": shard_edit(cast_first),
        "missing tensor": shard_edit(drop_first),
        "unexpected tensor": shard_edit(add_tensor),
        "files: []": manifest_edit(lambda m: m.update(files=[]), sign=True),
        "NUL in a file name": manifest_edit(lambda m: m["files"][0].update(path="model\x00.safetensors"), sign=True),
        "version: true": manifest_edit(lambda m: m.update(version=True), sign=True),
        "non-ASCII signature": manifest_edit(lambda m: m.update(signature="ed25519:" + "é" * 86 + "=="), sign=False),
        "JSON nested 100k deep": raw_manifest(b"[" * 100_000 + b"]" * 100_000),
        "manifest of 2 MiB": raw_manifest(b" " * (2 * 1024 * 1024) + b"{}"),
        "flipped byte": flipped_byte,
        "object larger than declared": oversize,
        "unsigned": unsigned,
        "signed for another run": other_run,
    }
    for version, (case, publish) in enumerate(cases.items(), start=1):
        publish(version)
        h.trainer.announce(version)
        wait_until(lambda v=version: v in worker.refused, f"{case}: version {version} refused")
        assert swapper.is_alive(), case
        assert not worker._batcher.paused, f"{case}: generation left paused"
        assert worker.backend.version == 0, case
        model = worker.backend.model
        assert model is not None and weights_equal(model, h.models[0]), f"{case}: the model's weights changed"
        # Generation goes on with the last good weights, in this thread as in a slot.
        samples = worker._generate([[1, 2, 3]], sampling)
        assert samples[0].versions and set(samples[0].versions) == {0}, case
    assert len(worker.refused) == len(cases)

    good = len(cases) + 1
    h.publish(good, h.directory(good, seed=good))
    h.trainer.announce(good)
    wait_until(lambda: worker.backend.version == good, "a good version after the tampered ones")
    assert weights_equal(worker.backend.model, h.models[good])  # type: ignore[arg-type]
    # What failed verification never reached the cache (what verified but did not load may sit there, unused).
    cached = set(os.listdir(os.path.join(h.tmp, "cache")))
    for version, case in enumerate(cases, start=1):
        if case in ("flipped byte", "object larger than declared", "unsigned", "signed for another run"):
            assert version_dirname(version) not in cached, case
    worker.request_stop()
    swapper.join(timeout=10)
    assert not swapper.is_alive()


@pytest.mark.parametrize("declared", [200_000, 1_300_000], ids=["streamed", "ranged"])
def test_an_s3_object_larger_than_declared_is_not_downloaded_in_full(
    endpoint: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch, declared: int  # noqa: F811 - the moto fixture
) -> None:
    """An entry replaced by a 26 MB object. Streamed (256 KiB or less): each of the 3 attempts
    stops a byte or two past the declared size (the ranged GETs ask for no more), instead of reading
    26 MB three times. Ranged (larger): the object's size is checked before a byte is fetched."""
    import s3fs

    monkeypatch.setattr("decentrl.store.checkpoints._RETRY_DELAYS", (0.0, 0.0))
    options = {"key": "testing", "secret": "testing", "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"}}
    store = CheckpointStore(new_bucket_url(endpoint), options)
    src = tmp_path / "src"
    src.mkdir()
    (src / "model.safetensors").write_bytes(os.urandom(declared))
    store.publish(0, str(src))
    store.fs.pipe_file(f"{store.root}/v000000/model.safetensors", os.urandom(26 * 1024 * 1024))
    fetched: list[int] = []
    real = s3fs.core.S3File._fetch_range

    def counting(self: Any, start: int, end: int) -> bytes:
        data = real(self, start, end)
        fetched.append(len(data))
        return data

    monkeypatch.setattr(s3fs.core.S3File, "_fetch_range", counting)
    assert store.ranged is not None
    real_chunks = store.ranged.chunks
    store.ranged.chunks = lambda *a: fetched.append(-1) or real_chunks(*a)
    with pytest.raises(Exception, match="size mismatch"):
        store.pull(0, str(tmp_path / "cache"))
    if declared <= 256 * 1024:  # one read of declared + 1 bytes, and fsspec's read-ahead of a block of one
        assert len(fetched) == 3 and max(fetched) <= declared + 2, fetched
    else:
        assert fetched == []
