"""seer.tools.python_sandbox: output, exceptions, the wall-clock timeout and the process group
kill, output caps, the memory limit, the empty network namespace, the temporary folder, and
the text a model gets. Timeouts are generous (a loaded 2-core machine): no assertion is
tighter than seconds."""

from __future__ import annotations

import asyncio
import functools
import os
import resource
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest
import uvloop
from hypothesis import given, settings
from hypothesis import strategies as st

from seer.process import process_start_time
from seer.tools import python_sandbox
from seer.tools.python_sandbox import SandboxResult, network_isolation_available, run_python

SLACK_S = 30.0  # how much later than its limit a call may return on a loaded machine

LOOPS = ["asyncio", "uvloop"]  # the daemon runs uvloop; its preexec_fn and sessions differ


def _run(coro, loop: str = "asyncio"):
    factory = uvloop.new_event_loop if loop == "uvloop" else None
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(coro)


def _sandbox(code: str, loop: str = "asyncio", **kwargs) -> SandboxResult:
    return _run(run_python(textwrap.dedent(code), **kwargs), loop)


def _needs_isolation():
    if not network_isolation_available():
        pytest.skip("no network namespace can be created here (network_isolation_available() is False)")


def _network_kwargs() -> dict:
    """The default (network="none") where it works, else "allow": the tests that are not about
    the network run either way."""
    return {} if network_isolation_available() else {"network": "allow"}


def _gone(pid: int, start_time: int, within_s: float = SLACK_S) -> bool:
    """Process (pid, start time) has ended (a zombie counts as ended) within ``within_s``."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if process_start_time(pid) != start_time:
            return True
        time.sleep(0.05)
    return False


# A line the sandboxed code prints about a process: "<pid> <start time>".
_PROC_INFO = """
def proc_info(pid):
    stat = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[-1].split()
    return f"{pid} {stat[19]}"
"""


def _with_proc_info(code: str) -> str:
    return _PROC_INFO + textwrap.dedent(code)


def _proc_infos(stdout: str) -> list[tuple[int, int]]:
    return [(int(a), int(b)) for a, b in (line.split() for line in stdout.splitlines() if line.strip())]


@pytest.mark.parametrize("loop", LOOPS)
def test_prints_are_captured(loop):
    result = _sandbox("""
        import sys
        print("hello")
        print("to stderr", file=sys.stderr)
        print("wörld")
    """, loop, **_network_kwargs())
    assert result.stdout == "hello\nwörld\n"
    assert result.stderr == "to stderr\n"
    assert result.exit_code == 0
    assert not result.timed_out and not result.truncated
    assert result.text == "hello\nwörld\nto stderr\n"


def test_exception_gives_exit_code_and_traceback():
    result = _sandbox("""
        def f():
            raise ValueError("boom")
        f()
    """, **_network_kwargs())
    assert result.exit_code == 1
    assert not result.timed_out
    assert "Traceback (most recent call last)" in result.stderr
    assert "ValueError: boom" in result.stderr
    assert result.text.endswith("ValueError: boom\n[exit code 1]")
    assert _sandbox("import sys; sys.exit(3)", **_network_kwargs()).exit_code == 3


@pytest.mark.parametrize("loop", LOOPS)
def test_timeout_kills_the_whole_group(loop):
    result = _sandbox(_with_proc_info("""
        import os, subprocess
        child = subprocess.Popen(["sleep", "600"])
        print(proc_info(os.getpid()), flush=True)
        print(proc_info(child.pid), flush=True)
        while True:
            pass
    """), loop, timeout_s=6, **_network_kwargs())
    assert result.timed_out
    assert result.exit_code is None
    assert 6 <= result.seconds < 6 + SLACK_S
    assert "[timed out after 6 s]" in result.text
    infos = _proc_infos(result.stdout)
    assert len(infos) == 2, result
    for pid, start_time in infos:  # the program and the grandchild it left sleeping
        assert _gone(pid, start_time), f"process {pid} of the sandbox is still running"


def test_a_program_that_ends_takes_its_background_children_along():
    """A child left running holds the output pipes: the call returns when the program ends
    anyway (not at the timeout) and the child is killed."""
    result = _sandbox(_with_proc_info("""
        import subprocess
        child = subprocess.Popen(["sleep", "600"])
        print(proc_info(child.pid))
    """), timeout_s=120, **_network_kwargs())
    assert result.exit_code == 0
    assert not result.timed_out
    assert result.seconds < 60
    [(pid, start_time)] = _proc_infos(result.stdout)
    assert _gone(pid, start_time)


@pytest.mark.parametrize("loop", LOOPS)
def test_a_process_that_leaves_the_group_does_not_hold_the_call(loop):
    """A child in a session of its own escapes the group kill (documented) and keeps the
    pipes open: the call still returns soon after the program ends."""
    result = _sandbox(_with_proc_info("""
        import os, subprocess
        child = subprocess.Popen(["sleep", "600"], start_new_session=True)
        print(proc_info(child.pid), flush=True)
        print(os.getcwd(), file=__import__("sys").stderr)
    """), loop, timeout_s=120, **_network_kwargs())
    [(pid, start_time)] = _proc_infos(result.stdout)
    try:
        assert result.exit_code == 0 and not result.timed_out
        assert result.seconds < 60
        assert not Path(result.stderr.strip()).exists()
    finally:
        if process_start_time(pid) == start_time:
            os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("loop", LOOPS)
def test_huge_output_is_truncated_and_the_call_returns(loop):
    flood = _sandbox("print('x' * 50_000_000)", loop, max_output_bytes=1000, timeout_s=120,
                     **_network_kwargs())
    assert flood.stdout == "x" * 1000
    assert flood.truncated
    assert not flood.timed_out and flood.exit_code is None  # killed past the discard limit
    assert "[killed: too much output]" in flood.text
    assert len(flood.text.encode()) <= 1000

    endless = _sandbox("""
        import sys
        while True:
            sys.stderr.write("e" * 1000)
    """, loop, max_output_bytes=500, timeout_s=120, **_network_kwargs())
    assert endless.stderr == "e" * 500 and endless.truncated
    assert not endless.timed_out  # stopped by the output cap, long before the timeout


def test_moderate_overflow_is_dropped_and_the_program_finishes():
    result = _sandbox("""
        import sys
        print("a" * 200_000)
        print("done", file=sys.stderr)
    """, max_output_bytes=1000, **_network_kwargs())
    assert result.exit_code == 0
    assert result.truncated
    assert result.stdout == "a" * 1000
    assert result.stderr == "done\n"
    assert result.text.endswith("done\n[output truncated]")


def test_memory_bomb_is_stopped_by_the_address_space_limit():
    big = _sandbox("b = bytearray(8 * 1024**3)", memory_mib=256, timeout_s=60, **_network_kwargs())
    assert big.exit_code == 1 and "MemoryError" in big.stderr
    growing = _sandbox("""
        hoard = []
        while True:
            hoard.append(bytearray(10 * 1024**2))
    """, memory_mib=256, timeout_s=60, **_network_kwargs())
    assert growing.exit_code == 1 and "MemoryError" in growing.stderr
    assert not growing.timed_out
    # The limit is memory_mib: 100 MiB fit in 256 and not in 64.
    code = "b = bytearray(100 * 1024**2); print('ok')"
    assert _sandbox(code, memory_mib=256, **_network_kwargs()).stdout == "ok\n"
    small = _sandbox(code, memory_mib=64, **_network_kwargs())
    assert small.exit_code == 1 and "MemoryError" in small.stderr


def test_the_child_runs_under_the_documented_limits():
    result = _sandbox("""
        import resource as r
        for name in ("RLIMIT_AS", "RLIMIT_CPU", "RLIMIT_FSIZE", "RLIMIT_NOFILE", "RLIMIT_CORE"):
            print(name, *r.getrlimit(getattr(r, name)))
    """, timeout_s=2.5, memory_mib=300, **_network_kwargs())
    limits = {name: (int(soft), int(hard)) for name, soft, hard in map(str.split, result.stdout.splitlines())}
    expected = {
        "RLIMIT_AS": (300 << 20, 300 << 20),
        "RLIMIT_CPU": (4, 5),
        "RLIMIT_FSIZE": (python_sandbox.FILE_SIZE_LIMIT_BYTES,) * 2,
        "RLIMIT_NOFILE": (python_sandbox.OPEN_FILES_LIMIT,) * 2,
        "RLIMIT_CORE": (0, 0),
    }
    for name, (soft, hard) in expected.items():
        current_hard = resource.getrlimit(getattr(resource, name))[1]
        if current_hard != resource.RLIM_INFINITY:  # never above the caller's own hard limit
            hard, soft = min(hard, current_hard), min(soft, current_hard)
        assert limits[name] == (soft, hard), name


def test_a_file_past_the_size_limit_is_refused():
    result = _sandbox("""
        with open("big", "wb") as f:
            f.write(b"x" * (9 * 1024**2))
    """, **_network_kwargs())
    assert result.exit_code == 1
    assert "File too large" in result.stderr  # Python ignores SIGXFSZ: write() fails with EFBIG


def test_network_is_refused_inside_and_allowed_outside():
    _needs_isolation()
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port), timeout=30):
            pass  # from this process: the listener is there
        code = f"""
            import socket
            print([name for _, name in socket.if_nameindex()])
            try:
                socket.create_connection(("127.0.0.1", {port}), timeout=30).close()
                print("connected")
            except OSError as exc:
                print("refused", exc.errno)
        """
        isolated = _sandbox(code, timeout_s=60)
        allowed = _sandbox(code, timeout_s=60, network="allow")
    assert isolated.exit_code == 0 and allowed.exit_code == 0
    names, outcome = isolated.stdout.splitlines()
    assert names == "['lo']"  # a namespace of its own, its loopback down
    assert outcome.startswith("refused")
    assert allowed.stdout.splitlines()[1] == "connected"


def test_network_none_without_isolation_raises(monkeypatch):
    monkeypatch.setattr(python_sandbox, "network_isolation_available", lambda: False)
    with pytest.raises(RuntimeError, match="network='allow' knowingly") as info:
        _sandbox("print(1)")
    assert "user namespace" in str(info.value)
    assert _sandbox("print(1)", network="allow").stdout == "1\n"


def test_the_user_namespace_way_gives_an_empty_network_namespace():
    """Where the caller lacks CAP_SYS_ADMIN (not root), the child makes a user namespace that
    owns its network namespace; forced here, where the plain way would work."""
    setup = functools.partial(python_sandbox._enter_new_netns, os.getuid(), os.getgid(), user_ns=True)
    code = "import os, socket; print([n for _, n in socket.if_nameindex()], os.getuid(), os.getgid())"
    try:
        probe = subprocess.run(
            [sys.executable, "-I", "-c", code],
            preexec_fn=setup, capture_output=True, text=True, timeout=60, check=True)
    except subprocess.SubprocessError as exc:
        pytest.skip(f"no unprivileged user namespace here: {exc!r}")
    assert probe.stdout.split() == ["['lo']", str(os.getuid()), str(os.getgid())]


@pytest.mark.parametrize("loop", LOOPS)
def test_temporary_folder_and_environment(loop):
    result = _sandbox("""
        import os
        os.makedirs("a/b")
        open("a/b/f", "w").write("x")
        os.chmod("a", 0)  # unreadable: the cleanup copes
        print(os.getcwd())
        print(sorted(os.environ))
        print(os.environ["PATH"])
    """, loop, **_network_kwargs())
    assert result.exit_code == 0, result
    cwd, env, path = result.stdout.splitlines()
    assert Path(cwd).name.startswith("seer-sandbox-")
    assert Path(cwd).parent == Path(tempfile.gettempdir())
    assert not Path(cwd).exists()
    assert set(eval(env)) <= {"PATH", "LC_CTYPE"}  # LC_CTYPE: Python's C-locale coercion
    assert path == os.defpath


def test_cancelling_the_call_kills_the_program_and_removes_its_folder(tmp_path):
    info = tmp_path / "info"

    async def main():
        task = asyncio.create_task(run_python(_with_proc_info(f"""
            import os
            with open({str(info)!r}, "w") as f:
                f.write(proc_info(os.getpid()) + " " + os.getcwd())
            while True:
                pass
        """), timeout_s=600, **_network_kwargs()))
        deadline = time.monotonic() + 60
        while not (info.exists() and info.read_text().count(" ") == 2):
            assert time.monotonic() < deadline and not task.done(), "the program did not start"
            await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    _run(main())
    pid, start_time, cwd = info.read_text().split()
    assert _gone(int(pid), int(start_time))
    assert not Path(cwd).exists()


@pytest.mark.parametrize("loop", LOOPS)
def test_concurrent_calls_keep_their_own_output_and_folders(loop):
    async def main():
        return await asyncio.gather(*(
            run_python(f"import os; print({i}, os.getcwd())", timeout_s=60, **_network_kwargs())
            for i in range(6)))

    results = _run(main(), loop)
    assert [r.exit_code for r in results] == [0] * 6
    lines = [r.stdout.split() for r in results]
    assert [int(i) for i, _ in lines] == list(range(6))
    assert len({cwd for _, cwd in lines}) == 6
    assert not any(Path(cwd).exists() for _, cwd in lines)


def test_bad_arguments():
    for kwargs in ({"timeout_s": 0}, {"memory_mib": 8}, {"max_output_bytes": 0}, {"network": "on"}):
        with pytest.raises(ValueError):
            _sandbox("pass", **kwargs)


# --- SandboxResult.text ---

def _result(stdout="", stderr="", exit_code=0, timed_out=False, truncated=False, cap=4096):
    return SandboxResult(stdout=stdout, stderr=stderr, exit_code=exit_code, timed_out=timed_out,
                         truncated=truncated, seconds=0.1, timeout_s=5.0, max_output_bytes=cap)


def test_text_notes():
    assert _result().text == "[no output]"
    assert _result(stdout="4").text == "4"
    assert _result(stdout="1\n", stderr="w\n").text == "1\nw\n"
    assert _result(stdout="1", stderr="w").text == "1\nw"
    assert _result(exit_code=None, timed_out=True).text == "[timed out after 5 s]"
    assert _result(stdout="x", exit_code=-9).text == "x\n[killed by SIGKILL]"
    assert _result(exit_code=-24).text == "[killed by SIGXCPU: CPU time limit]"
    assert _result(exit_code=-200).text == "[killed by signal 200]"
    assert _result(stdout="x" * 10, truncated=True).text == "x" * 10 + "\n[output truncated]"


def test_text_keeps_the_end_of_a_traceback():
    stderr = "Traceback (most recent call last):\n" + "  frame\n" * 200 + "KeyError: 'answer'\n"
    text = _result(stdout="y" * 5000, stderr=stderr, exit_code=1, cap=1000).text
    assert len(text.encode()) <= 1000
    assert text.startswith("yyy")
    assert text.endswith("KeyError: 'answer'\n[output truncated]\n[exit code 1]")


@settings(max_examples=300, deadline=None)
@given(stdout=st.text(), stderr=st.text(), cap=st.integers(1, 300),
       exit_code=st.one_of(st.none(), st.integers(-64, 255)), truncated=st.booleans())
def test_text_never_exceeds_the_cap(stdout, stderr, cap, exit_code, truncated):
    text = _result(stdout, stderr, exit_code, exit_code is None, truncated, cap).text
    assert len(text.encode()) <= cap
    if cap >= 200 and len(stdout.encode()) + len(stderr.encode()) + 1 <= cap - 60 and not truncated:
        assert stdout in text and stderr in text
