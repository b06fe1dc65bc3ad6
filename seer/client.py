"""What a trainer imports: ``SeerClient`` (blocking) and ``AsyncSeerClient``.

Importable without torch or vLLM (only msgspec and pyzmq). One DEALER socket per
client; every call carries a ``call_id`` and a reader task routes replies to it, so
one async client can run many calls at once. While a rollout runs the client sends
heartbeats (the daemon aborts rollouts of clients that vanish) and expects the daemon
to answer them: a daemon silent for ``timeout_s`` raises ``SeerTimeoutError``, never
a hang. Service errors arrive as ``SeerServiceError`` with the daemon's message; a
value that cannot be sent at all (an integer beyond 64 bits, a lone surrogate) raises
``SeerInputError`` before anything is sent, and so does a rollout request larger than the
daemon's ``server.max_request_bytes`` whenever the client knows that limit (from the
daemon's ``daemon.json``, or ``max_request_bytes=``): the message is the one ``seerctl
rollout`` prints. Every error the client raises is a ``SeerError``.

A rollout that is left before its end (``break``, an exception, a closed generator, an
``on_group`` that raises, or ``close()`` with streams still open) is cancelled on the
daemon at once, so its engines are freed without waiting for ``client_lost``.

``SeerClient`` runs an ``AsyncSeerClient`` on a private event loop; do not share one
instance between threads, and use ``AsyncSeerClient`` inside a running event loop.

This module is the import point and the overview; the client is split by job into
``seer.client_async`` (``AsyncSeerClient``: socket, reply routing, the calls),
``seer.client_rollout`` (``RolloutStream``, ``RolloutResult``: one rollout's iteration,
heartbeats and cancel), ``seer.client_sync`` (``SeerClient``), ``seer.client_requests``
(prompts, the checks before sending, the daemon's address and ``daemon.json``) and
``seer.client_errors`` (the ``SeerError`` hierarchy). Import from here.
"""

from __future__ import annotations

# The noqa imports: not in __all__ but importable from here as before the split
# (cli/rollout.py imports check_encodable): CANCEL_CONFIRM_S, DEFAULT_RUN_DIR, PromptLike,
# check_encodable, to_prompt.
from seer.auth import ClientKeys
from seer.client_async import CANCEL_CONFIRM_S, AsyncSeerClient  # noqa: F401
from seer.client_errors import SeerError, SeerInputError, SeerProtocolError, SeerServiceError, SeerTimeoutError
from seer.client_requests import (  # noqa: F401
    DEFAULT_RUN_DIR,
    PromptLike,
    check_encodable,
    check_request_size,
    daemon_info,
    resolve_address,
    to_prompt,
)
from seer.client_rollout import RolloutResult, RolloutStream
from seer.client_sync import SeerClient
from seer.protocol import GroupResult, Prompt, SampleResult, SamplingParams

__all__ = [
    "AsyncSeerClient",
    "ClientKeys",
    "GroupResult",
    "Prompt",
    "RolloutResult",
    "RolloutStream",
    "SampleResult",
    "SamplingParams",
    "SeerClient",
    "SeerError",
    "SeerInputError",
    "SeerProtocolError",
    "SeerServiceError",
    "SeerTimeoutError",
    "check_request_size",
    "daemon_info",
    "resolve_address",
]
