"""The grouped draft server process: one per host, ``python -m seer.dataplane.draft_server``.

Owns the shell around ``DraftServerCore`` (dataplane/draft_core.py): finding engines'
rings, moving records between them, the TTL clock, and its own lifecycle files.

Rendezvous, all through the run dir and /dev/shm:

- At start the server writes ``RUNDIR/draft-server.json`` (``DraftServerInfo``: its pid,
  the ring size, the TTL) and removes rings left by dead servers or dead engines.
- Each engine's ``DraftClient`` reads that file and creates its two rings,
  ``seer-draft-<server pid>-<engine id>-<client pid>-down`` then ``...-up`` (the up ring
  last: its existence means both are ready). The client is the up ring's producer and
  the down ring's consumer; the server the other way round.
- The server scans /dev/shm for its up rings every ``scan_interval_s`` (records written
  before it attaches wait in the ring). A connection whose up ring vanished (the client
  closed) or whose client pid died is dropped and its rings unlinked.
- At stop (SIGTERM/SIGINT) the server unlinks every ring carrying its pid and removes
  the info file; clients notice the dead pid and fall back to local drafting.

Nothing blocks: a down record that does not fit waits in the connection's outbox (in
order) until the engine drains its ring; the loop sleeps with ``PollBackoff`` only when
a pass moved nothing. A malformed record is logged with its traceback, counted and
skipped -- the server outlives bad input.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import structlog

from seer.dataplane.draft_core import DraftServerCore, split_append
from seer.dataplane.shmring import PollBackoff, RingError, ShmRing
from seer.process import die_with_parent, on_stop_signals, pid_alive
from seer.protocol import DraftAppend, DraftDown, DraftUp

log = structlog.get_logger()

PREFIX = "seer-draft-"
INFO_FILE = "draft-server.json"
DEFAULT_RING_BYTES = 4 << 20
DEFAULT_TTL_S = 30.0
SHM_DIR = Path("/dev/shm")


class DraftServerInfo(msgspec.Struct, kw_only=True):
    pid: int
    ring_bytes: int
    ttl_s: float


def ring_names(server_pid: int, engine_id: int, client_pid: int) -> tuple[str, str]:
    """(up, down) ring names of one engine's connection."""
    base = f"{PREFIX}{server_pid}-{engine_id}-{client_pid}"
    return f"{base}-up", f"{base}-down"


def parse_ring_name(name: str) -> tuple[int, int, int, str] | None:
    """(server pid, engine id, client pid, "up" | "down"), or None for another file."""
    if not name.startswith(PREFIX):
        return None
    parts = name[len(PREFIX):].split("-")
    if len(parts) != 4 or parts[3] not in ("up", "down"):
        return None
    try:
        return int(parts[0]), int(parts[1]), int(parts[2]), parts[3]
    except ValueError:
        return None


def remove_stale_rings(shm_dir: Path = SHM_DIR) -> list[str]:
    """Unlink rings whose server or client process is gone."""
    removed = []
    for path in shm_dir.glob(f"{PREFIX}*"):
        parsed = parse_ring_name(path.name)
        if parsed is None:
            continue
        server_pid, _, client_pid, _ = parsed
        if not pid_alive(server_pid) or not pid_alive(client_pid):
            path.unlink(missing_ok=True)
            removed.append(path.name)
    return removed


def read_info(run_dir: Path) -> DraftServerInfo | None:
    try:
        return msgspec.json.decode((run_dir / INFO_FILE).read_bytes(), type=DraftServerInfo)
    except (FileNotFoundError, msgspec.DecodeError):
        return None


def max_tokens_per_record(ring_bytes: int) -> int:
    # A quarter of the ring per record: a big backlog streams through in pieces.
    return max(1, ring_bytes // 16)


@dataclass
class _Connection:
    conn_id: int
    engine_id: int
    client_pid: int
    up: ShmRing
    down: ShmRing
    outbox: list[bytes] = field(default_factory=list)


class DraftServer:
    def __init__(self, run_dir: Path, *, ttl_s: float = DEFAULT_TTL_S, ring_bytes: int = DEFAULT_RING_BYTES,
                 scan_interval_s: float = 0.5, shm_dir: Path = SHM_DIR,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.run_dir = run_dir
        self.core = DraftServerCore(ttl_s)
        self.ring_bytes = ring_bytes
        self.scan_interval_s = scan_interval_s
        self.shm_dir = shm_dir
        self.clock = clock
        self.pid = os.getpid()
        self.connections: dict[str, _Connection] = {}  # by up-ring name
        self._by_id: dict[int, _Connection] = {}
        self._next_conn_id = 0
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(DraftUp)
        self._max_tokens = max_tokens_per_record(ring_bytes)
        self.num_bad_records = 0

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        stale = remove_stale_rings(self.shm_dir)
        if stale:
            log.warning("draft_rings_stale_removed", rings=stale)
        info = DraftServerInfo(pid=self.pid, ring_bytes=self.ring_bytes, ttl_s=self.core.ttl_s)
        tmp = self.run_dir / f"{INFO_FILE}.tmp"
        tmp.write_bytes(msgspec.json.encode(info))
        tmp.replace(self.run_dir / INFO_FILE)  # atomic: clients see a whole file or none
        log.info("draft_server_started", pid=self.pid, ring_bytes=self.ring_bytes, ttl_s=self.core.ttl_s)

    def close(self) -> None:
        info = read_info(self.run_dir)
        if info is not None and info.pid == self.pid:
            (self.run_dir / INFO_FILE).unlink(missing_ok=True)
        for conn in list(self.connections.values()):
            self._drop(conn, self.clock())
        for path in self.shm_dir.glob(f"{PREFIX}{self.pid}-*"):  # rings never attached
            path.unlink(missing_ok=True)
        log.info("draft_server_stopped", tokens_in=self.core.num_tokens_in, tokens_out=self.core.num_tokens_out,
                 bad_records=self.num_bad_records, stale_refused=self.core.num_stale_refused)

    def serve(self, should_stop: Callable[[], bool], backoff: PollBackoff | None = None) -> None:
        backoff = backoff or PollBackoff()
        next_scan = next_expire = 0.0
        expire_every = min(1.0, max(0.05, self.core.ttl_s / 4))
        while not should_stop():
            now = self.clock()
            if now >= next_scan:
                self.scan(now)
                next_scan = now + self.scan_interval_s
            if now >= next_expire:
                self.core.expire(now)
                next_expire = now + expire_every
            if self.step(now):
                backoff.reset()
            else:
                backoff.idle()

    # ------------------------------------------------------------------ connections
    def scan(self, now: float) -> None:
        """Attach new engines' rings; drop connections whose client went away."""
        for name, conn in list(self.connections.items()):
            if not (self.shm_dir / name).exists() or not pid_alive(conn.client_pid):
                # What the engine wrote before it left still counts (its siblings elsewhere
                # need those tokens): our mapping outlives the unlink, so read it first.
                self._drain(conn, now, max_records=None)
                self._drop(conn, now)
        for path in self.shm_dir.glob(f"{PREFIX}{self.pid}-*-up"):
            if path.name in self.connections:
                continue
            parsed = parse_ring_name(path.name)
            if parsed is None:
                continue
            _, engine_id, client_pid, _ = parsed
            up_name, down_name = ring_names(self.pid, engine_id, client_pid)
            try:
                up = ShmRing.attach(up_name)
            except RingError:
                continue  # still being created: next scan
            try:
                down = ShmRing.attach(down_name)
            except RingError:
                up.close()
                continue
            conn = _Connection(self._next_conn_id, engine_id, client_pid, up, down)
            self._next_conn_id += 1
            self.connections[up_name] = conn
            self._by_id[conn.conn_id] = conn
            self.core.connect(conn.conn_id)
            log.info("draft_engine_connected", engine_id=engine_id, client_pid=client_pid, conn_id=conn.conn_id)

    def _drop(self, conn: _Connection, now: float) -> None:
        self.core.disconnect(conn.conn_id, now)
        self.connections.pop(conn.up.path.name, None)
        self._by_id.pop(conn.conn_id, None)
        for ring in (conn.up, conn.down):
            ring.close()
            ring.unlink()
        log.info("draft_engine_disconnected", engine_id=conn.engine_id, client_pid=conn.client_pid,
                 conn_id=conn.conn_id, undelivered_records=len(conn.outbox))

    # ------------------------------------------------------------------ records
    def step(self, now: float, max_records: int = 4096) -> bool:
        """One pass: drain every up ring, handle, flush outboxes. True if anything moved."""
        moved = False
        for conn in list(self.connections.values()):
            moved = self._drain(conn, now, max_records) or moved
        for conn in self.connections.values():
            if conn.outbox:
                written = conn.down.try_put_many(conn.outbox)
                if written:
                    del conn.outbox[:written]
                    moved = True
        return moved

    def _drain(self, conn: _Connection, now: float, max_records: int | None) -> bool:
        """Handle the records waiting in one up ring; True if there were any."""
        try:
            records = conn.up.drain(max_records)
        except RingError:
            log.exception("draft_ring_corrupt", engine_id=conn.engine_id, ring=conn.up.path.name)
            self._drop(conn, now)
            return False
        for record in records:
            try:
                out = self.core.handle(conn.conn_id, self._decoder.decode(record), now)
            except (msgspec.DecodeError, ValueError, TypeError):
                self.num_bad_records += 1
                log.exception("draft_record_refused", engine_id=conn.engine_id, num_bytes=len(record))
                continue
            self._queue(out)
        return bool(records)

    def _queue(self, out: list[tuple[int, DraftDown]]) -> None:
        for conn_id, msg in out:
            conn = self._by_id.get(conn_id)
            if conn is None:
                continue
            pieces = split_append(msg, self._max_tokens) if isinstance(msg, DraftAppend) else [msg]
            conn.outbox.extend(self._encoder.encode(p) for p in pieces)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="seer-draft-server", description=__doc__.splitlines()[0])
    parser.add_argument("--dir", required=True, type=Path, help="the daemon's run dir (rendezvous)")
    parser.add_argument("--ttl-s", type=float, default=DEFAULT_TTL_S,
                        help="drop a group nobody has registered for this long")
    parser.add_argument("--ring-bytes", type=int, default=DEFAULT_RING_BYTES, help="size of each engine ring")
    parser.add_argument("--scan-interval-s", type=float, default=0.5, help="how often to look for new engines")
    parser.add_argument("--log-file", type=Path, default=None)
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    parser.add_argument("--die-with-parent", action="store_true")
    args = parser.parse_args(argv)
    if args.die_with_parent:
        die_with_parent()
    from seer.logs import configure_logging

    configure_logging("draft_server", args.log_file, args.log_level, console=args.log_file is None)
    stopping = False

    def stop(_sig: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True

    on_stop_signals(stop)
    args.dir.mkdir(parents=True, exist_ok=True)
    server = DraftServer(args.dir, ttl_s=args.ttl_s, ring_bytes=args.ring_bytes, scan_interval_s=args.scan_interval_s)
    server.start()
    try:
        server.serve(lambda: stopping)
    finally:
        server.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
