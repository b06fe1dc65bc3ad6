"""ZeroMQ CURVE on tcp:// sockets: key files, socket options, and the door keeper.

Owns three things:

- **Key files.** ``generate_keys(DIR)`` (``seerctl keys DIR``) writes a server keypair
  and a client keypair in pyzmq's certificate format (``NAME.key`` holds the public
  key, ``NAME.key_secret`` both keys; secret files are mode 0600) and an
  ``authorized/`` folder holding the public keys the server lets in (the client's, to
  start with). Engines and trainers use a client keypair; more hosts get their own
  keypair, with its ``.key`` copied into ``authorized/``.
- **Socket options.** ``server_curve`` / ``client_curve`` turn the ``[server]`` key
  fields of seer.toml into the options ``seer.wire.make_socket`` sets. They apply to
  ``tcp://`` addresses only: ``ipc://`` sockets are guarded by the run dir's file
  permissions and never pay for encryption.
- **Refusals.** ``ZapHandler`` answers the ZAP requests libzmq makes for every CURVE
  handshake on a server socket: a client key in ``authorized/`` is let in, any other is
  refused and logged as ``peer_refused`` with the peer address and key. A peer that
  does not even know the server's public key (or speaks no CURVE) fails the handshake
  before ZAP is asked; ``watch_handshakes`` logs those from the socket monitor, once
  per kind and then at most every ``REFUSAL_LOG_INTERVAL_S`` (a refused peer retries
  ten times a second).
"""

from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path

import structlog
import zmq
import zmq.asyncio
import zmq.auth
from zmq.utils.monitor import recv_monitor_message

from seer.config import ServerConfig

log = structlog.get_logger()

ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # fixed by the ZAP spec (RFC 27)
ZAP_DOMAIN = b"seer"


class AuthError(RuntimeError):
    """Key material is missing or unusable; the message names the file and the fix."""


def is_tcp(address: str) -> bool:
    return address.startswith("tcp://")


def generate_keys(directory: Path) -> dict[str, Path]:
    """Write server and client keypairs and ``authorized/client.key`` into ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    authorized = directory / "authorized"
    authorized.mkdir(exist_ok=True)
    files: dict[str, Path] = {}
    for name in ("server", "client"):
        public, secret = (Path(p) for p in zmq.auth.create_certificates(directory, name))
        os.chmod(secret, 0o600)
        files[f"{name}_public"] = public
        files[f"{name}_secret"] = secret
    shutil.copy(files["client_public"], authorized / "client.key")
    files["authorized"] = authorized
    return files


def _load(path: str, field: str, need_secret: bool) -> tuple[bytes, bytes | None]:
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise AuthError(f"server.{field} = {path!r}: not a readable CURVE key file ({exc}); "
                        "create keys with `seerctl keys DIR`") from None
    if need_secret and secret is None:
        raise AuthError(f"server.{field} = {path!r} holds no secret key; name the `.key_secret` file "
                        "written by `seerctl keys`")
    return public, secret


def server_curve(server: ServerConfig, address: str) -> dict[str, object] | None:
    """Socket options for a server (bind) socket on ``address``; None: plain."""
    if not is_tcp(address) or not server.curve_server_secret_key:
        return None
    public, secret = _load(server.curve_server_secret_key, "curve_server_secret_key", need_secret=True)
    return {"ZAP_DOMAIN": ZAP_DOMAIN, "CURVE_SERVER": 1, "CURVE_PUBLICKEY": public, "CURVE_SECRETKEY": secret}


def client_curve(server: ServerConfig, address: str) -> dict[str, object] | None:
    """Socket options for a client or engine (connect) socket on ``address``; None: plain."""
    if not is_tcp(address) or not (server.curve_server_public_key or server.curve_client_secret_key):
        return None
    keys = ClientKeys.from_config(server)
    if keys is None:
        raise AuthError("connecting over CURVE needs both server.curve_server_public_key (the server's `.key`) "
                        "and server.curve_client_secret_key (this host's `.key_secret`); set both")
    return keys.socket_options()


class ClientKeys:
    """A trainer's or tool's CURVE keys: the server's public key file and its own
    keypair file (``seerctl keys`` writes ``server.key`` and ``client.key_secret``)."""

    def __init__(self, server_public_key: str | os.PathLike[str], secret_key: str | os.PathLike[str]) -> None:
        self.server_public_key = str(server_public_key)
        self.secret_key = str(secret_key)

    @classmethod
    def from_config(cls, server: ServerConfig) -> ClientKeys | None:
        if not (server.curve_server_public_key and server.curve_client_secret_key):
            return None
        return cls(server.curve_server_public_key, server.curve_client_secret_key)

    @classmethod
    def from_info(cls, info: dict) -> ClientKeys | None:
        """The keys a daemon recorded in its daemon.json for local tools (seerctl status, stop)."""
        if not (info.get("curve_server_public_key") and info.get("curve_client_secret_key")):
            return None
        return cls(info["curve_server_public_key"], info["curve_client_secret_key"])

    @classmethod
    def from_dir(cls, directory: str | os.PathLike[str]) -> ClientKeys:
        """The files ``seerctl keys DIR`` wrote."""
        return cls(Path(directory) / "server.key", Path(directory) / "client.key_secret")

    def socket_options(self) -> dict[str, object]:
        server_public, _ = _load(self.server_public_key, "curve_server_public_key", need_secret=False)
        public, secret = _load(self.secret_key, "curve_client_secret_key", need_secret=True)
        return {"CURVE_SERVERKEY": server_public, "CURVE_PUBLICKEY": public, "CURVE_SECRETKEY": secret}


class ZapHandler:
    """The context's ZAP endpoint: CURVE clients whose key is authorized get in.

    Plain (NULL) handshakes — the ipc sockets — are let through: only CURVE sockets set
    a ZAP domain, and libzmq asks ZAP about NULL peers only on sockets that do.
    """

    def __init__(self, ctx: zmq.asyncio.Context, authorized_dir: str) -> None:
        self.authorized_dir = authorized_dir
        try:
            self.keys = set(zmq.auth.load_certificates(authorized_dir))
        except (OSError, ValueError) as exc:
            raise AuthError(f"server.curve_authorized_keys = {authorized_dir!r}: cannot read public keys ({exc}); "
                            "point it at the `authorized/` folder written by `seerctl keys`") from None
        self.num_refused = 0
        self._sock = ctx.socket(zmq.REP)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(ZAP_ENDPOINT)
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._serve())
        log.info("zap_handler_started", authorized_dir=self.authorized_dir, num_authorized_keys=len(self.keys))

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        self._sock.close(0)

    async def _serve(self) -> None:
        while True:
            request = await self._sock.recv_multipart()
            try:
                reply = self.decide(request)
            except Exception:  # noqa: BLE001 - a bad request must not stop the door keeper
                log.exception("zap_request_failed")
                reply = [b"1.0", request[1] if len(request) > 1 else b"", b"500", b"internal error", b"", b""]
            await self._sock.send_multipart(reply)

    def decide(self, request: list[bytes]) -> list[bytes]:
        """One ZAP request -> one ZAP reply (RFC 27 frames), logging refusals."""
        if len(request) < 6:
            self.num_refused += 1
            log.warning("peer_refused", reason="malformed ZAP request", num_frames=len(request))
            return [b"1.0", request[1] if len(request) > 1 else b"", b"400", b"malformed request", b"", b""]
        version, request_id, _domain, address, _identity, mechanism = request[:6]
        credentials = request[6:]
        if mechanism == b"NULL":
            return [version, request_id, b"200", b"OK", b"", b""]
        if mechanism == b"CURVE" and len(credentials) == 1:
            key = zmq.utils.z85.encode(credentials[0])
            if key in self.keys:
                return [version, request_id, b"200", b"OK", key, b""]
            reason = "client key not in the authorized keys"
        else:
            key = b""
            reason = f"mechanism {mechanism.decode(errors='replace')} not accepted"
        self.num_refused += 1
        log.warning("peer_refused", peer_address=address.decode(errors="replace"), client_key=key.decode(),
                    reason=reason, authorized_dir=self.authorized_dir)
        return [version, request_id, b"400", reason.encode(), b"", b""]


_HANDSHAKE_REASONS = {
    zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH: "handshake failed: the peer does not speak CURVE (no keys)",
    zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC: "handshake failed: the peer encrypted for another server key",
}
# A refused peer retries every ~0.1 s (ZeroMQ reconnects); log each kind of refusal
# once, then at most once per this many seconds with the count in between.
REFUSAL_LOG_INTERVAL_S = 10.0


async def watch_handshakes(sock: zmq.asyncio.Socket, name: str) -> None:
    """Log ``peer_refused`` for handshakes that fail before ZAP is asked (runs until cancelled)."""
    monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL)
    last_logged: dict[int, float] = {}
    num_since: dict[int, int] = {}
    loop = asyncio.get_running_loop()
    try:
        while True:
            event = await recv_monitor_message(monitor)
            code = event["value"]
            num_since[code] = num_since.get(code, 0) + 1
            now = loop.time()
            if now - last_logged.get(code, -REFUSAL_LOG_INTERVAL_S) < REFUSAL_LOG_INTERVAL_S:
                continue
            reason = _HANDSHAKE_REASONS.get(code, "handshake failed: the peer hung up or broke the handshake "
                                            "(no CURVE, or the wrong keys)")
            log.warning("peer_refused", socket=name, reason=reason,
                        endpoint=event["endpoint"].decode(errors="replace"), error_code=code,
                        num_refused=num_since.pop(code))
            last_logged[code] = now
    finally:
        sock.disable_monitor()
        monitor.close(0)
