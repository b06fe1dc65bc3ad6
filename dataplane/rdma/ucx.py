"""The ``ucx`` transport: the pull protocol over UCX tag messages (ucxx).

Imported only when a ``ucx`` server or pull is made (``ucxx`` loads libucx and friends,
~0.5-1 s). Choices (docs/multi-host.md, "How the ucx transport uses UCX, and why"):

* **worker-address endpoints**, error handling off: a listener endpoint (or error
  handling on) made UCX fall back to tcp on the same host, 4-6x slower than its
  shared-memory path. The server's worker address travels in the ``ucx:`` address string;
  the puller's travels in each request, and the server connects back to it.
* **progress mode "blocking"**: wait on the worker's event fd (never busy-poll; the 2
  cores are shared); every wait is bounded by a deadline.
* **UCX picks the transports**, with one exception: a puller whose server is on another
  host (``host_id`` differs) uses a context without UCX's shared-memory transports.
  Network namespaces on one kernel look like one node to UCX (same machine id), and its
  sysv/posix paths then hang (their wake-up sockets live in the other namespace); real
  separate hosts never use them anyway.

Tags: a request goes to ``REQUEST_TAG``; the reply to the puller's unique ``reply_tag``
and run i to ``reply_tag + 1 + i``, so concurrent pullers never see each other's bytes.
A pull that times out cancels its posted receives before the destination blocks can be
reused.
"""

from __future__ import annotations

import os
import secrets
import select
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

# ucxx sets UCX_MEMTYPE_CACHE, which this CPU build of UCX does not know; without this UCX
# prints a warning in every process.
os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")

import numpy as np  # noqa: E402
import structlog  # noqa: E402
import ucxx._lib.libucxx as ucx_api  # noqa: E402
from ucxx._lib.arr import Array  # noqa: E402

from seer.dataplane.kvpool import KVPoolSegment  # noqa: E402
from seer.dataplane.transfer import blockwire  # noqa: E402
from seer.dataplane.transfer.blockwire import BlockReply, BlockRequest, TransferError  # noqa: E402
from seer.dataplane.host import host_id  # noqa: E402

log = structlog.get_logger()

PREFIX = "ucx:"
REQUEST_TAG = 1
MAX_RUNS = (1 << 16) - 2  # run i's tag is reply_tag + 1 + i inside the pull's 16-bit tag space
_POLL_MS = 100  # longest blocking wait before re-checking deadlines and the stop flag
SERVE_TIMEOUT_S = 60.0  # a puller that stops receiving is given up after this long (its endpoint closed)
# Without shared-memory transports (see the module docstring); "sm" is UCX's alias for them.
_REMOTE_CONFIG = {"TLS": "^sm"}


class _Worker:
    """A UCX context + worker in blocking progress mode, driven by one thread.

    Waiting follows UCX's rule for ``ucp_worker_arm``: progress, check the condition,
    and sleep on the event fd only if ``arm`` says nothing is pending -- sleeping right
    after a progress that consumed the awaited event would miss it until the timeout.
    """

    def __init__(self, config: dict[str, str] | None) -> None:
        self.ctx = ucx_api.UCXContext(config_dict=config or {},
                                      feature_flags=(ucx_api.Feature.TAG, ucx_api.Feature.WAKEUP))
        self.worker = ucx_api.UCXWorker(self.ctx)
        self.worker.init_blocking_progress_mode()
        self._poller = select.poll()
        self._poller.register(self.worker.epoll_file_descriptor, select.POLLIN)

    def address(self) -> bytes:
        return self.worker.address.tobytes()

    def sleep(self, deadline: float) -> None:
        if self.worker.arm():
            remaining_ms = (deadline - time.monotonic()) * 1000
            self._poller.poll(_POLL_MS if remaining_ms > _POLL_MS else max(0, int(remaining_ms)))

    def wait(self, requests: list, deadline: float, what: str) -> None:
        while True:
            self.worker.progress()
            if all(r.completed for r in requests):
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what} did not complete in time")
            self.sleep(deadline)
        for r in requests:
            r.check_error()

    def receive(self, probe: ucx_api.TagProbeResult, deadline: float) -> bytes:
        """The message a ``tag_probe(remove=True)`` matched."""
        buf = np.empty(probe.length, dtype=np.uint8)
        self.wait([self.worker.tag_recv_with_handle(Array(buf), probe)], deadline, "receiving a message")
        return buf.tobytes()

    def recv_message(self, tag: int, deadline: float, stop: threading.Event | None = None) -> bytes | None:
        """The next message with ``tag`` (any sender); None if ``stop`` was set first."""
        while True:
            self.worker.progress()
            probe = self.worker.tag_probe(ucx_api.UCXXTag(tag), remove=True)
            if probe.matched:
                return self.receive(probe, deadline)
            if stop is not None and stop.is_set():
                return None
            if time.monotonic() > deadline:
                raise TimeoutError("no reply from the block server in time")
            self.sleep(deadline)

    def close(self) -> None:
        self._poller.unregister(self.worker.epoll_file_descriptor)
        del self.worker, self.ctx  # the worker before its context


def parse_address(address: str) -> tuple[str, bytes]:
    """``ucx:<host id>:<worker address, hex>`` -> (host id, worker address)."""
    if not address.startswith(PREFIX):
        raise ValueError(f"not a ucx block server address: {address[:40]!r} (expected ucx:HOST:HEX)")
    host, _, hex_address = address[len(PREFIX):].rpartition(":")
    return host, bytes.fromhex(hex_address)


class UcxBlockServer:
    """Serves one segment's blocks from a UCX worker run by one thread."""

    def __init__(self, segment: KVPoolSegment, bind_host: str) -> None:
        # bind_host is not used: UCX advertises every usable interface in the worker
        # address and the puller's UCX picks one (documented in docs/multi-host.md).
        self.segment = segment
        self.bind_host = bind_host
        self._stop = threading.Event()
        started = threading.Event()
        self._error: BaseException | None = None
        self.address = ""
        self._thread = threading.Thread(target=self._run, args=(started,), name="ucx-block-server", daemon=True)
        self._thread.start()
        started.wait(60)
        if self._error is not None:
            raise self._error
        if not self.address:
            raise RuntimeError("the UCX block server did not start within 60 s")

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self, started: threading.Event) -> None:
        try:
            worker = _Worker(None)
            self.address = f"{PREFIX}{host_id()}:{worker.address().hex()}"
        except BaseException as exc:  # noqa: BLE001 - handed to the constructor's thread
            self._error = exc
            started.set()
            return
        started.set()
        # Sends are not awaited one pull at a time: a puller that gave up (its receives
        # cancelled) would otherwise stall every other puller until SERVE_TIMEOUT_S.
        endpoints: dict[bytes, ucx_api.UCXEndpoint] = {}
        sending: list[_Sending] = []
        while not self._stop.is_set():
            try:
                worker.worker.progress()
                probe = worker.worker.tag_probe(ucx_api.UCXXTag(REQUEST_TAG), remove=True)
                if probe.matched:
                    frame = worker.receive(probe, time.monotonic() + SERVE_TIMEOUT_S)
                    started_send = self._start(worker, endpoints, sending, frame)
                    if started_send is not None:
                        sending.append(started_send)
                    continue
                sending = self._reap(endpoints, sending)
                worker.sleep(time.monotonic() + _POLL_MS / 1000)
            except Exception:  # noqa: BLE001 - one bad pull must not stop the server
                log.exception("block_serve_failed", transport="ucx")
        sending.clear()
        endpoints.clear()  # endpoints before the worker
        worker.close()

    def _start(self, worker: _Worker, endpoints: dict[bytes, ucx_api.UCXEndpoint], sending: list[_Sending],
               frame: bytes) -> _Sending | None:
        try:
            request = blockwire.decode_request(frame)
        except Exception as exc:  # noqa: BLE001 - no reply address to answer to
            log.warning("block_request_refused", transport="ucx", error=str(exc))
            return None
        ep = endpoints.get(request.reply_address)
        if ep is None:
            if len(endpoints) >= 256:  # pullers come and go; keep the cache bounded
                busy = {s.reply_address for s in sending}
                for address in [a for a in endpoints if a not in busy]:
                    del endpoints[address]
            ep = worker.worker.create_endpoint_from_worker_address(
                ucx_api.UCXAddress.create_from_buffer(request.reply_address), False)
            endpoints[request.reply_address] = ep
        reply, runs = blockwire.serve_request(self.segment, request)
        header = np.frombuffer(blockwire.encode(reply), dtype=np.uint8).copy()
        buffers = [header, *(self.segment.blocks[start:start + n].reshape(-1) for start, n in runs)]
        sends = [ep.tag_send(Array(buf), ucx_api.UCXXTag(request.reply_tag + i)) for i, buf in enumerate(buffers)]
        return _Sending(request.reply_address, request.request_id, sends, buffers,
                        time.monotonic() + SERVE_TIMEOUT_S)

    @staticmethod
    def _reap(endpoints: dict[bytes, ucx_api.UCXEndpoint], sending: list[_Sending]) -> list[_Sending]:
        """Drop finished sends; give up on those past their deadline by closing the
        puller's endpoint (which cancels them)."""
        still: list[_Sending] = []
        now = time.monotonic()
        for s in sending:
            if all(r.completed for r in s.requests):
                for r in s.requests:
                    try:
                        r.check_error()
                    except Exception as exc:  # noqa: BLE001 - the puller sees the failure on its side
                        log.warning("block_send_failed", transport="ucx", request_id=s.request_id, error=str(exc))
                        break
            elif now > s.deadline:
                ep = endpoints.pop(s.reply_address, None)
                if ep is not None:
                    ep.close()
                log.warning("block_send_timed_out", transport="ucx", request_id=s.request_id,
                            timeout_s=SERVE_TIMEOUT_S)
            else:
                still.append(s)
        return still


@dataclass
class _Sending:
    """A pull being answered. ``buffers`` keeps the sent memory alive until UCX is done
    with it (the reply header is a temporary; UCX reads it while the send is in flight)."""

    reply_address: bytes
    request_id: int
    requests: list
    buffers: list[np.ndarray]
    deadline: float


class UcxPuller:
    """A UCX worker for pulling (one for servers on this host, one for other hosts),
    with one endpoint per server address. Callers serialise pulls."""

    def __init__(self, remote: bool) -> None:
        self.remote = remote
        self._w = _Worker(_REMOTE_CONFIG if remote else None)
        self._worker = self._w.worker
        self._my_address = self._w.address()
        self._nonce = secrets.randbelow((1 << 23) - 1) + 1  # nonzero: never REQUEST_TAG
        self._seq = 0
        self._endpoints: dict[str, ucx_api.UCXEndpoint] = {}

    def _next_tag(self) -> int:
        self._seq = (self._seq + 1) & 0xFFFFFF
        return (self._nonce << 40) | (self._seq << 16)

    def pull(self, address: str, request: BlockRequest,
             on_reply: Callable[[BlockReply], list[np.ndarray]], timeout_s: float) -> None:
        _, worker_address = parse_address(address)
        if len(request.run_lengths) > MAX_RUNS:
            raise TransferError(f"{len(request.run_lengths)} runs in one pull; at most {MAX_RUNS}")
        request.reply_address = self._my_address
        request.reply_tag = self._next_tag()
        deadline = time.monotonic() + timeout_s
        posted: list = []
        try:
            ep = self._endpoints.get(address)
            if ep is None:
                ep = self._worker.create_endpoint_from_worker_address(
                    ucx_api.UCXAddress.create_from_buffer(worker_address), False)
                self._endpoints[address] = ep
            frame = np.frombuffer(blockwire.encode(request), dtype=np.uint8).copy()
            posted = [ep.tag_send(Array(frame), ucx_api.UCXXTag(REQUEST_TAG))]
            reply = blockwire.decode_reply(self._w.recv_message(request.reply_tag, deadline))
            self._w.wait(posted, deadline, "sending the request")
            views = on_reply(reply)  # raises TransferError for a refused pull
            posted = [self._worker.tag_recv(Array(view), ucx_api.UCXXTag(request.reply_tag + 1 + i))
                      for i, view in enumerate(views)]
            self._w.wait(posted, deadline, "receiving blocks")
        except TransferError:
            raise
        except Exception as exc:  # noqa: BLE001 - UCX errors, timeouts: all end this pull the same way
            # Receives still posted would write into destination blocks the caller may
            # reuse: cancel them, and start the endpoint afresh next time.
            self._worker.cancel_inflight_requests()
            self._endpoints.pop(address, None)
            raise TransferError(f"ucx pull from {address[:48]}... failed: {exc}") from exc

    def close(self) -> None:
        self._endpoints.clear()
        self._w.close()
