"""Scheduling policies, selectable by name."""

from __future__ import annotations

from seer.controlplane.policies.base import Assignment, Policy
from seer.controlplane.policies.group import GroupRoundRobinPolicy

POLICIES = {"group": GroupRoundRobinPolicy}


def make_policy(name: str) -> Policy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; available: {', '.join(sorted(POLICIES))}") from None


__all__ = ["Assignment", "Policy", "POLICIES", "make_policy"]
