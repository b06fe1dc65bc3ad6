"""Scheduling policies, selectable by name."""

from __future__ import annotations

from seer.config import SchedulerConfig
from seer.controlplane.policies.base import Assignment, Policy
from seer.controlplane.policies.group import GroupRoundRobinPolicy
from seer.controlplane.policies.ordered import ContextPolicy, DividedPolicy, OraclePolicy

POLICIES: dict[str, type] = {
    "group": GroupRoundRobinPolicy,
    "divided": DividedPolicy,
    "context": ContextPolicy,
    "oracle": OraclePolicy,
}


def make_policy(name: str, config: SchedulerConfig | None = None) -> Policy:
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; available: {', '.join(sorted(POLICIES))}") from None
    return cls(config or SchedulerConfig())


__all__ = ["Assignment", "Policy", "POLICIES", "make_policy"]
