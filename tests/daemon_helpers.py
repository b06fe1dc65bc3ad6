"""Helpers for tests that run real daemons: seerctl in a subprocess, sim configs,
process and /dev/shm checks."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

SEERCTL = [sys.executable, "-m", "seer.cli.main"]


def seerctl(*args: str, timeout: float = 120.0, env: dict | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*SEERCTL, *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def write_sim_config(path: Path, server: dict | None = None, *, max_model_len: int = 512, **engines: object) -> Path:
    settings = {"backend": "sim", "count": 2, "sim_step_s": 0.002, "heartbeat_timeout_s": 5.0, **engines}
    lines = ["[engines]"] + [f"{k} = {json.dumps(v)}" for k, v in settings.items()]  # JSON scalars are TOML
    server_settings = {"client_timeout_s": 3.0, "max_group_size": 16, "max_request_bytes": 200000, **(server or {})}
    lines += ["", "[server]"] + [f"{k} = {json.dumps(v)}" for k, v in server_settings.items()]
    # Small chunks, and never whole samples, so chunked policies really chunk.
    lines += ["", "[scheduler]", "chunk_size_tokens = 16", 'chunking = "always"']
    lines += ["", "[model]", f"max_model_len = {max_model_len}"]
    path.write_text("\n".join(lines) + "\n")
    return path


class Daemon:
    def __init__(self, run_dir: Path, config: Path) -> None:
        self.run_dir = run_dir
        self.config = config
        self.shm_before: set[str] = set()

    def start(self) -> dict:
        # Waits for the engines: real vLLM takes 45 s to start on an idle 2-core machine and
        # several times that on a loaded one.
        proc = seerctl("start", "--config", str(self.config), "--run-dir", str(self.run_dir), timeout=900.0)
        assert proc.returncode == 0, proc.stderr + proc.stdout
        import json

        return json.loads((self.run_dir / "daemon.json").read_text())

    def stop(self) -> None:
        seerctl("stop", "--run-dir", str(self.run_dir))

    @property
    def address(self) -> str:
        import json

        return json.loads((self.run_dir / "daemon.json").read_text())["client_address"]


def shm_entries() -> set[str]:
    try:
        return set(os.listdir("/dev/shm"))
    except FileNotFoundError:
        return set()


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still "exists"; treat it as dead.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False




def free_tcp_port() -> int:
    """A loopback port free now and below the kernel's ephemeral range.

    A port from bind(0) is an ephemeral one, which the kernel may hand to any outgoing
    connection (a local Ray cluster makes many) before the daemon binds it: CI lost that race
    once ("Address already in use" on 127.0.0.1:35999). Ports below the ephemeral range are
    only ever taken by an explicit bind, and the random pick keeps two tests from colliding."""
    import random
    import socket

    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    candidates = random.sample(range(20000, max(20001, low)), k=min(64, max(1, low - 20000)))
    for port in candidates:
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free loopback port among {len(candidates)} tried in [20000, {low})")


def curve_tcp_server() -> dict:
    """A ``[server]`` table for a daemon on loopback tcp:// with CURVE, using the files
    ``seerctl keys keys`` writes next to the config (paths are relative to the config)."""
    return {
        "client_address": f"tcp://127.0.0.1:{free_tcp_port()}",
        "engine_address": f"tcp://127.0.0.1:{free_tcp_port()}",
        "curve_server_secret_key": "keys/server.key_secret",
        "curve_authorized_keys": "keys/authorized",
        "curve_server_public_key": "keys/server.key",
        "curve_client_secret_key": "keys/client.key_secret",
    }


def stop_process(proc: subprocess.Popen) -> None:
    """SIGTERM a process started with start_new_session=True; its group is SIGKILLed
    if it has not exited within 30 s."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def wait_for(predicate, timeout_s: float, what: str, interval_s: float = 0.2) -> None:
    """Poll ``predicate`` until it is true; fail naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(interval_s)
    raise AssertionError(f"timed out waiting for {what}")


def netns_pair_or_skip():
    """Fixture body: yield two network namespaces joined by a veth link (``NetnsPair``), or
    skip the test where this machine does not allow creating them; remove them after."""
    import pytest

    from seer.dataplane.netns import NetnsPair, NetnsUnavailable

    try:
        pair = NetnsPair()
    except NetnsUnavailable as exc:
        pytest.skip(f"cannot create network namespaces here: {exc}")
    yield pair
    pair.close()
    assert not any(name in os.popen("ip netns list").read() for name in pair.names), "a namespace was left behind"


@contextlib.contextmanager
def local_ray_cluster(num_cpus: int) -> Iterator[str]:
    """A one-node Ray cluster on this machine for the Ray launcher's tests; yields its GCS address."""
    import ray

    temp_dir = tempfile.mkdtemp(prefix="seer-ray-", dir="/tmp")  # short: Ray's Unix sockets live under it (108-byte limit)
    # Ray's memory monitor kills workers once the *host* passes 95 % memory: on a machine
    # shared with other engines that kills these actors for others' memory. Off here.
    os.environ["RAY_memory_monitor_refresh_ms"] = "0"
    try:
        context = ray.init(num_cpus=num_cpus, include_dashboard=False, _temp_dir=temp_dir, namespace="seer-tests",
                           logging_level="warning", log_to_driver=False)
        yield context.address_info["gcs_address"]
    finally:
        ray.shutdown()
        os.environ.pop("RAY_memory_monitor_refresh_ms", None)
        shutil.rmtree(temp_dir, ignore_errors=True)  # Ray's session logs


@contextlib.contextmanager
def plane_logging(run_dir: Path) -> Iterator[None]:
    """A control plane run inside the test process logs to RUN_DIR/controlplane.log with
    uncached loggers, and structlog's defaults come back after: cached loggers would keep
    writing to that file, and later tests' ``capture_logs`` would see nothing."""
    import structlog

    from seer.logs import configure_logging

    configure_logging("controlplane", run_dir / "controlplane.log", "info", console=False, cache=False)
    try:
        yield
    finally:
        structlog.reset_defaults()


@contextlib.asynccontextmanager
async def in_process_plane(config, run_dir: Path):
    """A ControlPlane served by this event loop (its state is open to the test), with real
    engine processes from its Supervisor; yields (plane, client address)."""
    import asyncio

    from seer.controlplane.server import ControlPlane
    from seer.controlplane.supervisor import Supervisor
    from seer.controlplane.tokenizer import ByteTokenizer

    client_address, engine_address = f"ipc://{run_dir}/c.sock", f"ipc://{run_dir}/e.sock"
    plane = ControlPlane(config, client_address=client_address, engine_address=engine_address,
                         tokenizer=ByteTokenizer(), run_dir=run_dir,
                         supervisor=Supervisor(config, run_dir, engine_address, ""))
    ready = asyncio.Event()
    serving = asyncio.create_task(plane.serve(on_ready=ready.set))
    await asyncio.wait_for(ready.wait(), 120)
    try:
        yield plane, client_address
    finally:
        plane.stop()
        await serving
