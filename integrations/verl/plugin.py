"""Owns the ``verl.plugins`` entry point: ``import verl`` imports this module in every process
(driver and Ray workers), which registers the ``seer`` checkpoint-engine backend.

verl swallows a plugin's exceptions (logged at debug level only), so a failed registration
is recorded with the registry instead: veRL's "backend seer not registered" error then says why.
"""

from __future__ import annotations

from verl.checkpoint_engine import CheckpointEngineRegistry

try:
    from .checkpoint import BACKEND, SeerCheckpointEngine
except ImportError as exc:  # e.g. safetensors or seer's client dependencies missing in this environment
    CheckpointEngineRegistry.record_import_error("seer.integrations.verl.checkpoint", exc)
else:
    CheckpointEngineRegistry.register(BACKEND)(SeerCheckpointEngine)
