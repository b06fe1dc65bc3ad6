"""The public face of ``seer.dataplane.transfer``: ``BlockServer`` and ``pull_blocks``.

A host's pool is served by a ``BlockServer``; another host copies blocks out of it into
its own pool with ``pull_blocks``, given only the server's opaque ``address`` (which
travels in control messages) and the blocks' descriptors. The transport is chosen by
name: ``"ucx"`` (ucx.py, imported on first use) or ``"tcp"`` (tcp.py, plain sockets).

A pull never leaves a wrong block behind: the destination blocks are invalidated before
any byte lands, and sealed only after every source tag and every received block's
checksum matched (blockwire.py). Whatever fails -- a tag, a checksum, the geometry, the
network, a timeout -- comes back as ``PullResult(ok=False, error=...)``, never raised.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from typing import Protocol

import msgspec
import numpy as np
import structlog

from seer.dataplane.kvpool import KVPoolSegment
from seer.dataplane.transfer import blockwire
from seer.dataplane.transfer.blockwire import BlockReply, BlockRequest, TransferError
from seer.dataplane.host import host_id

log = structlog.get_logger()

TRANSPORTS: tuple[str, ...] = ("ucx", "tcp")
DEFAULT_TIMEOUT_S = 30.0


class PullResult(msgspec.Struct, kw_only=True):
    ok: bool
    num_bytes: int
    seconds: float
    error: str = ""


def _check_transport(transport: str) -> None:
    if transport not in TRANSPORTS:
        raise ValueError(f"unknown transport {transport!r}; choose one of {', '.join(TRANSPORTS)}")


class BlockServer:
    """Serves reads of one local ``KVPoolSegment`` to pullers on other hosts (or this
    one). ``address`` is what pullers need; ``close`` stops serving (the segment stays)."""

    def __init__(self, segment: KVPoolSegment, *, transport: str, bind_host: str) -> None:
        _check_transport(transport)
        self.segment = segment
        self.transport = transport
        if transport == "tcp":
            from seer.dataplane.transfer.tcp import TcpBlockServer

            self._impl = TcpBlockServer(segment, bind_host)
        else:
            from seer.dataplane.rdma.ucx import UcxBlockServer

            self._impl = UcxBlockServer(segment, bind_host)
        self.address: str = self._impl.address
        log.info("block_server_started", transport=transport, pool=segment.path.name, bind_host=bind_host,
                 address=self.address[:64])

    def close(self) -> None:
        self._impl.close()

    def __enter__(self) -> BlockServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Puller(Protocol):
    """One transport's client side (tcp.TcpPuller, ucx.UcxPuller): send ``request``, hand
    the reply to ``on_reply`` (which checks it and returns the destination views, or
    raises TransferError), receive the runs into those views; raise TransferError."""

    def pull(self, address: str, request: BlockRequest,
             on_reply: Callable[[BlockReply], list[np.ndarray]], timeout_s: float) -> None: ...


# Pullers hold connections / UCX workers across pulls; one lock serialises pulls in a
# process (the agent runs one pull at a time anyway, and a UCX worker is single-threaded).
_lock = threading.Lock()
_pullers: dict[str, Puller] = {}
_request_ids = itertools.count(1)


def _puller(transport: str, address: str) -> Puller:
    if transport == "tcp":
        from seer.dataplane.transfer.tcp import TcpPuller

        return _pullers.get("tcp") or _pullers.setdefault("tcp", TcpPuller())
    from seer.dataplane.rdma import ucx

    # A server on another host gets a worker without shared-memory transports (ucx.py).
    server_host, _ = ucx.parse_address(address)
    remote = server_host != host_id()
    kind = "ucx-remote" if remote else "ucx-local"
    puller = _pullers.get(kind)
    if puller is None:
        puller = _pullers[kind] = ucx.UcxPuller(remote=remote)
    return puller


def pull_blocks(transport: str, address: str, src_blocks: list[int], dst: KVPoolSegment, dst_blocks: list[int],
                *, key: int, weights_version: int, verify: bool = True, first_index: int = 0,
                timeout_s: float = DEFAULT_TIMEOUT_S) -> PullResult:
    """Copy ``src_blocks`` of the pool served at ``address`` into ``dst_blocks`` of
    ``dst``. Source block i must hold block index ``first_index + i`` of ``key`` under
    ``weights_version``; the destination blocks are sealed the same way on success.
    ``verify`` checks each received block's checksum against its source tag."""
    _check_transport(transport)
    if len(src_blocks) != len(dst_blocks):
        raise ValueError(f"{len(src_blocks)} source blocks but {len(dst_blocks)} destination blocks")
    start = time.perf_counter()
    bad_dst = next((b for b in dst_blocks if not 0 <= b < dst.num_blocks), None)
    if bad_dst is not None:
        return PullResult(ok=False, num_bytes=0, seconds=0.0,
                          error=f"destination block {bad_dst} is out of range: the pool has {dst.num_blocks} blocks")
    if not src_blocks:
        return PullResult(ok=True, num_bytes=0, seconds=0.0)
    runs = blockwire.coalesce_runs(src_blocks, dst_blocks)
    request = BlockRequest(request_id=next(_request_ids), key=key, first_index=first_index,
                           weights_version=weights_version, src_blocks=blockwire.pack_blocks(src_blocks),
                           run_lengths=[n for _, _, n in runs], fingerprint=dst.geometry.fingerprint)
    src_tags: list[np.ndarray] = []

    def on_reply(reply: BlockReply) -> list[np.ndarray]:
        src_tags.append(blockwire.check_reply(reply, dst, len(src_blocks)))
        return [dst.blocks[d:d + n].reshape(-1) for _, d, n in runs]

    # Invalid before the first byte lands: a reader never takes half-written blocks.
    dst.invalidate(dst_blocks)
    try:
        with _lock:
            _puller(transport, address).pull(address, request, on_reply, timeout_s)
        checksums = blockwire.verify_received(dst, dst_blocks, src_tags[0], src_blocks, request, verify)
    except (TransferError, ValueError) as exc:
        dst.invalidate(dst_blocks)
        return PullResult(ok=False, num_bytes=0, seconds=time.perf_counter() - start, error=str(exc))
    blockwire.seal_verified(dst, dst_blocks, key, first_index, weights_version, checksums)
    return PullResult(ok=True, num_bytes=len(dst_blocks) * dst.geometry.bytes_per_block,
                      seconds=time.perf_counter() - start)
