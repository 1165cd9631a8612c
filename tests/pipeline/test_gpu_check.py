"""benchmarks/gpu_check.py in its reduced mode (the one CI runs without CUDA): every section (the
`gpu` tests, trainer and hf worker against their bare loops, an end-to-end run of configs/gpu1.toml)
runs through to a result, so the GPU path cannot rot between GPU runs. The figures mean nothing
here; only that each is there and sane."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).parents[2]
SUMMARY = {
    "trainer_vs_bare_135m", "trainer_vs_bare_0_6b", "one_unit_vs_per_block_135m", "one_unit_vs_per_block_0_6b",
    "trainer_mfu_0_6b", "trainer_tokens_per_s_0_6b",
    "compiled_vs_eager_135m", "compiled_vs_eager_0_6b",
    "worker_hf_vs_bare", "gpu_tests_passed", "gpu_tests_failed", "total_s",
}


@pytest.mark.timeout(600)
def test_gpu_check_reduced_runs_every_section(tmp_path: Path) -> None:
    # --reduced: the small shapes on any machine (the default only without CUDA).
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--out", str(tmp_path), "--reduced"],
        cwd=ROOT, capture_output=True, text=True, timeout=570,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["reduced"] is True
    for section in ("tests", "trainer", "worker", "e2e", "compile"):
        assert "error" not in result[section], (section, result[section])
        assert result[section]["section_s"] > 0

    tests = result["tests"]
    assert (tests["exit_code"], tests["failed"], tests["errors"]) == (0, 0, 0), tests
    assert tests["files"]  # the gpu-marked test files were found

    for shape in ("smollm2_135m", "qwen3_0_6b"):
        trainer = result["trainer"][shape]
        assert trainer["tokens_per_s"] > 0 and trainer["trainer_vs_bare"] > 0 and trainer["one_unit_vs_per_block"] > 0, trainer

    for shape in ("smollm2_135m", "qwen3_0_6b"):  # [trainer] compile against the same step eager
        compiled = result["compile"][shape]
        assert compiled["compiled_vs_eager"] > 0 and compiled["compiled_first_step_s"] > compiled["compiled_step_s"], compiled
        assert result["summary"][f"compiled_vs_eager_{shape.split('_', 1)[1]}"] == compiled["compiled_vs_eager"]

    assert result["worker"]["worker_hf_vs_bare"] > 0 and result["worker"]["worker_hf_vs_bare_no_cudnn_sdp"] > 0

    e2e = result["e2e"]
    assert e2e["exit_code"] == 0, e2e
    assert e2e["steps"] == 3
    assert e2e["versions_loaded"] >= 1
    assert e2e["step_s"] > 0
    assert e2e["publish_s"] is not None

    assert set(result["summary"]) == SUMMARY
    assert result["summary"]["worker_hf_vs_bare"] == result["worker"]["worker_hf_vs_bare"]
    assert json.loads((tmp_path / "gpu_check.json").read_text()) == result


def test_a_section_stopped_by_its_budget_keeps_what_it_had_printed() -> None:
    """A section's child prints one JSON object a shape as it goes; stopped early, the check keeps
    them (the later line of a key wins) and skips what is not JSON."""
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    stdout = b'{"smollm2_135m": {"eager_step_s": 1.0}}\nW1127 a torch warning\n{"smollm2_135m": {"eager_step_s": 2.0}}\n[1]\n'
    assert gpu_check.printed_so_far(stdout) == {"smollm2_135m": {"eager_step_s": 2.0}}
    assert gpu_check.printed_so_far(None) == {} and gpu_check.printed_so_far("") == {}
