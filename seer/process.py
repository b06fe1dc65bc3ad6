"""Process plumbing shared by Seer's processes.

Owns: process liveness (the daemon's run-dir lock, the KV pool's stale-segment sweep),
``die_with_parent`` for the processes a daemon spawns (engine workers, the draft server,
the host agent), ``on_stop_signals``, the SIGTERM/SIGINT setup of a blocking
(non-asyncio) process, and ``stop_process`` for a child started in its own session.
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Callable
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
