"""``seerctl engine --join ADDRESS``: one engine process that joins a running control plane.

The engine is not a child of the daemon's supervisor: it is started by hand, by a
process manager on another host, or as a replacement for a lost engine. It reads the
same seer.toml as a daemon (``[engines]`` and ``[model]`` for the backend, ``[server]``
for its CURVE keys), says hello with ``JOIN_ENGINE_ID`` and gets a fresh engine id from
the control plane, so it can never collide with a spawned engine. If the control plane
goes away or restarts, the engine drops its in-flight work and registers again with
whatever control plane serves ADDRESS (``engine_rejoining`` in its log).
"""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

from seer.config import SeerConfig


class JoinError(RuntimeError):
    """The engine cannot join as configured; the message says what to fix."""


def join(config: SeerConfig, address: str, cache_dir: Path, log_file: Path | None) -> int:
    """Run the joining engine in this process until it is shut down; returns its exit code."""
    from seer.auth import AuthError, client_curve, is_tcp
    from seer.cli.daemon import resolve_model_path
    from seer.engines.worker import EngineWorker, make_backend
    from seer.logs import configure_logging
    from seer.protocol import JOIN_ENGINE_ID

    if not address.startswith(("tcp://", "ipc://")):
        raise JoinError(f"--join {address!r}: expected the control plane's engine address, tcp://HOST:PORT or "
                        "ipc://PATH (daemon.json's engine_address)")
    try:
        curve = client_curve(config.server, address)
    except AuthError as exc:
        raise JoinError(str(exc)) from None
    if is_tcp(address) and curve is None and not config.server.allow_insecure_tcp:
        raise JoinError(f"--join {address}: tcp:// without CURVE keys; set server.curve_server_public_key and "
                        "server.curve_client_secret_key in the config (files from `seerctl keys DIR`), or "
                        "server.allow_insecure_tcp = true if the daemon allows it")
    model_path = resolve_model_path(config, cache_dir)
    # vLLM's CPU build sizes its KV cache from the environment, read when vLLM starts.
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", _gib_str(config.engines.kv_cache_gib))
    configure_logging("engine-join", log_file, config.logging.level, console=True)
    backend = make_backend(config, model_path)
    import uvloop

    worker = EngineWorker(JOIN_ENGINE_ID, address, config, backend, curve=curve)

    async def main() -> int:
        # Not a child of any daemon: SIGTERM (a process manager, Ctrl-C) is how it stops.
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, worker.stop)
        return await worker.run()

    return uvloop.run(main())


def _gib_str(gib: float) -> str:
    return str(int(gib)) if float(gib).is_integer() else str(gib)
