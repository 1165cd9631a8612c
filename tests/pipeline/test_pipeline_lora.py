"""The real pipeline with `[trainer.lora]`: a two-rank FSDP2 trainer trains only adapters and
publishes only them; two workers pull the base once and merge each adapter onto it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from decentrl.store.checkpoints import CheckpointStore
from tests.pipeline.test_pipeline import pipeline_config, run_config

pytestmark = pytest.mark.integration

STEPS = 4
CONFIG = pipeline_config(
    run_name="it-lora", steps=STEPS, max_staleness=1, lr=3e-2, extra="[trainer.lora]\nrank = 2\nalpha = 4.0\n"
)


def test_lora_pipeline_publishes_only_adapters_and_keeps_the_base(tmp_path: Path) -> None:
    result, run_dir = run_config(tmp_path, CONFIG)
    assert result.returncode == 0, result.stdout + result.stderr

    # Versions advance one per step, and workers kept up: had they failed to load an adapter
    # version, their rollouts would have gone stale and the trainer would have starved.
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["policy_version"] for m in metrics] == list(range(1, STEPS + 1))
    for record in metrics:
        assert all(0 <= int(lag) <= 1 for lag in record["staleness_histogram"])
    worker_logs = "".join((run_dir / "logs" / f"worker-{i}.log").read_text() for i in range(2))
    assert f"loaded version {STEPS - 1}" in worker_logs or f"loaded version {STEPS}" in worker_logs

    # v0 is the full model; every later version is only the adapter, on base version 0.
    store = CheckpointStore(str(run_dir / "checkpoints"))
    assert store.versions() == list(range(STEPS + 1))
    full_bytes = sum(f.size for f in store.manifest(0).files)
    for version in range(1, STEPS + 1):
        manifest = store.manifest(version)
        assert manifest.base_version == 0 and store.verify(version) == []
        assert sorted(f.path for f in manifest.files) == ["adapter_config.json", "adapter_model.safetensors"]
        assert sum(f.size for f in manifest.files) < full_bytes / 5

    # The adapters trained (B starts at zero) ...
    cache = tmp_path / "pulled"
    first = load_file(Path(store.pull(1, str(cache))) / "adapter_model.safetensors")
    last = load_file(Path(store.pull(STEPS, str(cache))) / "adapter_model.safetensors")
    assert set(first) == set(last) and len(last) == 4 * 2  # q, k, v, o x (A, B), one layer
    unchanged = [name for name in last if torch.equal(first[name], last[name])]
    assert unchanged == [], f"adapter weights not changed by training: {unchanged}"
    assert all(last[name].abs().max() > 0 for name in last if ".lora_B." in name)

    # ... and the base did not: the trainer's last checkpoint holds exactly version 0's weights.
    base = load_file(cache / "v000000" / "model.safetensors")
    dcp_to_torch_save(run_dir / "trainer" / "checkpoints" / f"step_{STEPS:06d}", tmp_path / "ckpt.pt")
    trained = torch.load(tmp_path / "ckpt.pt", weights_only=False)["model"]
    compared = 0
    for name, weight in base.items():
        key = name.replace(".weight", ".base_layer.weight").replace(".bias", ".base_layer.bias")
        key = key if key in trained else name
        assert torch.equal(trained[key], weight), name
        compared += 1
    assert compared == len(base)
