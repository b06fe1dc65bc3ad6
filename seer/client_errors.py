"""The client's errors: every error ``SeerClient`` and ``AsyncSeerClient`` raise is a
``SeerError``; this module owns the hierarchy and nothing else (``seer.client`` re-exports
it)."""

from __future__ import annotations

__all__ = ["SeerError", "SeerInputError", "SeerProtocolError", "SeerServiceError", "SeerTimeoutError"]


class SeerError(Exception):
    """Base class of every error the client raises."""


class SeerServiceError(SeerError):
    """The daemon refused or failed a call; ``code`` is stable, the message says why."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"[{code}] {message}")
        self.code = code
        self.message = message


class SeerTimeoutError(SeerError):
    pass


class SeerInputError(SeerError):
    """A value the client cannot send (or that no daemon would accept): nothing was sent."""


class SeerProtocolError(SeerError):
    """The daemon answered with a message this call does not expect (a version mismatch
    or a bug); the message names both."""
