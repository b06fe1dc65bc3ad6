"""The daemon's Prometheus endpoint: ``GET /metrics`` over HTTP, served on the event loop.

Owns the listening socket of ``[metrics]`` (bound at start-up, before any engine is spawned,
so a port already in use stops ``seerctl start`` with one line and leaves nothing behind)
and the tiny HTTP/1.1 responder that renders the control plane's registry with
prometheus_client's text exposition. It runs on the control plane's own loop rather than in
prometheus_client's server thread: the scrape-time collector (``metrics_state.py``) reads
the scheduler's tables, which only the loop may touch. One request per connection.
"""

from __future__ import annotations

import asyncio
import socket

import structlog
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from seer.config import MetricsConfig, OpenAIConfig

log = structlog.get_logger()

# A scraper that has not sent its request head within this long is dropped.
REQUEST_TIMEOUT_S = 10.0
MAX_HEAD_BYTES = 16384


class MetricsBindError(RuntimeError):
    """The metrics port could not be bound; the message says which and the fix."""


def bind_metrics_socket(config: MetricsConfig | OpenAIConfig, section: str = "metrics") -> socket.socket:
    """A listening TCP socket on ``config.host:config.port`` (port 0: any free port) for the
    ``section`` of seer.toml (``metrics``, or ``openai``: the OpenAI endpoint's)."""
    try:
        infos = socket.getaddrinfo(config.host, config.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise MetricsBindError(f"{section}.host = {config.host!r} does not resolve ({exc.strerror}); "
                               f"set {section}.host in seer.toml to an address of this machine") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(64)
    except OSError as exc:
        sock.close()
        raise MetricsBindError(f"cannot serve {section} on {config.host}:{config.port}: {exc.strerror}; "
                               f"set another {section}.port in seer.toml (or {section}.enabled = false)") from None
    sock.setblocking(False)
    return sock


def metrics_url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://{f'[{host}]' if ':' in host else host}:{port}/metrics"


async def serve_metrics(sock: socket.socket, registry: CollectorRegistry) -> None:
    """Answer scrapes on ``sock`` until cancelled (then the socket is closed)."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), REQUEST_TIMEOUT_S)
            method, _, rest = head.partition(b" ")
            path = rest.partition(b" ")[0].partition(b"?")[0]
            if method not in (b"GET", b"HEAD"):
                status, body, kind = b"405 Method Not Allowed", b"only GET\n", b"text/plain"
            elif path in (b"/metrics", b"/"):
                status, body, kind = b"200 OK", generate_latest(registry), CONTENT_TYPE_LATEST.encode()
            else:
                status, body, kind = b"404 Not Found", b"see /metrics\n", b"text/plain"
            writer.write(b"HTTP/1.1 " + status + b"\r\nContent-Type: " + kind + b"\r\nContent-Length: "
                         + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n"
                         + (body if method != b"HEAD" else b""))
            await writer.drain()
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            pass  # a scraper that went away or sent garbage: nothing to answer
        except Exception:  # noqa: BLE001 - a failed render must not end the endpoint
            log.exception("metrics_scrape_failed")
        finally:
            writer.close()

    server = await asyncio.start_server(handle, sock=sock, limit=MAX_HEAD_BYTES)
    log.info("metrics_serving", url=metrics_url(sock))
    try:
        await server.serve_forever()
    finally:
        server.close()
