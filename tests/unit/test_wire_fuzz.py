"""Fuzzing the wire codec: random and mutated frames decode to a message or raise FrameError
with a code and a message, never anything else (issue 14, "beyond the fixes")."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings

from seer import protocol as p
from seer.wire import Codec, FrameError
from tests.wire_strategies import frames

CODES = {"malformed_frame", "protocol_mismatch", "frame_too_large", "invalid_message"}
CODECS = {
    "client": Codec(p.ClientMessage, max_frame_bytes=4096),
    "server": Codec(p.ServerMessage),
    "engine": Codec(p.EngineMessage),
    "control": Codec(p.ControlMessage),
}


@settings(max_examples=400, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(frames)
def test_any_frames_decode_or_raise_frame_error(raw):
    """Every decoder of every direction returns a message or raises FrameError with a known
    code and a non-empty message for any list of frames."""
    for codec in CODECS.values():
        try:
            codec.decode(raw)
        except FrameError as exc:
            assert exc.code in CODES and str(exc)


@settings(max_examples=200, deadline=None, database=None)
@given(frames)
def test_a_decoded_client_message_re_encodes_to_an_equal_message(raw):
    """What the client decoder accepts is a well-typed message: it round-trips unchanged."""
    codec = CODECS["client"]
    try:
        msg = codec.decode(raw)
    except FrameError:
        return
    assert codec.decode(codec.encode(msg)) == msg
