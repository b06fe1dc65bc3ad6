"""The peer processes' hello and liveness decisions (seer/peer.py) and process plumbing (seer/process.py)."""

from __future__ import annotations

import signal

from seer.peer import HELLO_REPEAT_S, PeerSession
from seer.process import on_stop_signals


def test_an_unanswered_hello_is_repeated_every_repeat_interval_until_answered() -> None:
    """An engine's first hello, once unanswered, is due again every repeat_s, not after timeout_s."""
    peer = PeerSession(timeout_s=30.0, last_heard_s=0.0)
    peer.unanswered(0.0)
    assert not peer.hello_due(HELLO_REPEAT_S - 0.1)
    assert peer.hello_due(HELLO_REPEAT_S)
    assert not peer.hello_due(HELLO_REPEAT_S + 1.0) and peer.hello_due(2 * HELLO_REPEAT_S)
    assert peer.heard(7.0) == 7.0 and peer.lost_since_s is None
    assert not peer.hello_due(30.0)


def test_proof_of_life_alone_does_not_answer_a_hello() -> None:
    """A message that is not the hello's answer refreshes liveness but keeps the hello unanswered."""
    peer = PeerSession(timeout_s=30.0, last_heard_s=0.0)
    peer.unanswered(0.0)
    assert peer.heard(2.0, answers_hello=False) is None
    assert peer.lost_since_s == 0.0 and peer.last_heard_s == 2.0
    assert peer.hello_due(HELLO_REPEAT_S)


def test_silence_longer_than_the_timeout_is_a_lost_control_plane() -> None:
    """timed_out is strict: exactly timeout_s of silence is still alive."""
    peer = PeerSession(timeout_s=30.0, last_heard_s=10.0)
    assert not peer.timed_out(40.0)
    assert peer.timed_out(40.01)
    peer.heard(40.0)
    assert not peer.timed_out(69.0)


def test_stop_signals_reach_the_handler() -> None:
    """on_stop_signals installs one handler for SIGTERM and SIGINT."""
    old = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    got: list[int] = []
    try:
        on_stop_signals(lambda signum, _frame: got.append(signum))
        signal.raise_signal(signal.SIGTERM)
        signal.raise_signal(signal.SIGINT)
    finally:
        signal.signal(signal.SIGTERM, old[0])
        signal.signal(signal.SIGINT, old[1])
    assert got == [signal.SIGTERM, signal.SIGINT]
