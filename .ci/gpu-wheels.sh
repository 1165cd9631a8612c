#!/usr/bin/env bash
# Wheels of decentrl's pure-Python dependencies that a bare CUDA image (CUDA torch, transformers,
# safetensors, aiohttp, typer, ...; Python 3.12, no package index) lacks, downloaded here into .whl/
# for benchmarks/gpu_check.py there (docs/benchmarks.md, "The GPU path"). There, before the check:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
mkdir -p .whl
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
  blake3==1.0.11 zstandard==0.25.0 cryptography==50.0.2 cffi==2.1.1 pycparser==3.12 typing_extensions==4.16.0
du -sh .whl
