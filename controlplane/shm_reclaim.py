"""Reclaiming the /dev/shm files a dead engine's process tree left behind.

Owns: the record of which ``/dev/shm`` names each spawned engine's process tree has
mapped or open, and unlinking those the tree left when it is gone.

vLLM's processes create POSIX shared memory (``psm_*``, the message queues between an
engine and its worker processes) and semaphores (``sem.mp-*``) and unlink them on a
clean exit, through Python's resource tracker. A ``kill -9`` of the tree (the OOM killer,
an operator, the supervisor's own SIGKILL at stop) kills the resource tracker too, and the
files stay until reboot: hundreds of MB per crash.

Attribution, never guessing by name pattern: every engine runs in its own session
(``start_new_session``), so a process belongs to engine E's tree exactly while its
session id is E's pid, also after E itself died. ``scan`` records, for every live
process of a watched session, the ``/dev/shm`` files it maps (``/proc/PID/maps``) or
holds open (``/proc/PID/fd``). ``reclaim`` runs once no process of the session is left
and unlinks a recorded name only if it still exists, was not there before the engine
was spawned (the control plane's KV pool, another daemon's files), and no live process
maps or holds it (the draft server's rings, a pool segment shared with the control
plane). A file created and leaked between the last scan and the kill is missed; the
scan interval bounds that window, and vLLM creates its segments at start-up, long
before any kill.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import structlog

log = structlog.get_logger()

SHM_DIR = Path("/dev/shm")
PROC_DIR = Path("/proc")


@dataclass
class _Watched:
    engine_id: int
    baseline: frozenset[str]  # names in /dev/shm when the engine was spawned: never ours to unlink
    seen: set[str] = field(default_factory=set)


class ShmReclaimer:
    """Per engine session: record its /dev/shm files while it lives, unlink leftovers after."""

    def __init__(self, shm_dir: Path = SHM_DIR, proc_dir: Path = PROC_DIR) -> None:
        self.shm_dir = shm_dir
        self.proc_dir = proc_dir
        self._prefix = str(shm_dir).rstrip("/") + "/"
        self._watched: dict[int, _Watched] = {}  # session id (the engine's pid) -> record

    def watch(self, session_id: int, engine_id: int, baseline: frozenset[str] | None = None) -> None:
        """Start recording session ``session_id`` (call with the snapshot taken before the spawn)."""
        self._watched[session_id] = _Watched(engine_id, self.names() if baseline is None else baseline)

    def names(self) -> frozenset[str]:
        try:
            return frozenset(os.listdir(self.shm_dir))
        except FileNotFoundError:
            return frozenset()

    def watching(self) -> list[int]:
        return list(self._watched)

    def scan(self) -> None:
        """Record the /dev/shm files every live process of a watched session uses."""
        if not self._watched:
            return
        for pid, session in self.sessions():
            record = self._watched.get(session)
            if record is not None:
                new = self._files_of(pid) - record.seen - record.baseline
                if new:
                    record.seen |= new
                    log.info("engine_shm_recorded", engine_id=record.engine_id, pid=pid, names=sorted(new))

    def session_alive(self, session_id: int) -> bool:
        return any(session == session_id for _pid, session in self.sessions())

    def reclaim(self, session_id: int) -> list[str]:
        """Unlink what the (dead) session left behind; forget the session. Returns the names."""
        record = self._watched.pop(session_id, None)
        if record is None:
            return []
        candidates = {n for n in record.seen - record.baseline if (self.shm_dir / n).exists()}
        if candidates:
            candidates -= self._in_use()
        reclaimed, num_bytes = [], 0
        for name in sorted(candidates):
            path = self.shm_dir / name
            try:
                size = path.stat().st_size
                path.unlink()
            except FileNotFoundError:
                continue
            except OSError as exc:
                log.warning("engine_shm_reclaim_failed", engine_id=record.engine_id, name=name, error=str(exc))
                continue
            reclaimed.append(name)
            num_bytes += size
        if reclaimed:
            log.warning("engine_shm_reclaimed", engine_id=record.engine_id, session_id=session_id,
                        names=reclaimed, num_bytes=num_bytes)
        return reclaimed

    # ------------------------------------------------------------------ /proc reading
    def sessions(self) -> list[tuple[int, int]]:
        """(pid, session id) of every live, non-zombie process."""
        result = []
        try:
            entries = os.listdir(self.proc_dir)
        except FileNotFoundError:
            return result
        for entry in entries:
            if not entry.isdigit():
                continue
            try:
                stat = (self.proc_dir / entry / "stat").read_text()
            except OSError:
                continue
            fields = stat.rsplit(")", 1)[-1].split()
            if len(fields) > 3 and fields[0] not in ("Z", "X"):
                result.append((int(entry), int(fields[3])))
        return result

    def _files_of(self, pid: int) -> set[str]:
        """/dev/shm names process ``pid`` maps or holds open (unreadable: none)."""
        names: set[str] = set()
        base = self.proc_dir / str(pid)
        try:
            for line in (base / "maps").read_text().splitlines():
                parts = line.split(maxsplit=5)
                if len(parts) == 6:
                    self._add(names, parts[5])
        except OSError:
            pass
        try:
            fds = os.listdir(base / "fd")
        except OSError:
            fds = []
        for fd in fds:
            try:
                self._add(names, os.readlink(base / "fd" / fd))
            except OSError:
                continue
        return names

    def _add(self, names: set[str], path: str) -> None:
        if path.startswith(self._prefix):
            name = path[len(self._prefix):].removesuffix(" (deleted)")
            if name and "/" not in name:
                names.add(name)

    def _in_use(self) -> set[str]:
        used: set[str] = set()
        for pid, _session in self.sessions():
            used |= self._files_of(pid)
        return used
