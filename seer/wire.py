"""Framing, codecs and the one ZeroMQ socket factory.

Every Seer frame on the wire is a two-part ZeroMQ message: ``[b"seer/<version>",
msgpack payload]`` (ROUTER sockets add the peer identity in front). Carrying the
protocol version in its own frame lets a peer refuse a mismatch with a precise message
before trying to decode a payload whose schema it may not know.

Sockets: long-lived sides bind, ``LINGER=0``, every receive is bounded by the caller.
"""

from __future__ import annotations

from typing import Generic, TypeVar

import msgspec
import zmq

from seer.protocol import PROTOCOL_VERSION

T = TypeVar("T")

VERSION_FRAME = f"seer/{PROTOCOL_VERSION}".encode()


class FrameError(ValueError):
    """A frame that cannot be accepted; the message says why and is safe to send back."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class Codec(Generic[T]):
    """One encoder and one typed decoder, built once per socket."""

    def __init__(self, decode_type: type[T] | object, max_frame_bytes: int | None = None) -> None:
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(decode_type)
        self._max_frame_bytes = max_frame_bytes

    def encode(self, msg: object) -> list[bytes]:
        return [VERSION_FRAME, self._encoder.encode(msg)]

    def decode(self, frames: list[bytes]) -> T:
        """Decode ``[version, payload]``; raise FrameError with a human message."""
        if len(frames) != 2:
            raise FrameError(
                "malformed_frame",
                f"expected 2 frames [version, payload], got {len(frames)}; "
                "use seer.client or seer.wire.Codec to talk to Seer",
            )
        version, payload = frames
        if version != VERSION_FRAME:
            raise FrameError(
                "protocol_mismatch",
                f"peer speaks protocol {version[:32]!r}, this side speaks {VERSION_FRAME!r}; "
                "run the same Seer version on both sides",
            )
        if self._max_frame_bytes is not None and len(payload) > self._max_frame_bytes:
            raise FrameError(
                "frame_too_large",
                f"frame is {len(payload)} bytes, the limit is {self._max_frame_bytes} "
                "(server.max_request_bytes in seer.toml); split the rollout into smaller calls",
            )
        try:
            return self._decoder.decode(payload)
        except msgspec.DecodeError as exc:  # ValidationError is a subclass
            raise FrameError("invalid_message", f"invalid message: {exc}") from None


def make_socket(
    ctx: zmq.Context,
    socket_type: int,
    address: str,
    *,
    bind: bool,
    identity: bytes | None = None,
    max_message_bytes: int | None = None,
    curve: dict[str, bytes] | None = None,
) -> zmq.Socket:
    """Create, configure and bind or connect a socket (the only place sockets are made)."""
    sock = ctx.socket(socket_type)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        if identity is not None:
            sock.setsockopt(zmq.IDENTITY, identity)
        if max_message_bytes is not None:
            # Hard cap against memory abuse; the app-level limit (smaller) answers politely.
            sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
        if socket_type == zmq.ROUTER:
            sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        if curve is not None:
            for opt, value in curve.items():
                sock.setsockopt(getattr(zmq, opt), value)
        if bind:
            sock.bind(address)
        else:
            sock.connect(address)
    except zmq.ZMQError:
        sock.close(0)  # an unclosed socket would make the caller's ctx.term() wait forever
        raise
    return sock
