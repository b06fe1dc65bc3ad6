"""Run a snippet of model-written Python in a child process with limits: ``run_python``.

For agentic RL examples: a rollout's tool call hands the model's code to ``run_python`` and
gives ``SandboxResult.text`` back to the model.

What the child is: ``sys.executable -I -c CODE`` (isolated mode: no ``PYTHON*`` variables,
no user site-packages, neither the script's folder nor the working folder on ``sys.path``;
the interpreter's own site-packages, e.g. this virtual environment's, stay importable),
started with ``asyncio.create_subprocess_exec`` in a fresh temporary folder (its working
folder, removed after the call), with the environment ``{"PATH": os.defpath}`` and nothing
else, stdin on /dev/null, in a session and process group of its own.

Limits, set in the child (``preexec_fn``) before the interpreter starts:

- ``RLIMIT_AS`` = ``memory_mib`` MiB of address space: an allocation past it fails
  (``MemoryError`` in Python, exit code 1 with the traceback in stderr).
- ``RLIMIT_CPU`` = ceil(``timeout_s``) + 1 s soft (``SIGXCPU``), 1 s more hard (``SIGKILL``):
  a backstop; the wall-clock timeout below normally acts first.
- ``RLIMIT_FSIZE`` = 8 MiB per written file (a larger write gets ``SIGXFSZ``); the number of
  files is not limited.
- ``RLIMIT_NOFILE`` = 64 open file descriptors; ``RLIMIT_CORE`` = 0 (no core dumps).
- Not set: ``RLIMIT_NPROC``. The kernel counts it over every process and thread of the real
  user (the daemon's and its engines' too, not only the sandbox's) and does not enforce it
  for root, so a small value breaks ``fork`` in the sandbox of a busy non-root user and does
  nothing under root (checked on this project's machines, where everything runs as root).
- Wall clock: after ``timeout_s`` the whole process group gets ``SIGKILL``; the result has
  ``timed_out=True`` and ``exit_code=None``. When the program ends by itself, what it left
  running in its group (a background child holding the output pipes) is killed as well.
  A process that leaves the group (``setsid``, a double fork into a new session) escapes
  these kills; the call still returns, at most ``_DRAIN_GRACE_S`` after the program ended.
- Output: at most ``max_output_bytes`` of stdout and as many of stderr are kept (the first
  bytes; ``truncated=True`` past that). The rest is read and dropped while the program runs,
  so nothing is buffered without bound; once more than ``_DISCARD_LIMIT_BYTES`` (1 MiB) were
  dropped, the group is killed (``exit_code=None``, ``timed_out=False``).
- Network, ``network="none"`` (the default): the child enters a new, empty network namespace
  (``unshare(CLONE_NEWNET)``; where the caller lacks ``CAP_SYS_ADMIN``, an unprivileged user
  namespace that owns it, ``CLONE_NEWUSER | CLONE_NEWNET``, mapping the caller's uid and gid to
  themselves). It has only a loopback interface and that one is down: no connection goes
  anywhere, not even to 127.0.0.1. Unix sockets bound to a path in the file system are not
  covered by network namespaces and stay reachable as file permissions allow.
  ``network_isolation_available()`` says whether this works here; where it does not,
  ``run_python(network="none")`` raises ``RuntimeError``. ``network="allow"`` enters no
  namespace: the child has the caller's network.

This is not a boundary against hostile code: the child runs as the caller's user (root on
this project's machines) and sees the caller's file system and processes. It keeps a
well-meaning model's mistakes (endless loops, memory or output floods, stray connections)
from hurting the rollout service.
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import functools
import math
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Literal

import msgspec

__all__ = ["SandboxResult", "network_isolation_available", "run_python"]

FILE_SIZE_LIMIT_BYTES = 8 << 20
OPEN_FILES_LIMIT = 64
_DISCARD_LIMIT_BYTES = 1 << 20  # output dropped past the caps (both streams) before the group is killed
_DRAIN_GRACE_S = 2.0  # after the group is killed: how long the pipes may stay open (an escaped process)
_POLL_S = 0.05  # how often the program's exit is checked while a child of it holds the pipes
_CHUNK = 1 << 16
_WORKDIR_PREFIX = "seer-sandbox-"

_CLONE_NEWUSER = 0x10000000
_CLONE_NEWNET = 0x40000000
# Resolved here, not in the child: between fork and exec the child does as little as it can.
_unshare = ctypes.CDLL(None, use_errno=True).unshare
_unshare.argtypes = [ctypes.c_int]
_unshare.restype = ctypes.c_int

_NO_ISOLATION = (
    "run_python(network='none') needs a new network namespace for the child, and this process can "
    "create none: unshare(CLONE_NEWNET) is refused (no CAP_SYS_ADMIN) and so is an unprivileged user "
    "namespace (unshare(CLONE_NEWUSER | CLONE_NEWNET): a container's seccomp profile, "
    "kernel.unprivileged_userns_clone=0, user.max_user_namespaces=0 or an AppArmor restriction). "
    "Run the service where unprivileged user namespaces are allowed (or with CAP_SYS_ADMIN), or pass "
    "network='allow' knowingly: the code then has this machine's network."
)


class SandboxResult(msgspec.Struct, frozen=True, kw_only=True):
    """What one ``run_python`` call gave.

    ``exit_code``: the program's exit status (negative: the signal that ended it, e.g. -9 for
    the hard CPU limit, -24 ``SIGXCPU``, -25 ``SIGXFSZ``); None when ``run_python`` killed it
    (``timed_out``, or output past the discard limit). ``stdout``/``stderr``: the first
    ``max_output_bytes`` of each, decoded as UTF-8 (invalid bytes replaced). ``truncated``: some
    output was dropped. ``seconds``: wall time of the call. ``timeout_s``, ``max_output_bytes``:
    the limits the call ran under."""

    stdout: str
    stderr: str
    exit_code: int | None
    timed_out: bool
    truncated: bool
    seconds: float
    timeout_s: float
    max_output_bytes: int

    @property
    def text(self) -> str:
        """The tool output for a model: stdout, then stderr, then one line per event
        ("[output truncated]", "[timed out after 5 s]", "[exit code 1]", ...), at most
        ``max_output_bytes`` bytes of UTF-8 in all; "[no output]" when there is nothing.
        Where stdout and stderr together do not fit, stderr keeps its end (a traceback's
        last lines name the error), up to half the room or whatever stdout leaves."""
        notes = []
        if self.timed_out:
            notes.append(f"[timed out after {self.timeout_s:g} s]")
        elif self.exit_code is None:
            notes.append("[killed: too much output]")
        elif self.exit_code < 0:
            notes.append(f"[killed by {_signal_name(-self.exit_code)}]")
        elif self.exit_code > 0:
            notes.append(f"[exit code {self.exit_code}]")
        truncated_note = "[output truncated]"
        out, err = self.stdout.encode(), self.stderr.encode()
        sep = b"\n" if out and err and not out.endswith(b"\n") else b""
        room = max(self.max_output_bytes - len("\n".join([truncated_note, *notes]).encode()) - 1, 0)
        truncated = self.truncated
        if len(out) + len(sep) + len(err) > room:
            truncated = True
            err_room = min(len(err), max(room // 2, room - len(out) - len(sep)))
            err = err[len(err) - err_room:] if err_room else b""
            sep = sep if err else b""
            out = out[: max(room - err_room - len(sep), 0)]
        if truncated:
            notes.insert(0, truncated_note)
        # Valid UTF-8 but for a character cut at either end of a part.
        text = out.decode(errors="ignore") + sep.decode() + err.decode(errors="ignore")
        if notes:
            text = (text + "\n" if text and not text.endswith("\n") else text) + "\n".join(notes)
        return _cut(text or "[no output]", self.max_output_bytes)


_SIGNAL_CAUSES = {signal.SIGXCPU: ": CPU time limit", signal.SIGXFSZ: ": file size limit"}


def _signal_name(number: int) -> str:
    try:
        sig = signal.Signals(number)
    except ValueError:
        return f"signal {number}"
    return sig.name + _SIGNAL_CAUSES.get(sig, "")


def _cut(text: str, limit: int) -> str:
    data = text.encode()
    return text if len(data) <= limit else data[:limit].decode(errors="ignore")


# --- the child's setup (runs between fork and exec: only precomputed values, no imports) ---

def _write_proc(path: str, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def _enter_new_netns(uid: int, gid: int, *, user_ns: bool = False) -> None:
    """Move the calling (child) process into a new network namespace: a plain one where
    allowed, else one owned by a new user namespace that maps ``uid``/``gid`` to themselves.
    ``user_ns=True``: the second way directly (tests)."""
    if not user_ns:
        if _unshare(_CLONE_NEWNET) == 0:
            return
        err = ctypes.get_errno()
        if err not in (errno.EPERM, errno.EINVAL, errno.ENOSYS):
            raise OSError(err, f"unshare(CLONE_NEWNET): {os.strerror(err)}")
    if _unshare(_CLONE_NEWUSER | _CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"unshare(CLONE_NEWUSER | CLONE_NEWNET): {os.strerror(err)}")
    _write_proc("/proc/self/setgroups", b"deny")
    _write_proc("/proc/self/uid_map", f"{uid} {uid} 1".encode())
    _write_proc("/proc/self/gid_map", f"{gid} {gid} 1".encode())


def _limits(timeout_s: float, memory_mib: int) -> list[tuple[int, tuple[int, int]]]:
    """(resource, (soft, hard)) for the child; never above the caller's hard limits (a
    non-root caller cannot raise them)."""
    cpu = math.ceil(timeout_s) + 1
    wanted = [
        (resource.RLIMIT_AS, memory_mib << 20, memory_mib << 20),
        (resource.RLIMIT_CPU, cpu, cpu + 1),
        (resource.RLIMIT_FSIZE, FILE_SIZE_LIMIT_BYTES, FILE_SIZE_LIMIT_BYTES),
        (resource.RLIMIT_NOFILE, OPEN_FILES_LIMIT, OPEN_FILES_LIMIT),
        (resource.RLIMIT_CORE, 0, 0),
    ]
    out = []
    for res, soft, hard in wanted:
        _, current_hard = resource.getrlimit(res)
        if current_hard != resource.RLIM_INFINITY:
            hard = min(hard, current_hard)
            soft = min(soft, hard)
        out.append((res, (soft, hard)))
    return out


def _child_setup(limits: list[tuple[int, tuple[int, int]]], isolate: bool) -> Callable[[], None]:
    uid, gid = os.getuid(), os.getgid()

    def setup() -> None:
        if isolate:
            _enter_new_netns(uid, gid)
        for res, lim in limits:
            resource.setrlimit(res, lim)

    return setup


@functools.cache
def network_isolation_available() -> bool:
    """True if a child can be put in a new, empty network namespace here (see the module's
    docstring). Probed once per process by starting one short child (some 20-50 ms, blocking):
    call it at startup to keep that off a rollout's path."""
    uid, gid = os.getuid(), os.getgid()
    try:
        probe = subprocess.run(
            [sys.executable, "-I", "-S", "-c", "import socket; print([n for _, n in socket.if_nameindex()])"],
            preexec_fn=functools.partial(_enter_new_netns, uid, gid), stdin=subprocess.DEVNULL,
            capture_output=True, text=True, env={"PATH": os.defpath}, timeout=60, check=False)
    except (OSError, subprocess.SubprocessError):
        return False
    return probe.returncode == 0 and probe.stdout.strip() == "['lo']"


# --- the parent's side ---

class _Capture:
    """The first ``cap`` bytes of each stream; the rest is counted and dropped."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.kept = (bytearray(), bytearray())
        self.discarded = 0
        self.flooded = asyncio.Event()

    async def read(self, stream: asyncio.StreamReader, index: int) -> None:
        kept = self.kept[index]
        while chunk := await stream.read(_CHUNK):
            room = max(self.cap - len(kept), 0)
            if room:
                kept += chunk[:room]
            if len(chunk) > room:
                self.discarded += len(chunk) - room
                if self.discarded > _DISCARD_LIMIT_BYTES:
                    self.flooded.set()


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # the group is empty (PermissionError: macOS-like kernels for a group of zombies)


async def _reaped(proc: asyncio.subprocess.Process, within_s: float) -> None:
    """Wait until the event loop has seen ``proc`` exit (a SIGKILL takes effect a moment after
    it is sent), at most ``within_s``. Not ``proc.wait()``: that also waits for the pipes."""
    deadline = time.monotonic() + within_s
    while proc.returncode is None and time.monotonic() < deadline:
        await asyncio.sleep(_POLL_S)


def _remove_tree(path: str) -> None:
    try:
        shutil.rmtree(path)
    except FileNotFoundError:
        pass
    except OSError:
        # A non-root caller cannot list or empty a folder that the code made unreadable:
        # give every real folder (no symlinks) back its owner's rights, then try again.
        for root, dirs, _ in os.walk(path):
            for name in dirs:
                full = os.path.join(root, name)
                if not os.path.islink(full):
                    try:
                        os.chmod(full, 0o700)
                    except OSError:
                        pass
        shutil.rmtree(path, ignore_errors=True)


async def run_python(
    code: str,
    *,
    timeout_s: float = 5.0,
    memory_mib: int = 256,
    max_output_bytes: int = 4096,
    network: Literal["none", "allow"] = "none",
) -> SandboxResult:
    """Run ``code`` with ``python -I -c`` in a fresh temporary folder under the limits of the
    module's docstring; returns when the program ended (or was killed) and its folder is gone.

    Raises ``RuntimeError`` for ``network="none"`` where ``network_isolation_available()`` is
    False, or when the child could not be set up; ``ValueError`` for a bad argument. The
    program's own failures (exceptions, limits, timeouts) are results, not exceptions. If the
    calling task is cancelled, the program's group is killed and its folder removed."""
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
    if memory_mib < 16:
        raise ValueError(f"memory_mib must be >= 16 (the interpreter needs that much), got {memory_mib!r}")
    if max_output_bytes < 1:
        raise ValueError(f"max_output_bytes must be >= 1, got {max_output_bytes!r}")
    if network not in ("none", "allow"):
        raise ValueError(f"network must be 'none' or 'allow', got {network!r}")
    if "\0" in code:
        raise ValueError("code must not contain NUL characters")
    if network == "none" and not network_isolation_available():
        raise RuntimeError(_NO_ISOLATION)

    setup = _child_setup(_limits(timeout_s, memory_mib), isolate=network == "none")
    workdir = tempfile.mkdtemp(prefix=_WORKDIR_PREFIX)
    start = time.monotonic()
    proc: asyncio.subprocess.Process | None = None
    tasks: list[asyncio.Task] = []
    try:
        try:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-I", "-c", code,
                stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE, cwd=workdir, env={"PATH": os.defpath},
                start_new_session=True, preexec_fn=setup)
        except subprocess.SubprocessError as exc:
            raise RuntimeError(
                f"the sandbox's child could not be set up (network namespace or resource limits "
                f"in preexec_fn): {exc!r} (cause: {exc.__cause__!r})") from exc
        assert proc.stdout is not None and proc.stderr is not None
        capture = _Capture(max_output_bytes)
        readers = [asyncio.create_task(capture.read(proc.stdout, 0)),
                   asyncio.create_task(capture.read(proc.stderr, 1))]
        exited = asyncio.create_task(proc.wait())  # also waits for the pipes to close
        flooded = asyncio.create_task(capture.flooded.wait())
        tasks = [*readers, exited, flooded]  # ``finally`` relies on this order

        deadline = start + timeout_s
        timed_out = killed = False
        while not exited.done() and proc.returncode is None:
            if flooded.done():
                killed = True
                break
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                timed_out = killed = True
                break
            await asyncio.wait([exited, flooded], timeout=min(_POLL_S, remaining),
                               return_when=asyncio.FIRST_COMPLETED)
        exit_code = None if killed else proc.returncode
        _kill_group(proc.pid)  # the program (killed) or what it left running in its group

        # A process outside the group may still hold the pipes: then ``finally`` stops reading.
        await asyncio.wait([*readers, exited], timeout=_DRAIN_GRACE_S)
        return SandboxResult(
            stdout=bytes(capture.kept[0]).decode(errors="replace"),
            stderr=bytes(capture.kept[1]).decode(errors="replace"),
            exit_code=exit_code,
            timed_out=timed_out,
            truncated=capture.discarded > 0,
            seconds=time.monotonic() - start,
            timeout_s=timeout_s,
            max_output_bytes=max_output_bytes,
        )
    finally:
        try:
            if proc is not None and proc.returncode is None:  # cancelled, or failed on our side
                _kill_group(proc.pid)
                await _reaped(proc, _DRAIN_GRACE_S)
        finally:
            if any(not task.done() for task in tasks[:3]):  # the readers or the exit: pipes still open
                transport = getattr(proc, "_transport", None)
                if transport is not None:
                    transport.close()
            for task in tasks:
                task.cancel()
            _remove_tree(workdir)

