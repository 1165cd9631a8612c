#!/usr/bin/env bash
# The `vllm`-marked tests, inside .venv-vllm (create it with .ci/setup-vllm.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv-vllm}
export LD_PRELOAD="$(realpath "$VENV")/lib/libiomp5.so" HF_HUB_OFFLINE=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_CPU_KVCACHE_SPACE=1
exec "$VENV/bin/python" -m pytest -m vllm -p no:cacheprovider -q tests/workers/test_worker_vllm.py "$@"
