"""The policy interface: which waiting requests run where, and for how many tokens.

A policy owns the queue of its waiting requests (the request buffer, in whatever
order it needs) and returns assignments for live engines. It never changes request
state (the scheduler applies assignments and checks them) and never does I/O. Policies
are chosen by name (``seer.toml`` ``scheduler.policy`` or per rollout); the scheduler
keeps one instance per name and routes each rollout's requests to its policy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from seer.controlplane.state import EngineView, Request


@dataclass(frozen=True)
class Assignment:
    request: Request
    engine_id: int
    max_tokens: int  # this chunk's budget


class Policy(Protocol):
    name: str
    # True when sample 0 of each group is a probe (served first to learn the group's
    # length); engines then give probes more speculative drafts (the paper's lambda).
    uses_probes: bool

    def __len__(self) -> int:
        """Number of waiting requests held."""
        ...

    def enqueue(self, request: Request) -> None:
        """A request became waiting (submitted, back from a chunk, or from a lost engine)."""
        ...

    def discard_rollout(self, rollout_id: str) -> None:
        """Forget every waiting request of a cancelled rollout."""
        ...

    def assign(self, engines: list[EngineView]) -> list[Assignment]:
        """Pick work for live engines (sorted by id) and drop it from the queue."""
        ...
