"""The control plane's peer processes (engine workers, host agents): when to say hello,
when to say it again, and when the control plane counts as lost.

Owns ``PeerSession``, a pure decision object (the caller passes the time and does the
sending). Both peers say hello on connect and again every ``HELLO_REPEAT_S`` while it is
unanswered; both take ``timeout_s`` of silence (``engines.heartbeat_timeout_s``) as the
control plane gone. The control plane pings agents and engines alike every tick (at most
0.5 s apart) and takes a repeated hello from a peer it knows as a no-op, so a false alarm
costs only a hello. What each peer does about a lost control plane differs: a spawned
engine exits, a joined engine registers again, an agent keeps repeating its hello.
"""

from __future__ import annotations

from dataclasses import dataclass

HELLO_REPEAT_S = 3.0  # an unanswered hello is sent again this often


@dataclass
class PeerSession:
    """Liveness of the control plane as one peer sees it, and the hello's repeat timer."""

    timeout_s: float  # silence longer than this: the control plane is lost
    last_heard_s: float
    repeat_s: float = HELLO_REPEAT_S
    # When a hello went unanswered or the control plane was taken as lost; None while
    # it answers.
    lost_since_s: float | None = None
    _next_hello_s: float = 0.0

    def heard(self, now_s: float, *, answers_hello: bool = True) -> float | None:
        """A message arrived. Returns how long it was lost, if it was (None otherwise).
        ``answers_hello=False``: proof of life only (an engine waits for ``HelloAccepted``
        itself; an agent takes any message as the answer)."""
        self.last_heard_s = now_s
        if self.lost_since_s is None or not answers_hello:
            return None
        lost_s, self.lost_since_s = now_s - self.lost_since_s, None
        return lost_s

    def unanswered(self, now_s: float) -> None:
        """A hello was sent and must be answered (or could not even be sent): repeat it
        every ``repeat_s`` from now instead of waiting out ``timeout_s`` first."""
        if self.lost_since_s is None:
            self.lost_since_s = now_s
        self._next_hello_s = now_s + self.repeat_s

    def timed_out(self, now_s: float) -> bool:
        """Silent for longer than ``timeout_s``?"""
        return now_s - self.last_heard_s > self.timeout_s

    def hello_due(self, now_s: float) -> bool:
        """Nothing heard for ``timeout_s``, or a hello unanswered for ``repeat_s``: say
        hello (again) now? (Marks the control plane lost the first time.)"""
        if self.lost_since_s is None:
            if not self.timed_out(now_s):
                return False
            self.lost_since_s = now_s
        elif now_s < self._next_hello_s:
            return False
        self._next_hello_s = now_s + self.repeat_s
        return True


__all__ = ["HELLO_REPEAT_S", "PeerSession"]
