"""Benchmark: the grouped draft server (dataplane/draft_server.py) between two engine
processes -- how long an append takes to become draftable on the other engine, how many
tokens per second cross, and what ``DraftClient.sync()`` costs an engine step.

Three processes: the draft server (``python -m seer.dataplane.draft_server``), engine 0
(a spawned process that appends) and engine 1 (this process, which receives). Times are
``time.perf_counter_ns`` (CLOCK_MONOTONIC on Linux, the same clock in every process).

1. **Latency**: engine 0 appends ``--tokens-per-append`` tokens of one sample and calls
   ``sync()`` every ``--interval-ms`` (an engine step); engine 1 calls ``sync()`` every
   ``--poll-ms`` and notes when each append has been applied to its store. Latency =
   applied on engine 1 - start of engine 0's ``append``.
2. **Throughput**: engine 0 appends ``--batch`` samples x 8 tokens per step as fast as
   it can (a decode step of a big batch, no model) for ``--throughput-tokens`` tokens;
   tokens/s = all tokens applied on engine 1 / (last applied - first appended). This
   includes engine 1 indexing every token into its ``DraftStore``.
3. **Server CPU** per token it received and forwarded (from /proc, both phases).
4. **sync() cost**: idle (connected, nothing queued or arriving; and local-only), and
   busy: engine 0's ``sync()`` while it sends a step of ``--batch`` appends (wall time,
   and the thread's CPU time, which other processes' load does not inflate), engine 1's
   while it applies what arrived (per call and per token), from the throughput phase.

    .venv/bin/python benchmarks/draft_server.py
    .venv/bin/python benchmarks/draft_server.py --json runs/draft-server-bench.json
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import structlog


def _quiet() -> None:
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))


def _connect(run_dir: str, engine_id: int, max_pattern_tokens: int):
    from seer.dataplane.draft_client import DraftClient
    from seer.dataplane.drafts import DraftStoreConfig

    client = DraftClient(run_dir, engine_id, DraftStoreConfig(max_pattern_tokens=max_pattern_tokens),
                         connect_interval_s=0.05)
    deadline = time.monotonic() + 60
    while not client.connected:
        if time.monotonic() > deadline:
            raise SystemExit(f"engine {engine_id} could not connect to the draft server")
        time.sleep(0.05)
        client.sync()
    return client


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def producer(run_dir: str, args: dict, ready, go_latency, go_throughput, results) -> None:
    """Engine 0: appends, and reports send times and its sync() costs."""
    _quiet()
    client = _connect(run_dir, 0, args["max_pattern_tokens"])
    client.register_group("lat", 0, [1, 2, 3])
    client.register_group("tp", 0, [1, 2, 3])
    client.sync()
    ready.set()
    go_latency.wait(120)
    k = args["tokens_per_append"]
    sent_ns = []
    for i in range(args["messages"]):
        sent_ns.append(time.perf_counter_ns())
        client.append("lat", "lat/0", i * k, [i % 30000] * k)
        client.sync()
        time.sleep(args["interval_ms"] / 1000)
    go_throughput.wait(120)
    batch = args["batch"]
    steps = max(1, args["throughput_tokens"] // (batch * 8))
    sync_ns, sync_cpu_ns = [], []
    first_ns = time.perf_counter_ns()
    for step in range(steps):
        for r in range(batch):
            client.append("tp", f"tp/{r}", step * 8, [(step * 8 + j + r) % 30000 for j in range(8)])
        t0, c0 = time.perf_counter_ns(), time.thread_time_ns()
        client.sync()
        sync_ns.append(time.perf_counter_ns() - t0)
        sync_cpu_ns.append(time.thread_time_ns() - c0)  # CPU only: shows preemption in the wall time
    while client._outbox:  # the ring may be full: keep flushing (nothing is dropped)
        time.sleep(0.0005)
        client.sync()
    results.put({"sent_ns": sent_ns, "first_ns": first_ns, "steps": steps, "sync_send_ns": sync_ns,
                 "sync_send_cpu_ns": sync_cpu_ns})
    client.close()


def consumer(client, args: dict, go_latency, go_throughput, producer_results) -> dict:
    k = args["tokens_per_append"]
    poll_s = args["poll_ms"] / 1000
    client.register_group("lat", 0, [1, 2, 3])
    client.register_group("tp", 0, [1, 2, 3])
    client.sync()
    time.sleep(0.5)  # let the server take the registrations before engine 0 starts
    # Latency: note when each append has been applied here.
    base = client.num_tokens_received
    seen_ns = []
    go_latency.set()
    deadline = time.monotonic() + 300
    while len(seen_ns) < args["messages"] and time.monotonic() < deadline:
        client.sync()
        now = time.perf_counter_ns()
        done = (client.num_tokens_received - base) // k
        seen_ns.extend([now] * (done - len(seen_ns)))
        time.sleep(poll_s)
    # Throughput.
    base = client.num_tokens_received
    total = max(1, args["throughput_tokens"] // (args["batch"] * 8)) * args["batch"] * 8
    busy_ns, busy_tokens = [], []
    go_throughput.set()
    last_ns = 0
    deadline = time.monotonic() + 300
    while client.num_tokens_received - base < total and time.monotonic() < deadline:
        before = client.num_tokens_received
        t0 = time.perf_counter_ns()
        client.sync()
        t1 = time.perf_counter_ns()
        if client.num_tokens_received > before:
            busy_ns.append(t1 - t0)
            busy_tokens.append(client.num_tokens_received - before)
            last_ns = t1
        else:
            time.sleep(poll_s)
    got = client.num_tokens_received - base
    prod = producer_results.get(timeout=120)
    lat_ms = [(s - t) / 1e6 for s, t in zip(seen_ns, prod["sent_ns"])]
    return {
        "latency_ms": {"n": len(lat_ms), "p50": _pct(lat_ms, 0.5), "p99": _pct(lat_ms, 0.99), "max": max(lat_ms)},
        "throughput": {"tokens": got, "expected": total,
                       "tokens_per_s": got / max(1e-9, (last_ns - prod["first_ns"]) / 1e9)},
        "sync_send_us": {"p50": _pct(prod["sync_send_ns"], 0.5) / 1e3, "p99": _pct(prod["sync_send_ns"], 0.99) / 1e3,
                         "cpu_p50": _pct(prod["sync_send_cpu_ns"], 0.5) / 1e3,
                         "cpu_p99": _pct(prod["sync_send_cpu_ns"], 0.99) / 1e3,
                         "appends_per_sync": args["batch"]},
        "sync_receive_us": {"p50": _pct(busy_ns, 0.5) / 1e3, "p99": _pct(busy_ns, 0.99) / 1e3,
                            "tokens_per_call_p50": statistics.median(busy_tokens),
                            "us_per_token": sum(busy_ns) / 1e3 / max(1, sum(busy_tokens))},
    }


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def idle_sync_us(client, calls: int) -> float:
    best = float("inf")
    for _ in range(5):  # best of 5: other work on the machine only adds time
        t0 = time.perf_counter_ns()
        for _ in range(calls):
            client.sync()
        best = min(best, (time.perf_counter_ns() - t0) / calls / 1e3)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=500)
    parser.add_argument("--tokens-per-append", type=int, default=8)
    parser.add_argument("--interval-ms", type=float, default=10.0)
    parser.add_argument("--poll-ms", type=float, default=1.0)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--throughput-tokens", type=int, default=200_000)
    parser.add_argument("--max-pattern-tokens", type=int, default=8, help="receiver's DraftStore index depth")
    parser.add_argument("--ring-bytes", type=int, default=4 << 20)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    _quiet()
    from seer.dataplane.draft_client import DraftClient

    opts = vars(args).copy()
    opts.pop("json")
    with tempfile.TemporaryDirectory(prefix="seer-draft-bench-") as run_dir:
        server = subprocess.Popen([sys.executable, "-m", "seer.dataplane.draft_server", "--dir", run_dir,
                                   "--ring-bytes", str(args.ring_bytes), "--scan-interval-s", "0.05",
                                   "--log-file", os.path.join(run_dir, "draft-server.log")],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 60
            while not os.path.exists(os.path.join(run_dir, "draft-server.json")):
                if time.monotonic() > deadline or server.poll() is not None:
                    raise SystemExit("the draft server did not start")
                time.sleep(0.05)
            ctx = multiprocessing.get_context("spawn")
            ready, go_latency, go_throughput = ctx.Event(), ctx.Event(), ctx.Event()
            results = ctx.Queue()
            proc = ctx.Process(target=producer, args=(run_dir, opts, ready, go_latency, go_throughput, results))
            proc.start()
            client = _connect(run_dir, 1, args.max_pattern_tokens)
            if not ready.wait(120):
                raise SystemExit("engine 0 did not start")
            cpu_before = cpu_seconds(server.pid)
            out = consumer(client, opts, go_latency, go_throughput, results)
            proc.join(timeout=120)
            # The server's own cost per token it received (and forwarded once), both phases.
            tokens = args.messages * args.tokens_per_append + out["throughput"]["tokens"]
            out["server_cpu_us_per_token"] = (cpu_seconds(server.pid) - cpu_before) * 1e6 / tokens
            out["sync_idle_us"] = idle_sync_us(client, 20_000)
            client.close()
        finally:
            server.terminate()
            server.wait(timeout=30)
    local = DraftClient(None, 0)
    local.register_group("g", 0, [1])
    out["sync_idle_local_us"] = idle_sync_us(local, 20_000)
    out["args"] = opts
    out["loadavg_1m"] = os.getloadavg()[0]
    print(json.dumps(out, indent=2))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=2))
    if out["throughput"]["tokens"] != out["throughput"]["expected"] or out["latency_ms"]["n"] != args.messages:
        raise SystemExit("tokens missing on engine 1 (lost, or the machine too slow for the deadlines)")


if __name__ == "__main__":
    main()
