"""The policy interface: which waiting requests run where, and for how many tokens.

A policy owns the queue of its waiting requests (the request buffer, in whatever
order it needs) and returns assignments for live engines. It never changes request
state (the scheduler applies assignments and checks them) and never does I/O. Policies
are chosen by name (``seer.toml`` ``scheduler.policy`` or per rollout); the scheduler
keeps one instance per name and routes each rollout's requests to its policy.

Adding a policy is one edit: a module in this package whose class declares ``name`` and
is decorated with ``register``. The package imports every module in it, ``register``
puts the class in ``REGISTRY`` and its name in the config layer's list of policy names
(``seer.config.register_policy_name``), against which ``seer.toml`` is validated at load.
"""

from __future__ import annotations

from typing import Protocol

import msgspec

from seer.config import register_policy_name
from seer.controlplane.buffer import RequestBuffer
from seer.controlplane.state import EngineView, Request

REGISTRY: dict[str, type] = {}  # policy name -> class, filled by ``register``


class Assignment(msgspec.Struct, frozen=True):
    """One chunk a policy assigned (a Struct, not a dataclass: one is made per decision,
    and a frozen dataclass costs ~0.7 us to build against ~0.08 us)."""

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

    def rollout_ended(self, rollout_id: str, engines: list[EngineView]) -> None:
        """A rollout finished (its results delivered) or was cancelled: let go of
        everything kept of it, so its memory can be given back. ``engines``: the live ones."""
        ...

    def assign(self, engines: list[EngineView]) -> list[Assignment]:
        """Pick work for live engines (sorted by id) and drop it from the queue."""
        ...


def register(cls: type) -> type:
    """Class decorator: make a policy selectable by its ``name``."""
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not name:
        raise TypeError(f"policy class {cls.__qualname__} needs a non-empty str `name` to be registered")
    if REGISTRY.get(name, cls) is not cls:
        raise ValueError(f"policy name {name!r} is taken by {REGISTRY[name].__qualname__}; "
                         f"give {cls.__qualname__} another name")
    REGISTRY[name] = cls
    register_policy_name(name)
    return cls


class WholeRequestPolicy:
    """Base of the baselines that send every sample as one whole request (no chunking, no
    migration, admission and preemption left to the engine): the waiting requests live in
    a ``RequestBuffer`` in arrival order; subclasses decide only the routing (``assign``)."""

    uses_probes = False
    chunked = False

    def __init__(self, config: object = None) -> None:
        self._buffer = RequestBuffer()

    def __len__(self) -> int:
        return len(self._buffer)

    def enqueue(self, request: Request) -> None:
        self._buffer.add(request)

    def discard_rollout(self, rollout_id: str) -> None:
        self._buffer.drop_rollout(rollout_id)

    def rollout_ended(self, rollout_id: str, engines: list[EngineView]) -> None:
        pass  # nothing outlives a request's stay in the buffer
