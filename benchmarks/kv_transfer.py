"""KV blocks between hosts' pools: ``pull_blocks`` over ucx and tcp against the raw
limits of the same machine, in the same run (issue 5).

For each size (tokens of SmolLM2-135M float32 KV at block size 32, 1.41 MiB a block, and
~64 MiB) and each path -- ``loopback`` (two processes in one network namespace) and
``netns`` (two namespaces joined by veth, created here; needs root) -- a *serve* process
holds a pool with sealed blocks and serves it four ways (BlockServer ucx, BlockServer
tcp, a plain ucxx tag send, a plain socket send), and a *pull* process times:

* ``memcpy``: one-thread copy of the same bytes into its pre-faulted pool (the floor),
* ``raw ucxx``: a plain ucxx send/recv of the same bytes (same UCX setup as the pull:
  worker-address endpoints, blocking progress, shared memory excluded across hosts),
* ``raw socket``: a plain TCP send/recv of the same bytes,
* ``pull ucx`` / ``pull tcp``: ``pull_blocks`` with verification (tag checks,
  checksum of every received block, seal), and its median with ``verify=False``.

Ratios are medians against the raw path of the same transport. Blocks are pulled as one
contiguous run (``--scatter`` pulls every other block instead, runs of one block).

    .venv/bin/python benchmarks/kv_transfer.py --repeats 5
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import socket
import statistics
import struct
import subprocess
import sys
import threading
import time

import numpy as np
import structlog

from seer.protocol import PoolGeometry
from seer.dataplane.kvpool import KVPoolSegment

SMOLLM2 = PoolGeometry(num_layers=30, num_kv_heads=3, head_size=64, block_size=32, dtype="float32")
KEY, VERSION = 77, 1
RAW_REQUEST_TAG = 3  # the raw ucxx responder's request tag (the block server uses 1)


def size_blocks(spec: str) -> tuple[str, int]:
    """"2048" tokens or "64MiB" -> (label, number of blocks)."""
    if spec.lower().endswith("mib"):
        n = max(1, round(float(spec[:-3]) * (1 << 20) / SMOLLM2.bytes_per_block))
        return f"{spec} ({n} blocks)", n
    tokens = int(spec)
    return f"{tokens} tokens", -(-tokens // SMOLLM2.block_size)


def block_lists(num_blocks: int, scatter: bool) -> tuple[list[int], list[int]]:
    src = list(range(0, 2 * num_blocks, 2)) if scatter else list(range(num_blocks))
    return src, list(range(num_blocks))


# ---------------------------------------------------------------------------- serve


def serve(args: argparse.Namespace) -> None:
    from seer.dataplane.transfer import BlockServer
    from seer.dataplane.rdma import ucx as ucx_transport

    seg = KVPoolSegment.create(args.pool, SMOLLM2, args.num_blocks)
    try:
        rng = np.random.default_rng(0)
        for b in range(args.num_blocks):
            seg.blocks[b] = rng.integers(0, 256, seg.blocks[b].shape, dtype=np.uint8)
        # Sealed for the contiguous and the scattered layouts: block b is index b // step.
        step = 2 if args.scatter else 1
        for b in range(0, args.num_blocks, step):
            seg.seal([b], KEY, b // step, VERSION)
        servers = {t: BlockServer(seg, transport=t, bind_host=args.bind_host) for t in ("ucx", "tcp")}
        raw_tcp = socket.create_server((args.bind_host, 0))
        flat = seg.blocks.reshape(-1)
        stop = threading.Event()

        def raw_tcp_loop() -> None:
            while not stop.is_set():
                try:
                    conn, _ = raw_tcp.accept()
                except OSError:
                    return
                with conn:
                    while True:
                        head = conn.recv(8)
                        if len(head) < 8:
                            break
                        (n,) = struct.unpack("<Q", head)
                        conn.sendall(flat[:n])

        ucx_api, Array = ucx_transport.ucx_api, ucx_transport.Array
        w = ucx_transport._Worker(None)
        worker = w.worker
        raw_ucx_address = f"ucx:{ucx_transport.host_id()}:{w.address().hex()}"

        def raw_ucx_loop() -> None:
            endpoints: dict[bytes, object] = {}
            while not stop.is_set():
                frame = w.recv_message(RAW_REQUEST_TAG, float("inf"), stop)
                if frame is None:
                    return
                n, reply_tag = struct.unpack("<QQ", frame[:16])
                address = frame[16:]
                ep = endpoints.get(address)
                if ep is None:
                    ep = endpoints[address] = worker.create_endpoint_from_worker_address(
                        ucx_api.UCXAddress.create_from_buffer(address), False)
                send = ep.tag_send(Array(flat[:n]), ucx_api.UCXXTag(reply_tag))
                w.wait([send], time.monotonic() + 120, "raw send")

        threads = [threading.Thread(target=f, daemon=True) for f in (raw_tcp_loop, raw_ucx_loop)]
        for t in threads:
            t.start()
        print(json.dumps({"ucx": servers["ucx"].address, "tcp": servers["tcp"].address,
                          "raw_tcp": f"{args.bind_host}:{raw_tcp.getsockname()[1]}", "raw_ucx": raw_ucx_address}),
              flush=True)
        sys.stdin.read()  # until the orchestrator closes our stdin
        stop.set()
        raw_tcp.close()
        for s in servers.values():
            s.close()
        for t in threads:
            t.join(5)
    finally:
        seg.close()
        seg.unlink()


# ---------------------------------------------------------------------------- pull


def timed(fn, repeats: int) -> list[float]:
    fn()  # warm-up: connections, endpoints, first-touch
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def pull(args: argparse.Namespace) -> None:
    from seer.dataplane.transfer import pull_blocks
    from seer.dataplane.rdma import ucx as ucx_transport

    addresses = json.loads(args.addresses)
    seg = KVPoolSegment.create(args.pool, SMOLLM2, args.num_blocks)
    results = []
    try:
        flat = seg.blocks.reshape(-1)
        private = np.ones(args.num_blocks * SMOLLM2.bytes_per_block, dtype=np.uint8)  # pre-faulted
        raw_host, raw_port = addresses["raw_tcp"].rsplit(":", 1)
        raw_sock = socket.create_connection((raw_host, int(raw_port)), timeout=120)
        server_host, _ = ucx_transport.parse_address(addresses["raw_ucx"])
        remote = server_host != ucx_transport.host_id()
        w = ucx_transport._Worker(ucx_transport._REMOTE_CONFIG if remote else None)
        worker = w.worker
        ucx_api, Array = ucx_transport.ucx_api, ucx_transport.Array
        raw_ep = worker.create_endpoint_from_worker_address(
            ucx_api.UCXAddress.create_from_buffer(ucx_transport.parse_address(addresses["raw_ucx"])[1]), False)
        my_address = w.address()
        seq = [0]

        for spec in args.sizes.split(","):
            label, n_blocks = size_blocks(spec)
            n_bytes = n_blocks * SMOLLM2.bytes_per_block
            src_blocks, dst_blocks = block_lists(n_blocks, args.scatter)
            view = flat[:n_bytes]

            def memcpy() -> None:
                np.copyto(view, private[:n_bytes])

            def raw_tcp() -> None:
                raw_sock.sendall(struct.pack("<Q", n_bytes))
                mv = memoryview(view)
                while len(mv):
                    k = raw_sock.recv_into(mv)
                    if k == 0:
                        raise ConnectionError("raw tcp server closed")
                    mv = mv[k:]

            def raw_ucx() -> None:
                seq[0] += 1
                tag = (1 << 62) | seq[0]
                recv = worker.tag_recv(Array(view), ucx_api.UCXXTag(tag))
                req = np.frombuffer(struct.pack("<QQ", n_bytes, tag) + my_address, dtype=np.uint8).copy()
                send = raw_ep.tag_send(Array(req), ucx_api.UCXXTag(RAW_REQUEST_TAG))
                w.wait([send, recv], time.monotonic() + 120, "raw ucx")

            def pull_with(transport: str, verify: bool):
                def run() -> None:
                    r = pull_blocks(transport, addresses[transport], src_blocks, seg, dst_blocks, key=KEY,
                                    weights_version=VERSION, verify=verify, timeout_s=120)
                    if not r.ok:
                        raise RuntimeError(f"pull failed: {r.error}")
                return run

            row = {"size": label, "bytes": n_bytes}
            for name, fn in [("memcpy", memcpy), ("raw ucxx", raw_ucx), ("pull ucx", pull_with("ucx", True)),
                             ("pull ucx noverify", pull_with("ucx", False)), ("raw socket", raw_tcp),
                             ("pull tcp", pull_with("tcp", True)), ("pull tcp noverify", pull_with("tcp", False))]:
                row[name] = timed(fn, args.repeats)
            results.append(row)
        raw_sock.close()
    finally:
        seg.close()
        seg.unlink()
    print(json.dumps(results), flush=True)


# ---------------------------------------------------------------------------- orchestrate


def run_path(path: str, args: argparse.Namespace, num_blocks: int) -> list[dict]:
    prefixes: tuple[list[str], list[str]] = ([], [])
    bind_host = "127.0.0.1"
    pair = None
    if path == "netns":
        from seer.dataplane.netns import NetnsPair

        pair = NetnsPair()
        prefixes = (pair.prefix(0), pair.prefix(1))
        bind_host = pair.addresses[0]
    tag = f"{os.getpid()}-{secrets.token_hex(3)}"
    common = ["--num-blocks", str(num_blocks), "--sizes", args.sizes, "--repeats", str(args.repeats)]
    if args.scatter:
        common.append("--scatter")
    server = subprocess.Popen([*prefixes[0], sys.executable, __file__, "_serve", "--pool", f"seerbench-src-{tag}",
                               "--bind-host", bind_host, *common], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    try:
        addresses = server.stdout.readline()
        if not addresses:
            raise RuntimeError("the serve process failed to start")
        out = subprocess.run([*prefixes[1], sys.executable, __file__, "_pull", "--pool", f"seerbench-dst-{tag}",
                              "--addresses", addresses.strip(), *common], capture_output=True, text=True,
                             timeout=3600)
        if out.returncode != 0:
            raise RuntimeError(f"the pull process failed:\n{out.stderr[-3000:]}")
        return json.loads(out.stdout.strip().splitlines()[-1])
    finally:
        server.stdin.close()
        server.wait(60)
        if pair is not None:
            pair.close()


def report(path: str, rows: list[dict]) -> None:
    raw_of = {"pull ucx": "raw ucxx", "pull tcp": "raw socket"}
    print(f"\n### {path}\n")
    print("| size | method | GB/s best | GB/s median | ms median | vs raw (median) | vs memcpy | "
          "verify off: GB/s median |")
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        n = row["bytes"]

        def gbs(times: list[float]) -> tuple[float, float]:
            return n / min(times) / 1e9, n / statistics.median(times) / 1e9

        memcpy_med = gbs(row["memcpy"])[1]
        for method in ("memcpy", "raw ucxx", "pull ucx", "raw socket", "pull tcp"):
            best, med = gbs(row[method])
            raw = raw_of.get(method)
            vs_raw = f"{med / gbs(row[raw])[1]:.2f}x" if raw else "-"
            noverify = f"{gbs(row[method + ' noverify'])[1]:.2f}" if method.startswith("pull") else "-"
            print(f"| {row['size']} | {method} | {best:.2f} | {med:.2f} | "
                  f"{statistics.median(row[method]) * 1000:.1f} | {vs_raw} | {med / memcpy_med:.2f}x | {noverify} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("role", nargs="?", default="run", choices=["run", "_serve", "_pull"])
    p.add_argument("--sizes", default="32,2048,8192,64MiB", help="tokens, or NMiB; comma-separated")
    p.add_argument("--paths", default="loopback,netns")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--scatter", action="store_true", help="pull every other source block (runs of one block)")
    p.add_argument("--pool", default="")
    p.add_argument("--bind-host", default="127.0.0.1")
    p.add_argument("--addresses", default="")
    p.add_argument("--num-blocks", type=int, default=0)
    args = p.parse_args()
    # stdout carries the JSON results between processes; logs go to stderr.
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))
    if args.role == "_serve":
        return serve(args)
    if args.role == "_pull":
        return pull(args)
    num_blocks = max(size_blocks(s)[1] for s in args.sizes.split(",")) * (2 if args.scatter else 1)
    print(f"geometry {SMOLLM2.fingerprint}, {SMOLLM2.bytes_per_block / (1 << 20):.2f} MiB a block; "
          f"{args.repeats} repeats after one warm-up; {'scattered' if args.scatter else 'contiguous'} blocks")
    for path in args.paths.split(","):
        load_before = os.getloadavg()[0]
        rows = run_path(path, args, num_blocks)
        report(path, rows)
        # The machine is shared: say how busy it was (2 cores; above 2, timings inflate).
        print(f"\nload average (1 min) {load_before:.1f} before, {os.getloadavg()[0]:.1f} after this path")


if __name__ == "__main__":
    main()
