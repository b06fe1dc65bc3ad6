"""Benchmark: one client queues a burst of small rollouts at once, without heartbeats.

Starts a daemon with simulated engines (in a child process: ``seer.cli.daemon.run_foreground``,
as ``seerctl start`` runs it) and, from one DEALER socket, sends ``--rollouts`` small
rollout requests at once (1 prompt x ``--group-size`` samples of at most ``--max-tokens``
tokens each) and never a heartbeat. While the burst drains it measures

* what came back: rollouts accepted, completed, refused or failed (by error code), lost
  (neither) and duplicated (a second ``RolloutCompleted``, or a group delivered twice), and
  every delivered group's samples (each sample index exactly once);
* ``status`` from a second socket, one call at a time every ``--status-every`` seconds:
  its latency p50 / max (a call unanswered for ``--status-timeout`` counts as that long);
* the next client: ``--next-after`` seconds after the burst was sent, a new
  ``AsyncSeerClient`` runs a one-prompt rollout; its wait from request to result;
* the control plane's worst loop stall (``control_plane_stopped.max_loop_lag_ms`` and the
  ``loop_stalled`` events), chunks timed out, engines marked unhealthy, clients declared
  lost, and the daemon's CPU time while the burst drained;
* the wall time from the first request sent to the last rollout ended.

The daemon runs the configuration a new user would write (``[engines] backend = "sim"``,
everything else default: policy ``context``, ``client_timeout_s`` 30 s), unless flags say
otherwise. Baseline: ``--python`` chooses the daemon's interpreter, so a checkout of another
commit can serve: ``--python`` names an interpreter that imports ``seer`` from that checkout
and runs both scripts and ``-m MODULE`` (the daemon's engines run under it too). Exits non-zero if a rollout was lost or duplicated.

    .venv/bin/python benchmarks/burst.py --rollouts 10000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import zmq
import zmq.asyncio

from seer.protocol import (
    ClientMessage,
    ErrorReply,
    GroupCompleted,
    Prompt,
    RolloutAccepted,
    RolloutCompleted,
    RolloutRequest,
    SamplingParams,
    ServerMessage,
    StatusReply,
    StatusRequest,
)
from seer.wire import Codec


def write_config(path: Path, *, engines: int, step_s: float, mean_output_tokens: int, policy: str | None,
                 client_timeout_s: float | None) -> Path:
    """A new user's sim-engine seer.toml: only what the flags set differs from the defaults."""
    lines = ["[engines]", 'backend = "sim"', f"count = {engines}", f"sim_step_s = {step_s}",
             f"sim_mean_output_tokens = {mean_output_tokens}"]
    if client_timeout_s is not None:
        lines += ["", "[server]", f"client_timeout_s = {client_timeout_s}"]
    if policy is not None:
        lines += ["", "[scheduler]", f'policy = "{policy}"']
    path.write_text("\n".join(lines) + "\n")
    return path


def serve(config_path: str, run_dir: str, python: str) -> int:
    """The daemon (child process): ``seerctl start --foreground`` without the CLI around it;
    its engines run under ``python`` too (the supervisor spawns ``sys.executable -m ...``)."""
    sys.executable = python
    from seer.cli.daemon import run_foreground
    from seer.config import default_cache_dir, load_config

    return run_foreground(load_config(config_path), Path(run_dir), default_cache_dir())


@dataclass
class Burst:
    accepted: set[str] = field(default_factory=set)
    completed: dict[str, int] = field(default_factory=dict)  # rollout id -> RolloutCompleted count
    groups: dict[str, int] = field(default_factory=dict)  # rollout id -> GroupCompleted count
    errors: dict[str, str] = field(default_factory=dict)  # rollout id -> error code
    bad_samples: int = 0
    last_end_s: float = 0.0

    def ended(self) -> int:
        return len(self.completed.keys() | self.errors.keys())


def memory_kib(pid: int) -> dict[str, int]:
    """VmRSS (now) and VmHWM (peak) of a process, in KiB."""
    fields: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            fields[name] = int(value.split()[0])
    return fields


def daemon_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def wait_ready(run_dir: Path, proc: subprocess.Popen, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the daemon exited ({proc.returncode}); see {run_dir}/daemon.out")
        try:
            info = json.loads((run_dir / "daemon.json").read_text())
        except (OSError, ValueError):
            info = {}
        if info.get("state") == "ready":
            return info
        await asyncio.sleep(0.1)
    raise SystemExit(f"the daemon was not ready within {timeout_s:.0f} s")


async def drive(address: str, pid: int, *, rollouts: int, group_size: int, max_tokens: int, status_every: float = 0.2,
                status_timeout: float = 30.0, next_after: float = 2.0, timeout: float = 300.0) -> dict:
    """Queue the burst, probe status and run the next client until every rollout ended (or
    ``timeout``); the figures (``main`` prints them; tests/integration/test_burst_intake.py
    asserts on them)."""
    from seer.client import AsyncSeerClient

    args = argparse.Namespace(rollouts=rollouts, group_size=group_size, max_tokens=max_tokens,
                              status_every=status_every, status_timeout=status_timeout, next_after=next_after,
                              timeout=timeout)

    ctx = zmq.asyncio.Context()
    burst_sock = ctx.socket(zmq.DEALER)
    burst_sock.setsockopt(zmq.SNDHWM, 0)
    burst_sock.setsockopt(zmq.RCVHWM, 0)
    burst_sock.connect(address)
    status_sock = ctx.socket(zmq.DEALER)
    status_sock.connect(address)
    encode, decode = Codec(ClientMessage).encode, Codec(ServerMessage).decode
    state = Burst()
    n = args.rollouts
    sampling = SamplingParams(max_tokens=args.max_tokens, seed=1)
    frames = [encode(RolloutRequest(call_id=f"c{i}", rollout_id=f"burst-{i}", prompts=[Prompt(prompt=f"p{i}")],
                                    group_size=args.group_size, sampling=sampling)) for i in range(n)]
    cpu0 = daemon_cpu_s(pid)
    t0 = time.monotonic()
    for f in frames:
        await burst_sock.send_multipart(f)
    sent_s = time.monotonic() - t0

    async def read_burst() -> None:
        while True:
            msg = decode(await burst_sock.recv_multipart())
            match msg:
                case RolloutAccepted(rollout_id=r):
                    state.accepted.add(r)
                case GroupCompleted(rollout_id=r, group=g):
                    state.groups[r] = state.groups.get(r, 0) + 1
                    if sorted(s.sample_index for s in g.samples) != list(range(args.group_size)) or any(
                            not s.token_ids or len(s.logprobs) != len(s.token_ids) for s in g.samples):
                        state.bad_samples += 1
                case RolloutCompleted(rollout_id=r):
                    state.completed[r] = state.completed.get(r, 0) + 1
                    state.last_end_s = time.monotonic() - t0
                case ErrorReply(call_id=c, code=code):
                    state.errors[f"burst-{c[1:]}"] = code
                    state.last_end_s = time.monotonic() - t0

    latencies: list[float] = []
    in_scheduler: list[int] = []  # rollouts the daemon's status lists (those in its scheduler), per call

    async def probe_status() -> None:
        k = 0
        while True:
            k += 1
            call_id = f"s{k}"
            t = time.monotonic()
            await status_sock.send_multipart(encode(StatusRequest(call_id=call_id)))
            while True:
                left = args.status_timeout - (time.monotonic() - t)
                if left <= 0 or not await status_sock.poll(left * 1000):
                    latencies.append(args.status_timeout)  # unanswered: counted at the timeout
                    break
                reply = decode(await status_sock.recv_multipart())
                if isinstance(reply, StatusReply) and reply.call_id == call_id:
                    latencies.append(time.monotonic() - t)
                    in_scheduler.append(len(reply.status.rollouts))
                    break
            await asyncio.sleep(args.status_every)

    next_wait: dict[str, object] = {}

    async def next_client() -> None:
        await asyncio.sleep(args.next_after)
        t = time.monotonic()
        try:
            async with AsyncSeerClient(address, timeout_s=args.timeout) as client:
                result = await client.rollout(["the next client"], 1, SamplingParams(max_tokens=args.max_tokens))
            next_wait["s"] = time.monotonic() - t
            next_wait["ok"] = len(result.groups) == 1
        except Exception as exc:  # noqa: BLE001 - reported in the table
            next_wait["s"] = time.monotonic() - t
            next_wait["error"] = f"{type(exc).__name__}: {exc}"[:200]

    tasks = [asyncio.create_task(c) for c in (read_burst(), probe_status(), next_client())]
    deadline = t0 + args.timeout
    while time.monotonic() < deadline and (state.ended() < n or "s" not in next_wait):
        await asyncio.sleep(0.1)
    drain_s = time.monotonic() - t0
    cpu_s = daemon_cpu_s(pid) - cpu0
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    if "s" not in next_wait and time.monotonic() - t0 > args.next_after:
        next_wait.update(s=time.monotonic() - t0 - args.next_after, error="not served before the burst's timeout")
    for sock in (burst_sock, status_sock):
        sock.close(0)
    ctx.term()
    duplicated = sum(c - 1 for c in state.completed.values() if c > 1) + sum(
        g - 1 for g in state.groups.values() if g > 1)
    codes: dict[str, int] = {}
    for code in state.errors.values():
        codes[code] = codes.get(code, 0) + 1
    return {
        "queued": n, "sent_s": sent_s, "accepted": len(state.accepted), "completed": len(state.completed),
        "errors": codes, "lost": n - state.ended(), "duplicated": duplicated, "bad_samples": state.bad_samples,
        "status_calls": len(latencies), "max_in_scheduler": max(in_scheduler, default=0),
        "status_p50_ms": 1000 * statistics.median(latencies) if latencies else None,
        "status_max_ms": 1000 * max(latencies) if latencies else None,
        "next_client_s": next_wait.get("s"), "next_client_ok": next_wait.get("ok", False),
        "next_client_error": next_wait.get("error"),
        "wall_s": state.last_end_s if state.ended() == n else drain_s, "daemon_cpu_s": cpu_s,
    }


def log_figures(log_file: Path) -> dict:
    events: dict[str, int] = {}
    stalled_max = 0
    stopped_max = None
    for line in log_file.read_text().splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        name = event.get("event")
        events[name] = events.get(name, 0) + 1
        if name == "loop_stalled":
            stalled_max = max(stalled_max, event.get("stall_ms", 0))
        elif name == "control_plane_stopped":
            stopped_max = event.get("max_loop_lag_ms")
    # The larger of the two: before the stall log (controlplane/loopwatch.py) the stop event's
    # figure was the ticker's lateness only, blind to stalls inside the tick itself.
    return {"worst_stall_ms": max(stopped_max or 0, stalled_max),
            "stall_logged_max_ms": stalled_max, "stopped_cleanly": stopped_max is not None,
            **{k: events.get(k, 0) for k in ("chunk_timed_out", "engine_unhealthy", "client_lost", "rollout_failed",
                                             "loop_stalled")}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rollouts", type=int, default=10_000, help="rollout requests queued at once")
    parser.add_argument("--group-size", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--mean-output-tokens", type=int, default=4)
    parser.add_argument("--engines", type=int, default=2)
    parser.add_argument("--step-s", type=float, default=0.002, help="sim engine seconds per decode step")
    parser.add_argument("--policy", default=None, help="default: the daemon's default policy")
    parser.add_argument("--client-timeout", type=float, default=None, help="server.client_timeout_s (default: 30)")
    parser.add_argument("--status-every", type=float, default=0.2)
    parser.add_argument("--status-timeout", type=float, default=30.0)
    parser.add_argument("--next-after", type=float, default=2.0, help="seconds after the burst; the next client")
    parser.add_argument("--timeout", type=float, default=300.0, help="give up on the burst after this long")
    parser.add_argument("--python", default=sys.executable,
                        help="the daemon's and its engines' interpreter (it must run `-m MODULE` too)")
    parser.add_argument("--label", default="")
    parser.add_argument("--keep-log", default=None, help="copy the daemon's controlplane.log here")
    parser.add_argument("--serve", nargs=3, metavar=("CONFIG", "RUN_DIR", "PYTHON"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        return serve(*args.serve)

    with tempfile.TemporaryDirectory(prefix="seer-burst-") as tmp:
        run_dir = Path(tmp) / "run"
        run_dir.mkdir()
        config = write_config(Path(tmp) / "burst.toml", engines=args.engines, step_s=args.step_s,
                              mean_output_tokens=args.mean_output_tokens, policy=args.policy,
                              client_timeout_s=args.client_timeout)
        with open(run_dir / "daemon.out", "wb") as out:
            proc = subprocess.Popen([args.python, os.path.abspath(__file__), "--serve", str(config), str(run_dir),
                                     args.python],
                                    stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env={**os.environ, "PYTHONMALLOC": "malloc"}, start_new_session=True)
        try:
            info = asyncio.run(wait_ready(run_dir, proc, 120.0))
            figures = asyncio.run(drive(info["client_address"], proc.pid, rollouts=args.rollouts,
                                        group_size=args.group_size, max_tokens=args.max_tokens,
                                        status_every=args.status_every, status_timeout=args.status_timeout,
                                        next_after=args.next_after, timeout=args.timeout))
            figures["daemon_peak_rss_mib"] = memory_kib(proc.pid)["VmHWM"] / 1024
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(120)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        figures.update(log_figures(run_dir / "controlplane.log"))
        if args.keep_log:
            import shutil

            shutil.copy(run_dir / "controlplane.log", args.keep_log)
    figures["label"] = args.label
    show(figures)
    print(json.dumps(figures))
    return 1 if figures["lost"] or figures["duplicated"] or figures["bad_samples"] else 0


def show(f: dict) -> None:
    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v:.0f}"

    nxt = "-" if f["next_client_s"] is None else f"{f['next_client_s']:.1f}" + (" (failed)" if f[
        "next_client_error"] else "")
    rows = [
        ("rollouts queued", f["queued"]),
        ("accepted", f["accepted"]),
        ("completed", f["completed"]),
        ("refused / failed", ", ".join(f"{k} {v}" for k, v in f["errors"].items()) or "0"),
        ("lost / duplicated", f"{f['lost']} / {f['duplicated']}"),
        ("status p50 / max ms (calls)", f"{ms(f['status_p50_ms'])} / {ms(f['status_max_ms'])} ({f['status_calls']})"),
        ("most rollouts in the scheduler", f["max_in_scheduler"]),
        ("next client's wait s", nxt),
        ("loop's worst stall ms", f"{f['worst_stall_ms']}" + ("" if f["stopped_cleanly"] else " (no clean stop)")),
        ("chunks timed out / unhealthy", f"{f['chunk_timed_out']} / {f['engine_unhealthy']}"),
        ("clients lost (rollouts)", f["client_lost"]),
        ("wall s (daemon CPU s)", f"{f['wall_s']:.1f} ({f['daemon_cpu_s']:.1f})"),
        ("daemon peak RSS MiB", f"{f['daemon_peak_rss_mib']:.0f}"),
    ]
    print(f"burst {f['label']}".rstrip())
    for name, value in rows:
        print(f"  {name:<30} {value}")


if __name__ == "__main__":
    sys.exit(main())
