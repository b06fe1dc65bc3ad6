"""What the control plane's parts want sent: an outbox of (peer, message), delivered by the server.

Owns the typed sends. The parts (``core.py`` and what it wires: ``sessions.py``,
``membership.py``, ``health.py``, ``weights.py``, ``kvpool/agents.py``, and the scheduler
with its ``Dispatch``) never send: they return an ``Outbox`` and ``server.py`` alone
delivers it, in order, awaiting each send -- so a ``HelloAccepted`` is out before the
first chunk of the engine it admits, and the ``AbortTasks`` of a failed rollout are out
before the next decision. What a failed delivery means is the server's (a ``Dispatch``
that cannot reach its engine loses it: ``Health.lose_engine``) or the sending part's
(``ToAgent``: ``Agents.delivered`` hears whether it went out).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeAlias

if TYPE_CHECKING:
    from seer.controlplane.kvpool.agents import ToAgent
    from seer.controlplane.scheduler import Dispatch


@dataclass(frozen=True)
class ToEngine:
    """To a registered engine, by id (an engine that cannot be reached is logged)."""

    engine_id: int
    msg: object


@dataclass(frozen=True)
class ToPeer:
    """To any peer of the engine socket, by ZeroMQ identity: an engine before it is
    registered, or one being refused (it may already be gone)."""

    identity: bytes
    msg: object


@dataclass(frozen=True)
class ToClient:
    """To a trainer client, by ZeroMQ identity (never blocks; a client that is gone is logged)."""

    identity: bytes
    msg: object


@dataclass(frozen=True)
class ToCall:
    """To the OpenAI endpoint's call waiting for a trajectory's turn (``agent_calls.py``), by
    the trajectory's request id (a call that went away meanwhile is dropped)."""

    request_id: str
    msg: object


Send: TypeAlias = "ToEngine | ToPeer | ToClient | ToCall | Dispatch | ToAgent"
Outbox: TypeAlias = "list[Send]"
