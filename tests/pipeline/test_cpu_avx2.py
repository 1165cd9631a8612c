"""The kernel-sensitive tests (marker `kernels`: sampling, losses, verification, determinism) run
again under an emulated AVX2 CPU, so that a test which holds only on this machine's kernels fails
here and not on a volunteer's machine (issue 44: two tests passed on the AVX-512 machine they were
written on and failed on an AVX2 EPYC). A pytest subprocess whose libraries are held to AVX2
(docs/reproducibility.md, "Other CPUs"), with an inductor cache of its own: inductor does not key
its cache by ISA, and kernels compiled for one ISA crash a process running under the other.

Two kernel sets, because no setting on an Intel CPU reproduces an AMD one's: MKL picks its
kernels by vendor as well as by ISA. `avx2` holds PyTorch, oneDNN and MKL to AVX2 (an Intel AVX2
CPU); `avx2-mkl-own` leaves MKL its own choice, and with it the EPYC's seeded-rows failure
reproduced here (2026-11-28), which `avx2` did not. CI runs `avx2-mkl-own` (both failures of
issue 44 reproduce under it); `avx2` runs with DECENTRL_LONG_TESTS=1 (95-120 s with a cold inductor
cache, which a clean clone always has). On a CPU whose kernels are not AVX-512 the test skips: the
main run already runs these tests on them."""

from __future__ import annotations

import getpass
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]

# PyTorch's own kernels and inductor's generated code; oneDNN (no AVX-512, no AMX: no native bf16);
# MKL's BLAS.
ATEN_AND_ONEDNN = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
KERNEL_SETS = {
    "avx2": {**ATEN_AND_ONEDNN, "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    "avx2-mkl-own": ATEN_AND_ONEDNN,
}


def emulated(name: str) -> dict[str, str]:
    """This process's environment with the kernel set `name`, and its own inductor cache: one
    directory per set, kept between runs (a warm cache saves the compiled tests most of their time)."""
    cache = Path(tempfile.gettempdir()) / f"torchinductor_{getpass.getuser()}_{name}"
    return {**os.environ, **KERNEL_SETS[name], "TORCHINDUCTOR_CACHE_DIR": str(cache)}


def marked_files() -> list[str]:
    """The test files that mark tests `kernels`: the subprocess collects these only, not the whole
    suite (which would cost it about 25 s of import and collection)."""
    return sorted(str(path) for path in (ROOT / "tests").rglob("test_*.py") if "@pytest.mark.kernels" in path.read_text())


LONG = pytest.mark.skipif(
    os.environ.get("DECENTRL_LONG_TESTS") != "1",
    reason="the all-AVX2 kernel set (MKL held to AVX2 too): 95-120 s cold, beyond CI's budget; avx2-mkl-own "
    "reproduces both of issue 44's failures; run with DECENTRL_LONG_TESTS=1",
)


@pytest.mark.parametrize("name", [pytest.param("avx2", marks=LONG), "avx2-mkl-own"])
def test_the_kernel_sensitive_tests_pass_on_an_emulated_avx2_cpu(name: str) -> None:
    capability = torch.backends.cpu.get_cpu_capability()
    if capability != "AVX512":
        pytest.skip(f"torch's CPU kernels here are {capability}, not AVX-512: the main run already runs the `kernels` tests on them")
    env = emulated(name)
    probe = "import torch; print(torch.backends.cpu.get_cpu_capability(), torch.ops.mkldnn._is_mkldnn_bf16_supported())"
    seen = subprocess.run(
        [sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True, timeout=120
    ).stdout.split()
    assert seen == ["AVX2", "False"], f"the settings {KERNEL_SETS[name]} no longer emulate an AVX2 CPU: torch says {seen}"
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-m", "kernels", "-p", "no:cacheprovider", "-q", *marked_files()],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )
    report = (done.stdout + done.stderr)[-6000:]
    assert done.returncode == 0, f"the `kernels` tests fail on an emulated AVX2 CPU ({name}: {KERNEL_SETS[name]}):\n{report}"
    assert " passed" in done.stdout.splitlines()[-1], report
