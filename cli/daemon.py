"""Running the daemon (control plane + engine processes) on a run dir.

The run dir holds everything of one daemon: ``daemon.lock`` (an flock held for the
daemon's life: a second daemon on the same dir is refused), ``daemon.json`` (pid,
addresses, state — how clients and ``seerctl`` find it), the ipc sockets, and the logs
(``controlplane.log``, ``engine-N.log`` JSON lines; ``engine-N.out`` raw engine
output). The daemon removes its sockets, ``daemon.json`` and the lock on exit; logs stay.

Liveness is the lock, never the pid: a daemon runs on a run dir exactly while some
process holds ``daemon.lock``. The pid in ``daemon.json`` may be stale (the daemon was
SIGKILLed) and reused by an unrelated process, so ``stop`` signals that pid only while
the lock is held and only if that process has ``daemon.lock`` open.

An owned daemon (``seerctl start --owner-pid PID``; ``start_background``'s caller by default:
an embedded ``seerctl rollout``, the benchmarks) stops as on SIGTERM (engines, KV pool) when
its owner exits by any means, SIGKILL and the OOM killer included; ``daemon.json`` records
``owner_pid``. ``stop`` unlinks the KV pool segment a daemon killed after ``--timeout`` left.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from seer.config import SeerConfig
from seer.dataplane.kvpool import SEGMENT_PREFIX
from seer.process import process_start_time, remove_stale_shm, wait_exit

IPC_PATH_MAX = 100  # sun_path is 108 bytes on Linux, minus "ipc://" slack
LOCK_FILE = "daemon.lock"
ERROR_FILE = "daemon.error"  # why the daemon could not start, one line (read by start_background)
# A probe (lock_held) holds a shared lock for microseconds; a daemon starting at that
# instant retries this long before it concludes that another daemon holds the lock.
LOCK_RETRY_S = 1.0
CALLER = 0  # start_background's owner_pid: the calling process owns the daemon


class DaemonError(RuntimeError):
    pass


def read_info(run_dir: Path) -> dict | None:
    try:
        return json.loads((run_dir / "daemon.json").read_text())
    except (FileNotFoundError, ValueError):
        return None


def info_fields(config: SeerConfig) -> dict:
    """What a daemon accepts, written into its ``daemon.json``: ``seerctl rollout`` checks a
    request against them before sending it (``preflight.DaemonLimits.of_info``), the client
    its size (``SeerClient``'s ``max_request_bytes``)."""
    s = config.server
    return {"max_request_bytes": s.max_request_bytes, "max_group_size": s.max_group_size,
            "max_prompts_per_rollout": s.max_prompts_per_rollout, "policy": config.scheduler.policy}


def lock_held(run_dir: Path) -> bool:
    """True while a daemon holds the run dir's ``daemon.lock`` (probed without blocking)."""
    try:
        fd = os.open(run_dir / LOCK_FILE, os.O_RDONLY | os.O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError):
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)


def holds_lock_file(pid: int, run_dir: Path) -> bool:
    """True if process ``pid`` has the run dir's ``daemon.lock`` open (read from /proc):
    the check that the pid in ``daemon.json`` is the daemon and not a stranger that
    reused the number."""
    lock = os.path.realpath(run_dir / LOCK_FILE)
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except (FileNotFoundError, PermissionError, ProcessLookupError):
        return False
    for fd in fds:
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") == lock:
                return True
        except OSError:
            continue
    return False


def running_daemon(run_dir: Path) -> dict | None:
    """``daemon.json`` of the daemon running on ``run_dir``, or None (the lock is free)."""
    info = read_info(run_dir)
    if info and lock_held(run_dir):
        return info
    return None


def _acquire_lock(run_dir: Path):
    lock_file = open(run_dir / LOCK_FILE, "a+")  # noqa: SIM115 - held for the process lifetime
    deadline = time.monotonic() + LOCK_RETRY_S
    while True:
        try:
            fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return lock_file
        except BlockingIOError:
            if time.monotonic() >= deadline:
                lock_file.close()
                info = read_info(run_dir) or {}
                raise DaemonError(f"a Seer daemon (pid {info.get('pid', '?')}) already runs on {run_dir}; "
                                  f"stop it with `seerctl stop --run-dir {run_dir}` or choose another --run-dir"
                                  ) from None
            time.sleep(0.05)


def addresses(config: SeerConfig, run_dir: Path) -> tuple[str, str]:
    client = config.server.client_address or f"ipc://{run_dir / 'client.sock'}"
    engine = config.server.engine_address or f"ipc://{run_dir / 'engines.sock'}"
    for addr in (client, engine):
        if addr.startswith("ipc://") and len(addr) > IPC_PATH_MAX:
            raise DaemonError(f"the socket path {addr} is longer than {IPC_PATH_MAX} characters (a Unix socket "
                              "limit); use a shorter --run-dir")
    return client, engine


def bind_endpoint(config: SeerConfig, section: str) -> socket.socket | None:
    """The bound socket of the ``[metrics]`` or ``[openai]`` endpoint (None when off); a port
    in use is a one-line ``DaemonError``. ``seerctl start`` and an embedded ``seerctl
    rollout`` probe both (``probe_ports``) before spawning the daemon, which binds them
    before any engine."""
    settings = config.metrics if section == "metrics" else config.openai
    if not settings.enabled:
        return None
    from seer.controlplane.metrics_http import MetricsBindError, bind_metrics_socket

    try:
        return bind_metrics_socket(settings, section)
    except MetricsBindError as exc:
        raise DaemonError(str(exc)) from None


def probe_ports(config: SeerConfig) -> None:
    """Bind and release the endpoints' ports: one in use fails before anything starts."""
    for section in ("metrics", "openai"):
        if (probe := bind_endpoint(config, section)) is not None:
            probe.close()


def resolve_model_path(config: SeerConfig, cache_dir: Path) -> str:
    if config.engines.backend == "sim":
        return ""
    if config.model.path:
        path = Path(config.model.path).expanduser()
        if not (path / "config.json").exists():
            raise DaemonError(f"model.path = {str(path)!r} is not an HF model folder (no config.json); "
                              "fix model.path in seer.toml or leave it empty for the bundled SmolLM2")
    else:
        from seer.engines.model_store import is_prepared, model_dir

        if not is_prepared(cache_dir):
            raise DaemonError(f"the default model is not prepared in {cache_dir}; run `seerctl model prepare` "
                              "(scripts/setup.sh does it) or set model.path in seer.toml")
        path = model_dir(cache_dir)
    check_context_length(config.model.max_model_len, path / "config.json")
    return str(path)


def check_context_length(max_model_len: int, hf_config: Path) -> None:
    """Refuse a ``model.max_model_len`` above the model's position limit before any engine
    starts (vLLM refuses it too, but inside each engine process, after its start-up).
    Only the plain case is checked: ``max_position_embeddings`` without RoPE scaling,
    which lengthens the limit by rules vLLM owns. ``VLLM_ALLOW_LONG_MAX_MODEL_LEN=1``
    (vLLM's own override) skips the check."""
    if os.environ.get("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "").strip().lower() in ("1", "true"):
        return
    try:
        hf = json.loads(hf_config.read_text())
    except (OSError, ValueError) as exc:
        raise DaemonError(f"cannot read the model's {hf_config}: {exc}; fix model.path in seer.toml") from None
    limit = hf.get("max_position_embeddings") if isinstance(hf, dict) else None
    if not isinstance(limit, int) or hf.get("rope_scaling"):
        return
    if max_model_len > limit:
        raise DaemonError(f"model.max_model_len = {max_model_len} is longer than the model allows: "
                          f"max_position_embeddings = {limit} in {hf_config}. Set model.max_model_len to at most "
                          f"{limit} in seer.toml")


def owner_of(pid: int, start_time: int | None = None) -> tuple[int, int]:
    """(pid, start time) of a running owner process (``start_time``: the one seen by whoever
    named it; a pid now running another process is refused)."""
    started = process_start_time(pid)
    if started is None or start_time not in (None, started):
        raise DaemonError(f"the owner process {pid} (--owner-pid) is not running; nothing was started")
    return pid, started


def run_foreground(config: SeerConfig, run_dir: Path, cache_dir: Path,
                   owner: tuple[int, int | None] | None = None) -> int:
    """Run the daemon in this process until stopped (SIGTERM/SIGINT, a shutdown call, or the
    exit of ``owner``: (pid, start time if known) of the process this daemon was started for)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    lock_file = _acquire_lock(run_dir)
    from seer.logs import configure_logging

    configure_logging("controlplane", run_dir / "controlplane.log", config.logging.level, console=True)
    client_address, engine_address = addresses(config, run_dir)
    try:
        if owner is not None:
            owner = owner_of(*owner)  # gone during start-up: nothing to start for
        model_path = resolve_model_path(config, cache_dir)
        metrics_socket = bind_endpoint(config, "metrics")  # before any engine: a port in use leaves nothing behind
        openai_socket = bind_endpoint(config, "openai")
    except DaemonError as exc:
        (run_dir / ERROR_FILE).write_text(str(exc) + "\n")  # start_background prints this line alone
        raise
    for stale in ("client.sock", "engines.sock"):
        (run_dir / stale).unlink(missing_ok=True)

    from seer.controlplane.server import ControlPlane
    from seer.controlplane.supervisor import Supervisor
    from seer.controlplane.tokenizer import ByteTokenizer, HFTokenizer

    launcher = None
    if config.cluster.launcher == "ray":  # engines join from Ray actors instead of local processes
        launcher = _connect_ray(config, run_dir, engine_address, cache_dir, lock_file)
    tokenizer = ByteTokenizer() if config.engines.backend == "sim" else HFTokenizer(model_path)
    supervisor = Supervisor(config, run_dir, engine_address, model_path) if launcher is None else None
    plane = ControlPlane(config, client_address=client_address, engine_address=engine_address, tokenizer=tokenizer,
                         run_dir=run_dir, supervisor=supervisor, metrics_socket=metrics_socket, launcher=launcher,
                         openai_socket=openai_socket)
    info = {"pid": os.getpid(), "client_address": client_address, "engine_address": engine_address,
            "run_dir": str(run_dir), "state": "starting", "started_at": time.time(),
            # Paths (never key bytes) so seerctl status/stop can talk CURVE to a tcp:// client address.
            "curve_server_public_key": config.server.curve_server_public_key,
            "curve_client_secret_key": config.server.curve_client_secret_key,
            # So seerctl rollout and the client refuse an over-size or invalid request before
            # sending it (a frame beyond twice max_request_bytes is dropped unanswered).
            **info_fields(config)}
    if owner is not None:
        info["owner_pid"] = owner[0]  # the daemon stops when this process exits
    if metrics_socket is not None:
        from seer.controlplane.metrics_http import metrics_url

        info["metrics_url"] = metrics_url(metrics_socket)
    if plane.openai is not None:
        info["openai_url"] = plane.openai.url + "/v1"

    def write_info(**changes: object) -> None:
        info.update(changes)
        tmp = run_dir / "daemon.json.tmp"
        tmp.write_text(json.dumps(info))
        tmp.replace(run_dir / "daemon.json")

    def on_ready() -> None:
        """Every engine ready, or start-up timed out: daemon.json says which engines serve
        and why each other one does not (``seerctl start`` names them instead of "ready")."""
        ready = plane.registry.ready_ids()
        not_ready = {str(e): why for e, why in plane.registry.not_ready(list(range(config.engines.count))).items()}
        if launcher is not None and len(ready) < launcher.num_engines:  # joined engines have no id until ready
            not_ready = {"ray": f"{launcher.num_engines - len(ready)} of {launcher.num_engines} engine actors did not "
                                 "join; see `ray status` and the run dir's logs"}
        write_info(state="ready" if ready else "failed", engines=ready, engines_not_ready=not_ready)

    write_info()
    import asyncio

    import uvloop

    from seer.controlplane.gc_tuning import tune_for_service

    tune_for_service()  # start-up is done: the collector now runs for the scheduler's sake

    async def stop_with_owner(pid: int, start_time: int) -> None:
        await wait_exit(pid, start_time)
        import structlog

        structlog.get_logger().warning("owner_exited", owner_pid=pid, effect="stopping as on SIGTERM")
        plane.stop()

    async def main() -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, plane.stop)
        watch = asyncio.create_task(stop_with_owner(*owner)) if owner is not None else None
        try:
            await plane.serve(on_ready=on_ready)
        finally:
            if watch is not None:
                watch.cancel()

    try:
        uvloop.run(main())
    finally:
        for name in ("daemon.json", "client.sock", "engines.sock"):
            (run_dir / name).unlink(missing_ok=True)
        fcntl.flock(lock_file, fcntl.LOCK_UN)
        lock_file.close()
    return 0


def _connect_ray(config: SeerConfig, run_dir: Path, engine_address: str, cache_dir: Path, lock_file):
    """The Ray launcher, connected and its placement group ready; on failure the daemon
    writes the one-line reason to ``daemon.error`` (``start_background`` prints it) and
    exits 1 at once (a ``ray.init`` that never answered may still hold a thread)."""
    from seer.cli.ray_launcher import LaunchError, RayLauncher

    launcher = RayLauncher(config, run_dir, engine_address, cache_dir)
    try:
        launcher.connect()
    except LaunchError as exc:
        import structlog

        structlog.get_logger().error("ray_launch_failed", error=str(exc))
        (run_dir / ERROR_FILE).write_text(str(exc) + "\n")
        fcntl.flock(lock_file, fcntl.LOCK_UN)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    return launcher


def start_background(config_path: str | None, run_dir: Path, cache_dir: Path, timeout_s: float,
                     extra_args: list[str] | None = None, owner_pid: int | None = CALLER) -> dict:
    """Spawn ``seerctl start --foreground`` detached; wait until engines are ready.

    The daemon stops when process ``owner_pid`` exits (default ``CALLER``: this process);
    None: it runs until stopped (plain ``seerctl start``)."""
    owner = owner_of(os.getpid() if owner_pid == CALLER else owner_pid) if owner_pid is not None else None
    if running_daemon(run_dir):
        info = read_info(run_dir) or {}
        raise DaemonError(f"a Seer daemon (pid {info.get('pid')}) already runs on {run_dir}; "
                          f"stop it with `seerctl stop --run-dir {run_dir}` or choose another --run-dir")
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "daemon.json").unlink(missing_ok=True)
    (run_dir / ERROR_FILE).unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "seer.cli.main", "start", "--foreground", "--run-dir", str(run_dir),
           "--cache-dir", str(cache_dir)]
    if config_path:
        cmd += ["--config", str(config_path)]
    if owner is not None:
        cmd += ["--owner-pid", str(owner[0]), "--owner-start-time", str(owner[1])]
    cmd += extra_args or []
    out = open(run_dir / "daemon.out", "ab")  # noqa: SIM115 - handed to the child
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True)
    out.close()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        code = proc.poll()
        info = read_info(run_dir)
        if code is not None:
            if (reason := _read_error(run_dir)) is not None:
                raise DaemonError(reason)
            raise DaemonError(f"the daemon exited with code {code} during start-up:\n{_tail(run_dir / 'daemon.out')}")
        if info and info.get("pid") == proc.pid and info.get("state") in ("ready", "failed"):
            if info["state"] == "failed":
                stop(run_dir, 30.0)
                raise DaemonError(f"no engine became ready; see the logs in {run_dir}. The end of each engine's "
                                  f"output:\n{_engines_tail(run_dir)}")
            return info
        time.sleep(0.3)
    stop(run_dir, 30.0)
    raise DaemonError(f"the daemon did not become ready within {timeout_s:.0f} s (engines.startup_timeout_s); "
                      f"see {run_dir}")


def stop(run_dir: Path, timeout_s: float) -> bool:
    """Graceful shutdown through the client socket, then signals. True if it was running.

    Only a daemon that holds the run dir's lock is stopped, and signals go only to the
    pid of ``daemon.json`` when that process has the lock file open; a stale
    ``daemon.json`` (lock free) is removed and nothing is signalled. Either way, once that
    pid has exited, its KV pool segments are unlinked (a SIGKILL skips the daemon's own unlink)."""
    info = read_info(run_dir)
    pid = int((info or {}).get("pid", 0))
    if not lock_held(run_dir):
        if info is not None:  # a daemon that was killed: its KV pool segment may be left
            _sweep(pid)
            (run_dir / "daemon.json").unlink(missing_ok=True)
        return False
    ours = pid > 0 and holds_lock_file(pid, run_dir)
    try:
        if info is None:
            raise DaemonError("no daemon.json to find the client address")
        from seer.auth import ClientKeys
        from seer.client import SeerClient

        with SeerClient(info["client_address"], timeout_s=min(10.0, timeout_s), keys=ClientKeys.from_info(info)) as client:
            client.shutdown()
    except Exception:  # noqa: BLE001 - fall through to signals
        _signal_daemon(pid, ours, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while lock_held(run_dir) and time.monotonic() < deadline:
        _reap(pid)
        time.sleep(0.2)
    if lock_held(run_dir):
        # Killed mid-shutdown (engines slower than timeout_s): its KV pool is not unlinked yet.
        _signal_daemon(pid, ours, signal.SIGKILL)
        deadline = time.monotonic() + 10.0
        while ours and process_start_time(pid) is not None and time.monotonic() < deadline:
            _reap(pid)
            time.sleep(0.1)
    _reap(pid)
    _sweep(pid)
    return True


def _sweep(pid: int) -> list[str]:
    """Unlink the KV pool segments (``seer-kv-<pid>-*``) of daemon ``pid`` if it has exited."""
    return remove_stale_shm(SEGMENT_PREFIX, pid=pid) if pid > 0 else []


def _signal_daemon(pid: int, ours: bool, sig: int) -> None:
    """Signal the daemon only if ``pid`` was seen holding the run dir's lock file."""
    if not ours:
        return
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _reap(pid: int) -> None:
    if pid <= 0:
        return  # waitpid(0) would reap any child of ours
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def _read_error(run_dir: Path) -> str | None:
    try:
        reason = (run_dir / ERROR_FILE).read_text().strip()
    except FileNotFoundError:
        return None
    (run_dir / ERROR_FILE).unlink(missing_ok=True)
    return reason or None


# Lines that bury the real error at the end of a process's output: nanobind's reference-leak
# report, which Triton's bindings print at every interpreter exit (hundreds of lines).
_NOISE = ("nanobind: ", " - leaked ", "See https://nanobind.", " - ... skipped remainder")


def _tail(path: Path, lines: int = 30) -> str:
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return f"({path} is missing)"
    kept = [line for line in text.splitlines() if not line.startswith(_NOISE)]
    return "\n".join(kept[-lines:])


# An exception line, bare or behind vLLM's log prefix "(Worker pid=N) ERROR <time> [file:line] ".
_EXCEPTION_LINE = re.compile(r"^(?:\(\w+ pid=\d+\) )?(?:ERROR \S+ \S+ \[\S+\] )?"
                             r"([A-Za-z_][\w.]*(?:Error|Exception)\b.*)$")


def _first_error(path: Path) -> str | None:
    """The first exception line of a process's output: with vLLM's worker processes, the
    root cause (the lines after it are the parents reporting that a child failed)."""
    try:
        with path.open(errors="replace") as f:
            for line in f:
                if (m := _EXCEPTION_LINE.match(line.rstrip("\n"))) is not None:
                    return m.group(1)
    except FileNotFoundError:
        return None
    return None


def _engines_tail(run_dir: Path, lines: int = 12) -> str:
    """Per engine: its first exception line and the last lines of its output (where a
    failed start-up says why)."""
    outs = sorted(run_dir.glob("engine-*.out"))
    if not outs:
        return _tail(run_dir / "daemon.out")
    parts = []
    for p in outs:
        first = _first_error(p)
        parts.append(f"--- {p.name}" + (f" (first error: {first})" if first else "") + f"\n{_tail(p, lines)}")
    return "\n".join(parts)
