#!/usr/bin/env bash
# Fresh-machine setup: a virtualenv in .venv with torch (CPU build unless a CUDA driver is
# present), then decentrl itself in editable mode with the test and task extras. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=".venv/bin/python -m pip"
TORCH=2.13.0
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    # PyPI's default Linux wheel is the CUDA build.
    $PIP install -q "torch==$TORCH"
  else
    # The CPU build: a local wheel where one is configured, else PyTorch's CPU index.
    $PIP install -q "torch==$TORCH+cpu" 2>/dev/null \
      || $PIP install -q "torch==$TORCH" --index-url https://download.pytorch.org/whl/cpu
  fi
fi
# The tasks extra (reasoning-gym, math-verify, datasets) so CI runs the task-source tests too;
# EXTRAS=dev,tasks,verifiers adds the verifiers environments (heavy; their tests skip without it).
$PIP install -q -e ".[${EXTRAS:-dev,tasks}]"
