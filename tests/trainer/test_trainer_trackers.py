"""Experiment trackers (decentrl/trainer/trackers.py), each for real where its package is
installed: the metrics and the sample table are read back from what the tracker wrote, the run
config is attached, and a tracker that fails never stops the steps that follow."""

from __future__ import annotations

import importlib.util
import json
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from decentrl.api.wire import TrainBatch, TrainSample
from decentrl.config import LoggingConfig
from decentrl.trainer.trackers import SAMPLE_COLUMNS, Trackers

RUN_CONFIG = {"run_name": "tracked", "trainer": {"lr": 0.001}}


def batch() -> TrainBatch:
    sample = TrainSample(prompt_token_ids=[1, 2], completion_token_ids=[3, 4], logprobs=[-0.1, -0.2], advantage=0.5,
                         reward=1.0, policy_version=2, group_id="g")
    return TrainBatch(trainer_version=2, samples=[sample], staleness_histogram={"0": 1}, rollouts_accepted=1, stale_dropped=0)


def run_steps(name: str, directory: Path) -> Trackers:
    trackers = Trackers(
        LoggingConfig(trackers=[name], project="proj", samples_every=2), run_name="tracked", run_config=RUN_CONFIG,
        directory=str(directory), decode=lambda ids: " ".join(f"t{i}" for i in ids),
    )
    for step in (1, 2, 3):
        trackers.step(step, {"step": step, "loss": 1.0 / step, "kl": float("nan"), "replayed": False, "staleness_histogram": {}}, batch())
    trackers.close()
    assert not trackers.failures
    return trackers


def needs(package: str) -> Any:
    return pytest.mark.skipif(
        importlib.util.find_spec(package) is None, reason=f"{package} is not installed (pip install decentrl[{package}])"
    )


@needs("tensorboard")
def test_tensorboard_gets_metrics_samples_and_config(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_steps("tensorboard", tmp_path)
    events = EventAccumulator(str(tmp_path / "tensorboard" / "proj" / "tracked"), size_guidance={"tensors": 0})
    events.Reload()
    assert [(e.step, round(e.value, 4)) for e in events.Scalars("loss")] == [(1, 1.0), (2, 0.5), (3, 0.3333)]
    assert "kl" not in events.Tags()["scalars"]  # NaN stays in metrics.jsonl
    text = {tag: [e.tensor_proto.string_val[0].decode() for e in events.Tensors(tag)] for tag in events.Tags()["tensors"]}
    assert any("t3 t4" in table for table in text["samples/text_summary"])
    assert '"lr": 0.001' in text["config/text_summary"][0]


@needs("wandb")
def test_wandb_offline_writes_a_run_with_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_steps("wandb", tmp_path)
    (run_dir,) = (tmp_path / "wandb" / "wandb").glob("offline-run-*")
    (table,) = (run_dir / "files" / "media" / "table").glob("samples_2_*.table.json")
    assert json.loads(table.read_text()) == {"columns": SAMPLE_COLUMNS, "data": [[2, 2, 1.0, 0.5, "t1 t2", "t3 t4"]]}
    # The run's records, for `wandb sync` (protobuf; wandb ships no Python reader): config and history.
    (records,) = run_dir.glob("*.wandb")
    raw = records.read_bytes()
    assert b'{"lr":0.001}' in raw and raw.count(b"loss") >= 3


@needs("trackio")
def test_trackio_stores_metrics_locally(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import trackio

    monkeypatch.setenv("TRACKIO_DIR", str(tmp_path / "trackio-store"))
    monkeypatch.setattr(trackio.sqlite_storage, "TRACKIO_DIR", tmp_path / "trackio-store", raising=False)
    run_steps("trackio", tmp_path)
    (database,) = (tmp_path / "trackio-store").rglob("proj.db")
    with sqlite3.connect(database) as connection:
        rows = connection.execute("SELECT step, metrics FROM metrics ORDER BY step").fetchall()
    losses = {step: json.loads(metrics).get("loss") for step, metrics in rows}
    assert losses[1] == 1.0 and losses[3] == pytest.approx(1 / 3)
    assert any("samples" in json.loads(metrics) for _, metrics in rows)


@needs("tensorboard")
def test_a_failing_tracker_is_counted_and_training_goes_on(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    trackers = Trackers(LoggingConfig(trackers=["tensorboard"]), run_name="r", run_config={}, directory=str(tmp_path),
                        decode=str)
    writer = trackers.open["tensorboard"].writer  # type: ignore[attr-defined]
    writer.close()
    writer.add_scalar = lambda *a, **k: (_ for _ in ()).throw(OSError("disk full"))  # what a full disk raises
    for step in (1, 2, 3):
        trackers.step(step, {"loss": 1.0}, batch())
    assert trackers.failures["tensorboard"] == 3
    assert sum("tracker tensorboard failed" in r.message for r in caplog.records) == 1


def test_a_listed_tracker_that_is_not_installed_stops_at_start(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import builtins

    real_import = builtins.__import__

    def no_wandb(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "wandb":
            raise ImportError("No module named 'wandb'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_wandb)
    with pytest.raises(RuntimeError, match=r'pip install "decentrl\[wandb\]"'):
        Trackers(LoggingConfig(trackers=["wandb"]), run_name="r", run_config={}, directory=str(tmp_path), decode=str)


def test_logging_config_refuses_unknown_and_repeated_trackers() -> None:
    with pytest.raises(ValueError, match="mlflow"):
        LoggingConfig(trackers=["mlflow"])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="twice"):
        LoggingConfig(trackers=["wandb", "wandb"])
