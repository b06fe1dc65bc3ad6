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
holds open (``/proc/PID/fd``), by name and by file identity (device and inode). The
identity is what finds POSIX
semaphores: glibc's ``sem_open`` creates ``sem.XXXXXX``, maps it, links it to its real
name (``sem.mp-*`` for multiprocessing) and unlinks the temporary name, so the mapping
shows ``/dev/shm/sem.XXXXXX (deleted)`` while the file lives on as ``sem.mp-*``.
``reclaim`` runs once no process of the session is left and unlinks a file recorded by
name or inode only if it still exists, its name was not there before the engine was
spawned (the control plane's KV pool, another daemon's files), and no live process maps
or holds that very file (the draft server's rings, a pool segment shared with the control
plane; compared by device and inode: processes in other mount namespaces have other
/dev/shm files under the same names and inode numbers). A
file created and leaked between the last scan and the kill is missed; the scan interval
bounds that window (the supervisor also scans once more when it stops the engines), and
vLLM creates its segments at start-up, long before any kill.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import structlog

log = structlog.get_logger()

SHM_DIR = Path("/dev/shm")

FileId = tuple[int, int]  # (st_dev, st_ino): one file, whatever its name
PROC_DIR = Path("/proc")


@dataclass
class _Watched:
    engine_id: int
    baseline: frozenset[str]  # names in /dev/shm when the engine was spawned: never ours to unlink
    seen: set[str] = field(default_factory=set)
    files: set[FileId] = field(default_factory=set)  # every /dev/shm file seen, also under a removed name


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
                names, files = self._files_of(pid)
                new = names - record.seen - record.baseline
                record.files |= files
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
        present = self._files_by_name(record.baseline)
        candidates = {n for n in record.seen - record.baseline if n in present}
        candidates |= {n for n, file in present.items() if file in record.files}
        if candidates:
            used = self._in_use()
            candidates = {n for n in candidates if present[n] not in used}
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

    def _files_of(self, pid: int) -> tuple[set[str], set[FileId]]:
        """The /dev/shm names and files process ``pid`` maps or holds open (unreadable: none)."""
        names: set[str] = set()
        files: set[FileId] = set()
        base = self.proc_dir / str(pid)
        try:
            for line in (base / "maps").read_text().splitlines():
                parts = line.split(maxsplit=5)  # address perms offset dev(major:minor, hex) inode path
                if len(parts) == 6 and self._add(names, parts[5]) and (file := _map_file_id(parts[3], parts[4])):
                    files.add(file)
        except OSError:
            pass
        try:
            fds = os.listdir(base / "fd")
        except OSError:
            fds = []
        for fd in fds:
            try:
                if self._add(names, os.readlink(base / "fd" / fd)):
                    st = os.stat(base / "fd" / fd)
                    files.add((st.st_dev, st.st_ino))
            except OSError:
                continue
        return names, files

    def _add(self, names: set[str], path: str) -> bool:
        """Record ``path``'s name if it is a file directly in the shm dir (True)."""
        if path.startswith(self._prefix):
            name = path[len(self._prefix):].removesuffix(" (deleted)")
            if name and "/" not in name:
                names.add(name)
                return True
        return False

    def _files_by_name(self, skip: frozenset[str]) -> dict[str, FileId]:
        """Every file in the shm dir now, except the names in ``skip``."""
        files: dict[str, FileId] = {}
        for name in self.names() - skip:
            try:
                st = (self.shm_dir / name).stat(follow_symlinks=False)
            except OSError:
                continue
            files[name] = (st.st_dev, st.st_ino)
        return files

    def _in_use(self) -> set[FileId]:
        """The shm files some live process maps or holds open."""
        used: set[FileId] = set()
        for pid, _session in self.sessions():
            used |= self._files_of(pid)[1]
        return used


def _map_file_id(dev: str, inode: str) -> FileId | None:
    """A /proc/PID/maps line's "major:minor" (hex) and inode as (st_dev, st_ino)."""
    major, _, minor = dev.partition(":")
    try:
        return os.makedev(int(major, 16), int(minor, 16)), int(inode)
    except ValueError:
        return None
