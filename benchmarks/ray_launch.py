"""Benchmark: what placing engines on Ray costs at `seerctl start` and `seerctl stop`.

Starts a private Ray cluster in this process (``ray.init(num_cpus=...)``, the same as
a one-node `ray start --head`), then times `seerctl start` (until every engine is
ready) and `seerctl stop` with simulated engines, alternating the local launcher (the
baseline) and the Ray launcher, ``--repeats`` times each. Engines join over CURVE TCP
in both cases, so the launcher is the only difference. Prints medians and the ratio to
the local launcher measured in the same run.

    .venv/bin/python benchmarks/ray_launch.py --engines 2 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SEERCTL = [sys.executable, "-m", "seer.cli.main"]


def seerctl(*args: str) -> float:
    started = time.monotonic()
    proc = subprocess.run([*SEERCTL, *args], capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise SystemExit(f"seerctl {' '.join(args)} failed:\n{proc.stderr}{proc.stdout}")
    return time.monotonic() - started


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def config(root: Path, launcher: str, engines: int, address: str) -> Path:
    keys = root / "keys"
    if not keys.exists():
        subprocess.run([*SEERCTL, "keys", str(keys)], check=True, capture_output=True)
    path = root / f"{launcher}.toml"
    path.write_text(f"""
[engines]
backend = "sim"
count = {engines}

[server]
client_address = "tcp://127.0.0.1:{free_port()}"
engine_address = "tcp://127.0.0.1:{free_port()}"
curve_server_secret_key = "keys/server.key_secret"
curve_authorized_keys = "keys/authorized"
curve_server_public_key = "keys/server.key"
curve_client_secret_key = "keys/client.key_secret"

[cluster]
launcher = "{launcher}"
address = "{address}"
""")
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--engines", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    import ray

    t0 = time.monotonic()
    os.environ.setdefault("RAY_memory_monitor_refresh_ms", "0")  # see tests/integration/test_ray_launcher.py
    ray_dir = tempfile.mkdtemp(prefix="seer-ray-", dir="/tmp")  # short: Ray's Unix sockets live under it
    context = ray.init(num_cpus=args.engines + 1, include_dashboard=False, logging_level="warning",
                       log_to_driver=False, _temp_dir=ray_dir)
    cluster_s = time.monotonic() - t0
    address = context.address_info["gcs_address"]
    times: dict[str, dict[str, list[float]]] = {k: {"start": [], "stop": []} for k in ("local", "ray")}
    with tempfile.TemporaryDirectory(prefix="seer-raybench-") as tmp:
        root = Path(tmp)
        for i in range(args.repeats):
            for launcher in ("local", "ray"):
                run_dir = root / f"run-{launcher}-{i}"
                cfg = config(root, launcher, args.engines, address)
                times[launcher]["start"].append(seerctl("start", "--config", str(cfg), "--run-dir", str(run_dir)))
                times[launcher]["stop"].append(seerctl("stop", "--run-dir", str(run_dir)))
    ray.shutdown()
    shutil.rmtree(ray_dir, ignore_errors=True)
    base = {k: statistics.median(v) for k, v in times["local"].items()}
    print(f"Ray cluster start (ray.init, {args.engines + 1} CPUs, this process): {cluster_s:.1f} s")
    print(f"{'launcher':<10}{'start s':>10}{'ratio':>8}{'stop s':>10}{'ratio':>8}")
    for launcher, t in times.items():
        start, stop = statistics.median(t["start"]), statistics.median(t["stop"])
        print(f"{launcher:<10}{start:>10.2f}{start / base['start']:>8.2f}{stop:>10.2f}{stop / base['stop']:>8.2f}")
    print(json.dumps({"engines": args.engines, "repeats": args.repeats, "times": times}))


if __name__ == "__main__":
    main()
