"""Spawning and reaping the engine processes of a daemon on this host.

Each engine is ``python -m seer.engines.worker`` in its own session (process group),
so stopping it also stops the helper processes vLLM forks. Each spawn gets a fresh secret
(``EngineProcess.secret``) that its hello must carry (``Registry.expect``): a process that
connects to the engine socket cannot take the engine's id without it. It is handed over
through a pipe the engine inherits (``--secret-fd``), read once at start: never on the
command line (``ps``) nor in the environment (``/proc/PID/environ``). The supervisor never imports
engine code; it passes the config as a JSON file and per-engine environment: the CPU
KV size (``VLLM_CPU_KVCACHE_SPACE``) and, with ``cpu_binding = "auto"``, a disjoint set
of cores per engine (``VLLM_CPU_OMP_THREADS_BIND``) so engines do not fight over cores.

With grouped speculative decoding (``[speculative] method = "grouped"``) it also runs
the host's draft server (``python -m seer.dataplane.draft_server``) before the engines and
stops it after them. Engines find it through the run dir (``draft-server.json``); its
shared-memory rings are unlinked at stop, and those of dead servers at the next start.

Whatever ``/dev/shm`` files an engine's process tree leaves behind when it dies (vLLM's
``psm_*`` segments and ``sem.mp-*`` semaphores after a ``kill -9``) are unlinked by
``ShmReclaimer`` (controlplane/shm_reclaim.py): a watcher thread records each tree's files
every ``SHM_SCAN_INTERVAL_S`` and reclaims a tree's leftovers as soon as none of its
processes is alive; ``stop_all`` does the same for every engine after killing them.
"""

from __future__ import annotations

import math
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from seer.config import SeerConfig
from seer.controlplane.shm_reclaim import ShmReclaimer

log = structlog.get_logger()

# Seconds to wait for the draft server's info file before starting engines without it
# (they draft locally and connect when it appears).
DRAFT_SERVER_START_TIMEOUT_S = 30.0
# How often the engines' process trees are scanned for the /dev/shm files they use (and
# dead trees' leftovers reclaimed): about 10 ms of /proc reading per scan (measured with a
# torch process and 95 others), off the event loop but holding the GIL meanwhile.
SHM_SCAN_INTERVAL_S = 2.0
# After the final SIGKILL at stop, how long to wait for an engine's whole session to be gone.
SESSION_EXIT_WAIT_S = 5.0


@dataclass
class EngineProcess:
    engine_id: int
    popen: subprocess.Popen[bytes]
    secret: str = field(default="", repr=False)  # what its hello proves it is this spawn with

    @property
    def pid(self) -> int:
        return self.popen.pid

    def exited(self) -> int | None:
        return self.popen.poll()


def cpu_sets(num_engines: int, num_cpus: int) -> list[str]:
    """Disjoint core ranges per engine when there are enough cores, else one core each."""
    if num_engines <= num_cpus:
        per = num_cpus // num_engines
        return [f"{i * per}-{i * per + per - 1}" if per > 1 else str(i * per) for i in range(num_engines)]
    return [str(i % num_cpus) for i in range(num_engines)]


class Supervisor:
    def __init__(self, config: SeerConfig, run_dir: Path, engine_address: str, model_path: str) -> None:
        self.config = config
        self.run_dir = run_dir
        self.engine_address = engine_address
        self.model_path = model_path
        self.processes: dict[int, EngineProcess] = {}
        self.draft_server: subprocess.Popen[bytes] | None = None
        self._config_file = run_dir / "engine-config.json"
        self.shm = ShmReclaimer()
        self._shm_lock = threading.Lock()
        self._shm_stop = threading.Event()
        self._shm_thread: threading.Thread | None = None

    def spawn_all(self) -> list[EngineProcess]:
        import msgspec

        self._config_file.write_bytes(msgspec.json.encode(self.config))
        if grouped_drafting(self.config):
            self.start_draft_server()
        cores = cpu_sets(self.config.engines.count, os.cpu_count() or 1)
        spawned = [self.spawn(i, cores[i]) for i in range(self.config.engines.count)]
        self._shm_thread = threading.Thread(target=self._watch_shm, name="shm-reclaim", daemon=True)
        self._shm_thread.start()
        return spawned

    def spawn(self, engine_id: int, cores: str) -> EngineProcess:
        env = dict(os.environ)
        env["VLLM_CPU_KVCACHE_SPACE"] = kv_cache_space_env(self.config.engines.kv_cache_gib)
        if self.config.engines.cpu_binding == "auto":
            env["VLLM_CPU_OMP_THREADS_BIND"] = cores
        elif self.config.kv_pool.enabled:
            # Any KV connector makes vLLM's automatic binding reserve one more core
            # ("for nixl"); keep the reservation it makes without one.
            env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
        cmd = [sys.executable, "-m", "seer.engines.worker", "--engine-id", str(engine_id),
               "--connect", self.engine_address, "--config", str(self._config_file),
               "--model-path", self.model_path, "--log-file", str(self.run_dir / f"engine-{engine_id}.log"),
               "--die-with-parent"]
        secret = secrets.token_urlsafe(32)
        secret_fd = secret_pipe(secret)
        cmd += ["--secret-fd", str(secret_fd)]  # the descriptor's number, not the secret
        out = open(self.run_dir / f"engine-{engine_id}.out", "ab")  # noqa: SIM115 - handed to the child
        baseline = self.shm.names()  # before the spawn: nothing in it can be the new engine's
        try:
            popen = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True, pass_fds=(secret_fd,))
        finally:
            os.close(secret_fd)
            out.close()
        with self._shm_lock:
            self.shm.watch(popen.pid, engine_id, baseline)
        proc = EngineProcess(engine_id, popen, secret)
        self.processes[engine_id] = proc
        return proc

    def start_draft_server(self) -> subprocess.Popen[bytes] | None:
        """Start the host's draft server and wait until it announced itself in the run dir."""
        from seer.dataplane.draft_server import INFO_FILE, read_info

        (self.run_dir / INFO_FILE).unlink(missing_ok=True)  # a dead server's file must not be waited for
        cmd = [sys.executable, "-m", "seer.dataplane.draft_server", "--dir", str(self.run_dir),
               "--log-file", str(self.run_dir / "draft-server.log"), "--log-level", self.config.logging.level,
               "--die-with-parent"]
        out = open(self.run_dir / "draft-server.out", "ab")  # noqa: SIM115 - handed to the child
        popen = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                 start_new_session=True)
        out.close()
        self.draft_server = popen
        deadline = time.monotonic() + DRAFT_SERVER_START_TIMEOUT_S
        while time.monotonic() < deadline:
            info = read_info(self.run_dir)
            if info is not None and info.pid == popen.pid:
                log.info("draft_server_spawned", pid=popen.pid)
                return popen
            if popen.poll() is not None:
                break
            time.sleep(0.05)
        log.error("draft_server_start_failed", pid=popen.pid, exit_code=popen.poll(),
                  output=str(self.run_dir / "draft-server.out"))
        return popen

    def stop_draft_server(self, grace_s: float = 10.0) -> None:
        """SIGTERM the draft server (it unlinks its rings), then make sure nothing is left."""
        popen = self.draft_server
        if popen is None:
            return
        from seer.dataplane.draft_server import INFO_FILE, PREFIX, SHM_DIR, read_info

        _kill_group(popen.pid, signal.SIGTERM)
        try:
            popen.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            _kill_group(popen.pid, signal.SIGKILL)
            try:
                popen.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        # After a kill the server could not clean up: its rings carry its pid.
        for path in SHM_DIR.glob(f"{PREFIX}{popen.pid}-*"):
            path.unlink(missing_ok=True)
        info = read_info(self.run_dir)
        if info is not None and info.pid == popen.pid:
            (self.run_dir / INFO_FILE).unlink(missing_ok=True)
        log.info("draft_server_reaped", pid=popen.pid, exit_code=popen.returncode)
        self.draft_server = None

    def stop_all(self, grace_s: float) -> None:
        """Wait up to ``grace_s`` for engines to exit (after Shutdown), then kill groups;
        then stop the draft server."""
        with self._shm_lock:  # what the engines use now, in case they must be killed below
            self.shm.scan()
        deadline = time.monotonic() + grace_s
        for proc in self.processes.values():
            remaining = max(0.0, deadline - time.monotonic())
            try:
                proc.popen.wait(timeout=remaining)
            except subprocess.TimeoutExpired:
                pass
        for proc in self.processes.values():
            _kill_group(proc.pid, signal.SIGTERM)
        time.sleep(0.5)
        for proc in self.processes.values():
            _kill_group(proc.pid, signal.SIGKILL)
            try:
                proc.popen.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        self._shm_stop.set()
        if self._shm_thread is not None:
            self._shm_thread.join()
        self._reclaim_all_sessions()
        self.stop_draft_server()

    def _watch_shm(self) -> None:
        """Record the engine trees' /dev/shm files; reclaim a tree's leftovers once it is gone."""
        while not self._shm_stop.wait(SHM_SCAN_INTERVAL_S):
            try:
                with self._shm_lock:
                    self.shm.scan()
                    for session_id in self.shm.watching():
                        proc = self._process_by_pid(session_id)
                        if proc is not None and proc.exited() is not None and not self.shm.session_alive(session_id):
                            self.shm.reclaim(session_id)
            except Exception:  # noqa: BLE001 - a /proc surprise must not end the watching
                log.exception("engine_shm_scan_failed")

    def _reclaim_all_sessions(self) -> None:
        """At stop: every engine session's processes killed (also those outside the engine's
        process group; a session id is not reused while any member lives), then reclaimed."""
        with self._shm_lock:
            for session_id in self.shm.watching():
                deadline = time.monotonic() + SESSION_EXIT_WAIT_S
                while self.shm.session_alive(session_id) and time.monotonic() < deadline:
                    self._kill_session(session_id)
                    time.sleep(0.1)
                if self.shm.session_alive(session_id):
                    log.warning("engine_shm_reclaim_skipped", session_id=session_id,
                                reason="processes of the engine's session are still alive")
                    continue
                self.shm.reclaim(session_id)

    def _kill_session(self, session_id: int) -> None:
        for pid, session in self.shm.sessions():
            if session == session_id:
                try:
                    os.kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass

    def _process_by_pid(self, pid: int) -> EngineProcess | None:
        return next((p for p in self.processes.values() if p.pid == pid), None)


def secret_pipe(secret: str) -> int:
    """The read end of a pipe that holds ``secret`` and then ends (the write end is closed):
    what a spawned engine reads its secret from (``engines/worker.py``, ``--secret-fd``). The
    secret fits the pipe's buffer, so writing it never blocks."""
    read_fd, write_fd = os.pipe()
    try:
        os.write(write_fd, secret.encode())
    finally:
        os.close(write_fd)
    return read_fd


def grouped_drafting(config: SeerConfig) -> bool:
    """True if the config asks for grouped speculative decoding (read defensively: the
    ``[speculative]`` section is optional in older configs)."""
    speculative = getattr(config, "speculative", None)
    return getattr(speculative, "method", "off") == "grouped"


def _kill_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def kv_cache_space_env(gib: float) -> str:
    """VLLM_CPU_KVCACHE_SPACE for ``engines.kv_cache_gib``: vLLM's CPU build parses it as
    a whole number of GiB (a fraction kills the engine at start), so a fraction is rounded
    up here and the engine caps its KV blocks at the exact budget
    (``VLLMBackend(kv_cache_gib=...)``, ``num_gpu_blocks_override``)."""
    return str(math.ceil(gib))
