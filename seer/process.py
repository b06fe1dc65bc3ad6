"""Process plumbing shared by Seer's processes.

Owns: process liveness (the daemon's run-dir lock), the sweep of /dev/shm files whose
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


def remove_stale_shm(prefix: str, shm_dir: Path = Path("/dev/shm")) -> list[str]:
    """Unlink every ``<shm_dir>/<prefix><pid>-...`` whose owner ``pid`` (the process that
    created it, named in the file name) no longer exists; the names removed.

    For segments whose creator unlinks them itself on a clean exit, and whose unlink is
    lost when the creator is SIGKILLed together with Python's resource tracker (the OOM
    killer, ``kill -9`` of a process group). A process that still maps the file keeps its
    mapping; only the name goes. Files of live owners, of this process and names without a
    pid are left alone."""
    removed = []
    for path in shm_dir.glob(f"{prefix}*"):
        try:
            pid = int(path.name[len(prefix):].split("-")[0])
        except ValueError:
            continue
        if pid > 0 and pid != os.getpid() and not pid_alive(pid):
            path.unlink(missing_ok=True)
            removed.append(path.name)
    return removed


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
