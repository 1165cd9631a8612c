"""What the trainer publishes: sharded HF directories, and the one-slot skip-to-newest Publisher."""

from __future__ import annotations

import json
import os
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from decentrl.config import TinyModelConfig
from decentrl.model.build import build_model
from decentrl.store.checkpoints import CheckpointStore
from decentrl.store.weights import INDEX_NAME, write_hf_dir
from decentrl.trainer.publisher import Publisher, clear_scratch


@pytest.fixture(scope="module")
def model() -> PreTrainedModel:
    return build_model(TinyModelConfig(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64))


def state_of(model: PreTrainedModel) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


def test_sharded_checkpoint_loads_with_from_pretrained(model: PreTrainedModel, tmp_path: Path) -> None:
    state = state_of(model)
    total = sum(t.numel() * t.element_size() for t in state.values())
    write_hf_dir(str(tmp_path), state, model.config, extras_from=str(tmp_path), max_shard_bytes=total // 4)
    shards = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert len(shards) >= 4 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    index = json.loads((tmp_path / INDEX_NAME).read_text())
    assert index["metadata"]["total_size"] == total
    assert set(index["weight_map"]) == set(state) and set(index["weight_map"].values()) == set(shards)
    assert all(os.path.getsize(tmp_path / s) <= total // 4 + 4096 for s in shards)  # + header

    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32)
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, state[name]), name


def test_small_checkpoint_is_one_file_without_index(model: PreTrainedModel, tmp_path: Path) -> None:
    write_hf_dir(str(tmp_path), state_of(model), model.config, extras_from=str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]


def test_publisher_skips_to_the_newest_version_when_uploads_fall_behind(
    model: PreTrainedModel, tmp_path: Path
) -> None:
    store = CheckpointStore(str(tmp_path / "store"))
    first_published, release = threading.Event(), threading.Event()
    announced: list[int] = []

    def announce(version: int) -> None:
        announced.append(version)
        first_published.set()
        assert release.wait(timeout=60)  # a slow upload: the publisher is busy until released

    publisher = Publisher(
        store=store, model_config=model.config, extras_from=str(tmp_path), keep_last=10,
        on_published=announce, max_shard_bytes=40_000,
    )
    state = state_of(model)
    publisher.submit(1, state)
    assert first_published.wait(timeout=60)
    for version in (2, 3, 4):  # arrive while version 1 is still "uploading"; none blocks
        publisher.submit(version, state)
    assert publisher.skipped == [2, 3]  # one slot: each newer version replaced the waiting one
    release.set()
    publisher.close()
    assert announced == [1, 4]
    assert store.versions() == [1, 4]
    assert store.manifest(4).parent == 3  # the version it was trained from, published or not
    names = [f.path for f in store.manifest(4).files]
    assert INDEX_NAME in names and sum(n.endswith(".safetensors") for n in names) > 1


def test_a_version_is_timed_apart_from_the_retention_after_it(model: PreTrainedModel, tmp_path: Path) -> None:
    """`announce_seconds` ends when workers could pull the version; `publish_seconds` adds the
    retention after it (metrics.jsonl: announce_s and publish_s)."""
    store = CheckpointStore(str(tmp_path / "store"))
    retain = store.retain

    def slow_retention(*args: object, **kwargs: object) -> None:
        time.sleep(0.5)
        retain(*args, **kwargs)

    store.retain = slow_retention  # type: ignore[method-assign]
    publisher = Publisher(
        store=store, model_config=model.config, extras_from=str(tmp_path), keep_last=10, on_published=lambda v: None
    )
    publisher.submit(1, state_of(model))
    publisher.close()
    (announced,), (published,) = publisher.announce_seconds, publisher.publish_seconds
    assert published - announced >= 0.5


def test_publish_failure_surfaces_on_the_next_submit(model: PreTrainedModel, tmp_path: Path) -> None:
    store = CheckpointStore(str(tmp_path / "store"))
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "weights.bin").write_bytes(b"other")
    store.publish(1, str(tmp_path / "other"))  # version 1 is taken: publishing it again fails
    publisher = Publisher(
        store=store, model_config=model.config, extras_from=str(tmp_path), keep_last=10, on_published=lambda v: None
    )
    publisher.submit(1, state_of(model))
    with pytest.raises(RuntimeError, match="publishing a checkpoint failed: version 1 already published"):
        publisher.wait_idle()


def test_key_versions_are_stored_whole_and_as_deltas(model: PreTrainedModel, tmp_path: Path) -> None:
    """store.full_every = 3: v1 a key version alone (nothing before it), v2 and v3 deltas, v4 a key
    version stored whole and as deltas against v3 (a worker holding v3 fetches the deltas), v5 a
    delta again; a late joiner pulls v5 from v4's whole files."""
    store = CheckpointStore(str(tmp_path / "store"))
    publisher = Publisher(
        store=store, model_config=model.config, extras_from=str(tmp_path), keep_last=10, on_published=lambda v: None,
        full_every=3,
    )
    state = state_of(model)
    for version in range(1, 6):
        state = {name: tensor + 0.01 * (torch.rand_like(tensor) < 0.01) for name, tensor in state.items()}
        publisher.submit(version, state)
        assert publisher.wait_idle(timeout_s=60)
    publisher.close()
    assert [(store.manifest(v).delta_base, store.manifest(v).whole) for v in range(1, 6)] == [
        (None, False), (1, False), (2, False), (3, True), (4, False),
    ]
    late = Path(CheckpointStore(str(tmp_path / "store")).pull(5, str(tmp_path / "late")))
    assert sorted(p.name for p in late.parent.iterdir()) == ["v000004", "v000005"]
    loaded = AutoModelForCausalLM.from_pretrained(str(late), dtype=torch.float32)
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, state[name]), name


def test_a_publish_writes_only_under_its_scratch_dir(
    model: PreTrainedModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each version's files, the delta base kept beside them and the deltas (full_every 2) go under
    `scratch_dir`, never the system's temporary directory, where a killed trainer's would stay."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "no-system-tmp"))  # a temporary dir made there fails
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    store = CheckpointStore(str(tmp_path / "store"))
    publisher = Publisher(
        store=store, model_config=model.config, extras_from=str(tmp_path), keep_last=10, on_published=lambda v: None,
        full_every=2, scratch_dir=str(scratch), retry_s=0,  # a publish that fails, fails at once
    )
    state = state_of(model)
    for version in (1, 2):
        publisher.submit(version, {name: tensor + version for name, tensor in state.items()})
        assert publisher.wait_idle(timeout_s=60)
        assert [p.name.split("-")[:2] for p in scratch.iterdir()] == [["decentrl", f"v{version}"]]  # the next delta base
    assert store.manifest(2).delta_base == 1
    publisher.close()
    assert list(scratch.iterdir()) == []


def test_clear_scratch_removes_a_killed_trainers_leftovers_and_nothing_else(tmp_path: Path) -> None:
    scratch = tmp_path / "trainer" / "scratch"
    (scratch / "decentrl-v7-abc").mkdir(parents=True)
    (scratch / "decentrl-v7-abc" / "model.safetensors").write_bytes(b"weights of a killed trainer")
    assert clear_scratch(str(scratch)) == str(scratch)
    assert list(scratch.iterdir()) == []
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep").write_bytes(b"not the trainer's")
    scratch.rmdir()
    scratch.symlink_to(elsewhere)  # the link goes, never its target
    clear_scratch(str(scratch))
    assert scratch.is_dir() and not scratch.is_symlink() and list(scratch.iterdir()) == []
    assert (elsewhere / "keep").read_bytes() == b"not the trainer's"


def test_a_failed_publish_ends_the_wait_for_a_batch(model: PreTrainedModel, tmp_path: Path) -> None:
    """While no new version is announced no batch comes (F3: the announce failed while the store
    was cut off); the trainer's wait for its next batch raises the publisher's error instead of
    waiting for ever."""
    import time

    from decentrl.trainer.checkpoint import BatchJournal, ResumePlan
    from decentrl.trainer.train import receive_batch

    def refuse(version: int) -> None:
        raise RuntimeError("orchestrator answered 409: version 1 is not complete in the store")

    publisher = Publisher(
        store=CheckpointStore(str(tmp_path / "store")), model_config=model.config, extras_from=str(tmp_path),
        keep_last=10, on_published=refuse,
    )
    publisher.submit(1, state_of(model))

    class NoBatches:
        asked = 0

        def batch(self, trainer_version: int, request_id: str) -> None:
            self.asked += 1
            assert self.asked < 1200, "the wait for a batch never saw the publisher's error"
            time.sleep(0.05)
            return None  # a long-poll that ended without a batch

    client = NoBatches()
    with pytest.raises(RuntimeError, match="publishing a checkpoint failed: .*not complete in the store"):
        receive_batch(2, ResumePlan(checkpoint=0, replay_through=0, published=0), client,  # type: ignore[arg-type]
                      BatchJournal(str(tmp_path / "journal")), publisher.check)
    assert client.asked >= 1
