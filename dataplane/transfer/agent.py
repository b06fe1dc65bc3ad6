"""The host agent: ``python -m seer.dataplane.transfer.agent``, one per host.

Owns this host's side of moving KV between hosts: it attaches the host's pool segment
(or, with ``--create``, creates it and unlinks it at exit), serves it with a
``BlockServer`` so other hosts can pull from it, and connects to the control plane as a
ZeroMQ DEALER (``seer.wire.make_socket``; CURVE keys from the config's ``[server]``
section on tcp://). It says ``AgentHello`` and then executes ``PullBlocks`` commands one
at a time, each answered by ``PullDone`` -- a failed pull is an answer, never a crash.
It exits on ``Shutdown``, ``HelloRejected``, SIGTERM/SIGINT, or when its parent dies.

It outlives control planes, like a joined engine: the control plane pings every agent it
knows each tick, so an agent that hears nothing for ``engines.heartbeat_timeout_s`` takes
it as gone (``control_plane_lost``) and says hello again every ``HELLO_REPEAT_S`` until
one answers -- a control plane restarted on the same address learns about it that way
(``seer.peer.PeerSession`` decides when, as for engines; the control plane takes a
repeated hello as a no-op).

``AgentProcess`` starts and stops one from Python (tests, benchmarks).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import msgspec
import structlog
import zmq

from seer.config import SeerConfig, load_config
from seer.protocol import PoolGeometry
from seer.dataplane.kvpool import KVPoolSegment, PoolError
from seer.dataplane.host import host_id
from seer.dataplane.transfer.blocks import TRANSPORTS, BlockServer, pull_blocks
from seer.protocol import (
    PROTOCOL_VERSION,
    AgentCommand,
    AgentHello,
    HelloRejected,
    Ping,
    PullBlocks,
    PullDone,
    Shutdown,
    unpack_token_ids,
)
from seer.peer import PeerSession
from seer.process import die_with_parent, on_stop_signals
from seer.wire import Codec, FrameError, make_socket

log = structlog.get_logger()

EXIT_OK = 0
EXIT_REJECTED = 1
EXIT_STARTUP_FAILED = 2
POLL_MS = 500


class Agent:
    def __init__(self, segment: KVPoolSegment, server: BlockServer, sock: zmq.Socket, transport: str,
                 pull_timeout_s: float, control_plane_timeout_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.segment = segment
        self.server = server
        self.sock = sock
        self.transport = transport
        self.pull_timeout_s = pull_timeout_s
        self.codec: Codec = Codec(AgentCommand)
        self.stopping = False
        self.num_hellos = 0
        self._clock = clock
        # timeout_s is engines.heartbeat_timeout_s: a joined engine takes the same
        # silence as the control plane gone; after a crash this host's engines and its
        # pool come back to the next control plane together.
        self.watch = PeerSession(control_plane_timeout_s, clock())

    def hello(self) -> AgentHello:
        return AgentHello(host_id=host_id(), protocol_version=PROTOCOL_VERSION, pid=os.getpid(),
                          pool_name=self.segment.path.name, geometry=self.segment.geometry,
                          num_blocks=self.segment.num_blocks, transport=self.transport, address=self.server.address)

    def run(self) -> int:
        self._send_hello()
        log.info("agent_registered", host_id=host_id(), pool=self.segment.path.name, transport=self.transport,
                 address=self.server.address[:64])
        while not self.stopping:
            if not self.sock.poll(POLL_MS):
                # Silence is judged only with nothing queued: pings that arrived during a
                # long pull are read first, so a pull never looks like a lost control plane.
                self._check_control_plane()
                continue
            frames = self.sock.recv_multipart()
            lost_s = self.watch.heard(self._clock())
            try:
                msg = self.codec.decode(frames)
            except FrameError as exc:
                log.warning("agent_frame_refused", code=exc.code, error=str(exc))
                continue
            if lost_s is not None and not isinstance(msg, HelloRejected):
                # Only an agent it registered gets pings and pulls: the hello got through.
                log.info("agent_reregistered", host_id=host_id(), pool=self.segment.path.name,
                         lost_s=round(lost_s, 1), num_hellos=self.num_hellos)
            match msg:
                case PullBlocks():
                    self._send(self.pull(msg))
                case HelloRejected(reason=reason):
                    log.error("agent_rejected", reason=reason)
                    return EXIT_REJECTED
                case Shutdown():
                    log.info("agent_shutdown_requested")
                    return EXIT_OK
                case Ping():
                    pass
        return EXIT_OK

    def _send(self, msg: object) -> bool:
        """Send now or not at all. A DEALER with no connection to take a message (a control
        plane refusing our CURVE handshake, say) would hold a blocking send -- and with it
        the agent, deaf to SIGTERM -- forever. A dropped hello is repeated; a dropped
        PullDone ends as the control plane's transfer timeout (the chunk re-prefills)."""
        try:
            self.sock.send_multipart(self.codec.encode(msg), flags=zmq.NOBLOCK)
        except zmq.Again:
            log.warning("agent_send_dropped", message=type(msg).__name__,
                        reason="no connection to the control plane can take it now")
            return False
        return True

    def _send_hello(self) -> None:
        self.num_hellos += 1
        if not self._send(self.hello()):
            self.watch.unanswered(self._clock())

    def _check_control_plane(self) -> None:
        now = self._clock()
        lost = self.watch.lost_since_s is not None
        if not self.watch.hello_due(now):
            return
        if not lost:
            # A control plane restarted on the address does not know this agent: it
            # learns about it from the hello (a live one takes a repeated hello as a no-op).
            silent_s = round(now - self.watch.last_heard_s, 1)
            log.error("control_plane_lost", host_id=host_id(), silent_s=silent_s,
                      effect=f"saying hello again every {self.watch.repeat_s:g} s until a control plane answers")
        self._send_hello()

    def pull(self, cmd: PullBlocks) -> PullDone:
        try:
            src_blocks, dst_blocks = unpack_token_ids(cmd.src_blocks), unpack_token_ids(cmd.dst_blocks)
            result = pull_blocks(cmd.transport, cmd.address, src_blocks, self.segment, dst_blocks, key=cmd.key,
                                 weights_version=cmd.weights_version, verify=cmd.verify,
                                 timeout_s=self.pull_timeout_s)
        except Exception as exc:  # noqa: BLE001 - a bad command is answered, the agent keeps serving
            log.exception("agent_pull_crashed", transfer_id=cmd.transfer_id)
            return PullDone(transfer_id=cmd.transfer_id, ok=False, error=f"{type(exc).__name__}: {exc}")
        if result.ok:
            log.info("blocks_pulled", transfer_id=cmd.transfer_id, num_blocks=len(dst_blocks),
                     num_bytes=result.num_bytes, ms=round(result.seconds * 1000, 3), transport=cmd.transport)
        else:
            log.warning("blocks_pull_failed", transfer_id=cmd.transfer_id, error=result.error,
                        transport=cmd.transport)
        return PullDone(transfer_id=cmd.transfer_id, ok=result.ok, num_bytes=result.num_bytes,
                        seconds=result.seconds, error=result.error)


def _load_config(path: str) -> SeerConfig:
    if not path:
        return SeerConfig()
    if path.endswith(".json"):  # what the control plane writes into its run dir
        return msgspec.json.decode(Path(path).read_bytes(), type=SeerConfig)
    return load_config(path)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m seer.dataplane.transfer.agent",
                                description="Serve this host's KV pool to other hosts and pull blocks into it.")
    p.add_argument("--connect", required=True, help="the control plane's engine address (tcp:// or ipc://)")
    p.add_argument("--pool", required=True, help="the pool segment's name under /dev/shm")
    p.add_argument("--bind-host", required=True, help="the IP other hosts reach this host's block server at")
    p.add_argument("--config", default="", help="seer.toml, or the JSON SeerConfig a daemon writes (default: built-in)")
    p.add_argument("--transport", choices=TRANSPORTS, default=None, help="overrides kv_pool.transport")
    p.add_argument("--create", action="store_true", help="create the segment (and unlink it at exit)")
    p.add_argument("--geometry", default="", help="with --create: the PoolGeometry as JSON")
    p.add_argument("--num-blocks", type=int, default=0, help="with --create: number of blocks")
    p.add_argument("--log-file", default="")
    p.add_argument("--pull-timeout-s", type=float, default=0.0, help="default: kv_pool.transfer_timeout_s")
    p.add_argument("--no-die-with-parent", action="store_true", help="keep running if the parent exits")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not args.no_die_with_parent:
        die_with_parent()
    from seer.auth import AuthError, client_curve
    from seer.logs import configure_logging

    config = _load_config(args.config)
    configure_logging("agent", Path(args.log_file) if args.log_file else None, config.logging.level)
    transport = args.transport or config.kv_pool.transport
    # SIGTERM (the control plane stopping us) ends the loop cleanly so the segment we
    # created is unlinked and the block server closed.
    agent: Agent | None = None

    def on_signal(signum: int, _frame: object) -> None:
        if agent is not None:
            agent.stopping = True
        else:
            raise SystemExit(128 + signum)

    on_stop_signals(on_signal)
    try:
        if args.create:
            if not args.geometry or args.num_blocks < 1:
                raise PoolError("--create needs --geometry JSON and --num-blocks N")
            geometry = msgspec.json.decode(args.geometry, type=PoolGeometry)
            segment = KVPoolSegment.create(args.pool, geometry, args.num_blocks)
        else:
            segment = KVPoolSegment.attach(args.pool)
    except (PoolError, OSError, msgspec.DecodeError) as exc:
        log.error("agent_start_failed", pool=args.pool, error=str(exc))
        print(f"agent: cannot use KV pool {args.pool!r}: {exc}", file=sys.stderr)
        return EXIT_STARTUP_FAILED
    ctx = zmq.Context()
    server: BlockServer | None = None
    try:
        server = BlockServer(segment, transport=transport, bind_host=args.bind_host)
        curve = client_curve(config.server, args.connect)
        sock = make_socket(ctx, zmq.DEALER, args.connect, bind=False,
                           identity=f"agent-{host_id()}-{os.getpid()}".encode(), curve=curve)
        agent = Agent(segment, server, sock, transport, args.pull_timeout_s or config.kv_pool.transfer_timeout_s,
                      config.engines.heartbeat_timeout_s)
        code = agent.run()
        sock.close(0)
        return code
    except (AuthError, ValueError, OSError) as exc:
        log.error("agent_start_failed", pool=args.pool, error=str(exc))
        print(f"agent: {exc}", file=sys.stderr)
        return EXIT_STARTUP_FAILED
    finally:
        if server is not None:
            server.close()
        ctx.term()
        segment.close()
        if args.create:
            segment.unlink()
        log.info("agent_stopped", pool=args.pool)


class AgentProcess:
    """A running agent process. ``prefix`` runs it under another command (for example
    ``["ip", "netns", "exec", NAME]`` to put it on another "host")."""

    def __init__(self, *, connect: str, pool: str, bind_host: str, transport: str | None = None,
                 config_file: str | Path = "", create: tuple[PoolGeometry, int] | None = None,
                 log_file: str | Path = "", prefix: Sequence[str] = (), stdout: object = None) -> None:
        cmd = [*prefix, sys.executable, "-m", "seer.dataplane.transfer.agent", "--connect", connect, "--pool", pool,
               "--bind-host", bind_host]
        if transport:
            cmd += ["--transport", transport]
        if config_file:
            cmd += ["--config", str(config_file)]
        if log_file:
            cmd += ["--log-file", str(log_file)]
        if create is not None:
            geometry, num_blocks = create
            cmd += ["--create", "--geometry", msgspec.json.encode(geometry).decode(), "--num-blocks", str(num_blocks)]
        self.cmd = cmd
        self.proc = subprocess.Popen(cmd, stdout=stdout, stderr=subprocess.STDOUT if stdout is not None else None)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def poll(self) -> int | None:
        return self.proc.poll()

    def stop(self, timeout_s: float = 20.0) -> int:
        """SIGTERM, then SIGKILL if it lingers; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                return self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        deadline = time.monotonic() + timeout_s
        while self.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        return self.proc.wait(timeout_s)


if __name__ == "__main__":
    sys.exit(main())
