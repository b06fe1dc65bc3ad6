"""Seer as veRL's rollout: an agent-loop manager (``SeerAgentLoopManager``) and the ``seer``
checkpoint-engine backend (registered by ``plugin.py`` through veRL's ``verl.plugins`` entry
point). Importing this package loads neither torch nor verl. docs/integrations.md ("veRL").
"""

from .batch import VerlBatchError
from .manager import SeerAgentLoopManager, SeerRolloutError
from .settings import SeerSettings, SeerSettingsError

__all__ = ["SeerAgentLoopManager", "SeerRolloutError", "SeerSettings", "SeerSettingsError", "VerlBatchError"]
