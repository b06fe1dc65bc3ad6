"""Process plumbing shared by Seer's processes.

Owns: process liveness (the daemon's run-dir lock; ``process_start_time``, which with a pid
names one process for good; ``wait_exit``, the wait for a process that is not our child), the sweep of /dev/shm files whose
owner process is gone (``remove_stale_shm``: the KV pool's and the trainers' weight segments),
``die_with_parent`` for the processes a daemon spawns (engine workers, the draft server,
the host agent), ``on_stop_signals``, the SIGTERM/SIGINT setup of a blocking
(non-asyncio) process, and ``stop_process`` for a child started in its own session.
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path
from types import FrameType

_PR_SET_PDEATHSIG = 1  # prctl option: the signal this process gets when its parent dies


def pid_alive(pid: int) -> bool:
    """True if a process with this pid exists (also when it belongs to another user)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def process_start_time(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks since boot: /proc/PID/stat field 22), or None
    if it does not run (gone, or a zombie). A pid is reused; the pair (pid, start time) is not."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[-1].split()  # after the command name (which may hold ")"): field 3 on
    if len(fields) < 20 or fields[0] in ("Z", "X"):
        return None
    return int(fields[19])


def _exited(pid: int) -> bool:
    """No process ``pid``, or only its zombie (exited, not yet reaped)."""
    if not pid_alive(pid):
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        return False


def remove_stale_shm(prefix: str, shm_dir: Path = Path("/dev/shm"), pid: int | None = None) -> list[str]:
    """Unlink every ``<shm_dir>/<prefix><pid>-...`` whose owner ``pid`` (the process that
    created it, named in the file name) no longer exists (or is a zombie); the names removed.
    With ``pid``: only that owner's files (``seerctl stop`` after its daemon died).

    For segments whose creator unlinks them itself on a clean exit, and whose unlink is
    lost when the creator is SIGKILLed together with Python's resource tracker (the OOM
    killer, ``kill -9`` of a process group). A process that still maps the file keeps its
    mapping; only the name goes. Files of live owners, of this process and names without a
    pid are left alone."""
    removed = []
    for path in shm_dir.glob(f"{prefix}*"):
        try:
            owner = int(path.name[len(prefix):].split("-")[0])
        except ValueError:
            continue
        if owner > 0 and owner != os.getpid() and pid in (None, owner) and _exited(owner):
            path.unlink(missing_ok=True)
            removed.append(path.name)
    return removed


async def wait_exit(pid: int, start_time: int, poll_s: float = 1.0) -> None:
    """Return once process ``pid`` (started at ``start_time``) has exited, by any means.
    A pidfd wakes the loop at once (Linux >= 5.3); without one, polls every ``poll_s``."""
    import asyncio

    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    except (AttributeError, OSError):  # no pidfd here
        fd = None
    try:
        if process_start_time(pid) != start_time:  # checked after the open: fd is this very process
            return
        if fd is None:
            while process_start_time(pid) == start_time:
                await asyncio.sleep(poll_s)
            return
        loop = asyncio.get_running_loop()
        exited = loop.create_future()
        loop.add_reader(fd, lambda: exited.done() or exited.set_result(None))
        try:
            await exited
        finally:
            loop.remove_reader(fd)
    finally:
        if fd is not None:
            os.close(fd)


def die_with_parent() -> None:
    """Ask Linux to SIGTERM this process when the process that started it dies (no
    orphans). A no-op where prctl is not available."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


def on_stop_signals(handler: Callable[[int, FrameType | None], object]) -> None:
    """Call ``handler(signum, frame)`` on SIGTERM (a supervisor stopping us) and SIGINT."""
    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


def stop_process(proc: subprocess.Popen, timeout_s: float = 10.0) -> None:
    """SIGTERM the process group, SIGKILL it if it lingers."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout_s)
    except ProcessLookupError:
        pass
