"""Scheduling policies, selectable by name.

Every module of this package is imported here, so a policy class decorated with
``register`` (``base.py``) in a new module is all it takes to add a policy.
"""

from __future__ import annotations

import importlib
import pkgutil

from seer.config import SchedulerConfig
from seer.controlplane.policies.base import REGISTRY, Assignment, Policy

for _module in sorted(m.name for m in pkgutil.iter_modules(__path__)):
    importlib.import_module(f"{__name__}.{_module}")

POLICIES: dict[str, type[Policy]] = REGISTRY  # name -> class, every registered policy


def make_policy(name: str, config: SchedulerConfig | None = None) -> Policy:
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; available: {', '.join(sorted(POLICIES))}") from None
    return cls(config or SchedulerConfig())


__all__ = ["Assignment", "Policy", "POLICIES", "make_policy"]
