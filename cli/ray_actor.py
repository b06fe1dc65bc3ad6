"""The Ray actor that runs one Seer engine process on a Ray node.

Owns: one ``seerctl engine --join ADDRESS`` process per actor (the normal joining
engine: CURVE TCP to the control plane, the node's KV pool and agent; Ray carries no
Seer data), its config file and logs on the node, and telling the launcher where it runs.

The actor lives exactly as long as its engine: ``wait()`` returns the engine's exit
code (polled in bounded calls), ``terminate()`` stops it at the daemon's stop, and an
actor that dies (``ray.kill``, its worker killed, its node lost) takes the engine with
it (the engine gets SIGTERM through ``die_with_parent`` and shuts down). The process is
started in ``__init__``, on the worker's main thread: PDEATHSIG fires when the *thread*
that forked dies, and the main thread lives as long as the worker. The launcher (``ray_launcher.py``) starts a new actor in the same bundle instead of
restarting this one. Ray is imported lazily here too: this module is imported by Ray
workers, which have it, and by ``ray_launcher`` only once Ray is in use.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def config_toml(config: dict) -> str:
    """seer.toml text for a config given as ``msgspec.to_builtins(SeerConfig)`` (tables of
    scalars: JSON strings, numbers and booleans are TOML too)."""
    lines: list[str] = []
    for section, values in config.items():
        lines += [f"[{section}]"] + [f"{key} = {json.dumps(value)}" for key, value in values.items()] + [""]
    return "\n".join(lines)


def engine_command(address: str, config_file: Path, cache_dir: str, log_file: Path) -> list[str]:
    """Exactly what an operator would run on the node: ``seerctl engine --join``."""
    return [sys.executable, "-m", "seer.cli.main", "engine", "--join", address, "--config", str(config_file),
            "--cache-dir", cache_dir, "--log-file", str(log_file)]


class EngineActor:
    """One engine process on this node (decorated with ``ray.remote`` by the launcher)."""

    def __init__(self, address: str, config: dict, cache_dir: str, log_dir: str, name: str) -> None:
        from seer.process import die_with_parent

        folder = Path(log_dir)
        folder.mkdir(parents=True, exist_ok=True)
        config_file = folder / f"{name}.toml"
        config_file.write_text(config_toml(config))
        with open(folder / f"{name}.out", "ab") as out:
            # Own session: the engine and what vLLM forks are one group; die_with_parent: an
            # actor killed by Ray does not leave its engine behind.
            self.proc = subprocess.Popen(engine_command(address, config_file, cache_dir, folder / f"{name}.log"),
                                         stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True, preexec_fn=die_with_parent)

    def where(self) -> tuple[str, int, str, str]:
        """(host id, engine pid, node IP, actor id): how the control plane knows this engine."""
        import ray

        from seer.dataplane.host import host_id

        return host_id(), self.proc.pid, ray.util.get_node_ip_address(), ray.get_runtime_context().get_actor_id()

    def wait(self, timeout_s: float) -> int | None:
        """The engine's exit code once it exits, or None if it still runs after ``timeout_s``
        (bounded, so a ``terminate`` queued behind it runs soon: actor calls are serial)."""
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def terminate(self, grace_s: float) -> int:
        """SIGTERM the engine (it stops its worker and this node's agent if it started it),
        SIGKILL its process group after ``grace_s``; its exit code."""
        import os
        import signal

        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # what vLLM forked, too
        except (ProcessLookupError, PermissionError):
            pass
        return self.proc.wait()
