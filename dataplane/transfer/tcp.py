"""The ``tcp`` transport: the pull protocol over plain Python sockets, no UCX.

Works wherever TCP does (the fallback). One listening socket per ``TcpBlockServer``,
one thread per connected puller; pullers keep one connection per server address and
run one pull at a time on it. Frames are a 4-byte little-endian length + msgpack
(``blockwire``); run bytes follow an ok reply raw, sent from and received into the
segments' own memory (``sendall`` / ``recv_into`` on views, no staging copy).
"""

from __future__ import annotations

import socket
import struct
import threading
from collections.abc import Callable

import numpy as np
import structlog

from seer.dataplane.kvpool import KVPoolSegment
from seer.dataplane.transfer import blockwire
from seer.dataplane.transfer.blockwire import BlockReply, BlockRequest, TransferError

log = structlog.get_logger()

PREFIX = "tcp://"
_LEN = struct.Struct("<I")


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    while len(view):
        n = sock.recv_into(view)
        if n == 0:
            raise ConnectionError("the peer closed the connection")
        view = view[n:]


def _recv_frame(sock: socket.socket) -> bytearray:
    head = bytearray(_LEN.size)
    _recv_exact(sock, memoryview(head))
    (n,) = _LEN.unpack(head)
    if n > blockwire.MAX_FRAME_BYTES:
        raise ConnectionError(f"frame of {n} bytes exceeds the limit of {blockwire.MAX_FRAME_BYTES}")
    body = bytearray(n)
    _recv_exact(sock, memoryview(body))
    return body


def _send_frame(sock: socket.socket, payload: bytes) -> None:
    sock.sendall(_LEN.pack(len(payload)) + payload)


def parse_address(address: str) -> tuple[str, int]:
    if not address.startswith(PREFIX):
        raise ValueError(f"not a tcp block server address: {address!r} (expected tcp://HOST:PORT)")
    host, _, port = address[len(PREFIX):].rpartition(":")
    return host.strip("[]"), int(port)


class TcpBlockServer:
    """Serves one segment's blocks on ``bind_host``; a thread per connection."""

    def __init__(self, segment: KVPoolSegment, bind_host: str) -> None:
        if bind_host in ("", "0.0.0.0", "::"):
            raise ValueError(f"bind_host {bind_host!r}: give the address other hosts reach this one at "
                             "(it is also what the server advertises)")
        self.segment = segment
        family = socket.AF_INET6 if ":" in bind_host else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind((bind_host, 0))
        self._listener.listen(64)
        port = self._listener.getsockname()[1]
        host = f"[{bind_host}]" if family == socket.AF_INET6 else bind_host
        self.address = f"{PREFIX}{host}:{port}"
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        self._thread = threading.Thread(target=self._accept_loop, name="tcp-block-server", daemon=True)
        self._thread.start()

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        # shutdown() wakes the thread blocked in accept(); close() alone may not.
        for sock in [self._listener, *self._connections()]:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()
        self._thread.join(10)

    def _connections(self) -> list[socket.socket]:
        with self._lock:
            return list(self._conns)

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                conn, peer = self._listener.accept()
            except OSError:
                return  # closed
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self._conns.add(conn)
            threading.Thread(target=self._serve, args=(conn, peer), name="tcp-block-conn", daemon=True).start()

    def _serve(self, conn: socket.socket, peer: object) -> None:
        try:
            while not self._closed.is_set():
                try:
                    frame = _recv_frame(conn)
                except (ConnectionError, OSError):
                    return  # puller went away (or we are closing)
                try:
                    request = blockwire.decode_request(frame)
                except Exception as exc:  # noqa: BLE001 - a bad frame ends this connection, never the server
                    log.warning("block_request_refused", transport="tcp", peer=str(peer), error=str(exc))
                    _send_frame(conn, blockwire.encode(BlockReply(request_id=0, ok=False,
                                                                  error=f"malformed request: {exc}")))
                    return
                reply, runs = blockwire.serve_request(self.segment, request)
                _send_frame(conn, blockwire.encode(reply))
                for start, n in runs:
                    conn.sendall(self.segment.blocks[start:start + n].reshape(-1))
        except OSError as exc:
            if not self._closed.is_set():
                log.warning("block_serve_failed", transport="tcp", peer=str(peer), error=str(exc))
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()


class TcpPuller:
    """One connection per server address, reused across pulls (callers serialise)."""

    def __init__(self) -> None:
        self._conns: dict[str, socket.socket] = {}

    def pull(self, address: str, request: BlockRequest,
             on_reply: Callable[[BlockReply], list[np.ndarray]], timeout_s: float) -> None:
        # A kept connection may have been closed by a server that restarted or dropped
        # it; the request is read-only, so it is retried once on a fresh connection.
        for attempt in (0, 1):
            reused = address in self._conns
            try:
                sock = self._conns.get(address)
                if sock is None:
                    sock = socket.create_connection(parse_address(address), timeout=timeout_s)
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    self._conns[address] = sock
                sock.settimeout(timeout_s)
                _send_frame(sock, blockwire.encode(request))
                reply = blockwire.decode_reply(_recv_frame(sock))
                break
            except (OSError, ConnectionError, ValueError) as exc:
                self._drop(address)
                if not (reused and attempt == 0) or isinstance(exc, TimeoutError):
                    raise TransferError(f"tcp pull from {address} failed: {exc}") from exc
        try:
            views = on_reply(reply)
        except TransferError:
            if reply.ok:
                self._drop(address)  # the run bytes are already on their way: the stream is unusable
            raise
        try:
            for view in views:
                _recv_exact(sock, memoryview(view))
        except (OSError, ConnectionError) as exc:
            self._drop(address)
            raise TransferError(f"tcp pull from {address} failed while receiving blocks: {exc}") from exc

    def _drop(self, address: str) -> None:
        sock = self._conns.pop(address, None)
        if sock is not None:
            sock.close()

    def close(self) -> None:
        for address in list(self._conns):
            self._drop(address)
