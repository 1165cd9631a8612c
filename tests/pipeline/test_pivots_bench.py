"""benchmarks/pivots.py's short twin: one arm of each kind on a barely fine-tuned tiny model, a
small token budget, through the real orchestrator, scorer loop and step-wise worker; every unit
accepted whole (run_arm raises on a refused sample) and the counts consistent."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "pivots.py"


@pytest.fixture(scope="module")
def bench() -> Any:
    spec = importlib.util.spec_from_file_location("pivots_bench", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def checkpoint(bench: Any, tmp_path_factory: pytest.TempPathFactory) -> str:
    directory = str(tmp_path_factory.mktemp("pivots") / "v0")
    assert bench.finetune(directory, steps=20, seed=0) > 0
    assert os.path.isfile(os.path.join(directory, "config.json"))
    return directory


@pytest.mark.parametrize("arm", ["root", "prm"])
def test_an_arm_runs_to_its_budget(bench: Any, checkpoint: str, arm: str) -> None:
    result = bench.run_arm(arm, 0, checkpoint, budget=120, group_size=2, k=2, token_s=0.015)  # a real model's pace
    assert result["tokens"] >= 120 and result["units"] >= 1
    assert result["tokens"] == result["tokens_kept"] + result["tokens_discarded"]
    assert 0 <= result["recovered"] <= result["failed_roots"] <= result["units"]
    assert result["steps_posted"] > 0
    if arm == "root":
        assert result["tokens_saved"] == 0 and result["verdicts_used"] == 0 and result["tokens_discarded"] == 0
    else:
        assert result["verdicts_used"] > 0  # a barely trained model's steps are judged wrong, and chains stop
