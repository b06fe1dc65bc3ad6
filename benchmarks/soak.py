"""Soak benchmark: many samples through simulated engines while engines die and clients come and go.

Starts one daemon with ``--engines`` simulated engines (and ``engines.replacement_wait_s``
so a moment without engines is survivable), then, until ``--samples`` samples have come
back:

* ``--clients`` client workers run rollouts back to back (``--prompts`` x ``--group-size``,
  max ``--max-tokens`` tokens), each on a fresh client socket that is closed afterwards;
  every ``--leave-every``-th rollout its client walks away after a few groups (the daemon
  must cancel it: client_lost / cancel), the others are checked: every group and sample
  exactly once, in its place (``load.sample_problems``);
* a killer sends SIGKILL to a random ready engine every ``--kill-every-s`` (+- 50 %) while
  at least two are ready, and starts a replacement with ``seerctl engine --join``.

Reports samples checked, samples lost or duplicated (must be 0), kills, the control
plane's RSS, the loop's worst stall (``control_plane_stopped.max_loop_lag_ms``) and every
error event in the control-plane log other than the expected ``engine_lost``. Exits
non-zero on any loss, duplicate, failed call or unexpected error event, or if the RSS grew
by ``--max-growth`` % or more.

RSS is read every second. While rollouts run it is a sawtooth, not a level: the rollouts
in flight, and the ended ones the daemon has not collected yet (it collects after every
``RELEASE_MIN_SAMPLES`` ended samples, controlplane/memory.py), swing it by ~20 MiB
within seconds, so one reading against another says little. Growth is the highest RSS
in the last ``--window`` of the samples against the highest in the same share right
after warm-up (``--warmup``); the single readings at those two points are printed too. At
the end, with every client gone and the daemon idle, the RSS it settles to is printed.

    .venv/bin/python benchmarks/soak.py --samples 1000000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from seer.client import AsyncSeerClient, SamplingParams, SeerClient, SeerError
from seer.controlplane.loopwatch import STALL_LOGGED_S

sys.path.insert(0, str(Path(__file__).resolve().parent))
from load import memory_kib, sample_problems  # noqa: E402  (the same checks as the load benchmark)

EXPECTED_ERRORS = {"engine_lost"}


def write_config(path: Path, *, engines: int, step_s: float, mean_output_tokens: int, policy: str) -> Path:
    path.write_text(
        "[engines]\n"
        f'backend = "sim"\ncount = {engines}\nsim_step_s = {step_s}\n'
        f"sim_mean_output_tokens = {mean_output_tokens}\nheartbeat_timeout_s = 10.0\n"
        "replacement_wait_s = 60.0\n"
        # Generous: a client process starved for seconds on a loaded machine is not gone
        # (its rollout would be cancelled, and the benchmark would count it as lost).
        "\n[server]\nclient_timeout_s = 60.0\nmax_group_size = 64\n"
        f'\n[scheduler]\npolicy = "{policy}"\nchunk_size_tokens = 8\n'
        "\n[model]\nmax_model_len = 512\n"
        '\n[logging]\nlevel = "info"\n'
    )
    return path


@dataclass
class Tally:
    num_samples: int = 0  # checked: came back exactly once
    num_rollouts: int = 0
    num_left: int = 0  # rollouts whose client walked away
    problems: list[str] = field(default_factory=list)
    num_kills: int = 0
    rss_after_warmup_kib: int = 0
    rss: list[tuple[int, int]] = field(default_factory=list)  # (samples checked, RSS KiB), one a second
    lock: threading.Lock = field(default_factory=threading.Lock)


async def client_worker(address: str, worker: int, args: argparse.Namespace, tally: Tally, stop: asyncio.Event) -> None:
    k = 0
    while not stop.is_set():
        k += 1
        prompts = [f"w{worker} r{k} p{i}" for i in range(args.prompts)]
        sampling = SamplingParams(max_tokens=args.max_tokens, seed=worker * 100_000 + k)
        try:
            async with AsyncSeerClient(address, timeout_s=args.timeout) as client:
                if args.leave_every and k % args.leave_every == 0:
                    seen = 0
                    async for _group in client.stream_rollout(prompts, args.group_size, sampling):
                        seen += 1
                        if seen >= 2:
                            break  # the client leaves mid-rollout; closing the socket drops it
                    with tally.lock:
                        tally.num_left += 1
                    continue
                result = await client.rollout(prompts, args.group_size, sampling, timeout_s=args.timeout)
        except SeerError as exc:
            with tally.lock:
                tally.problems.append(f"worker {worker} rollout {k}: {type(exc).__name__}: {exc}")
            continue
        problems = sample_problems(result, args.prompts, args.group_size)
        with tally.lock:
            tally.problems += problems
            tally.num_samples += sum(len(g.samples) for g in result.groups) if not problems else 0
            tally.num_rollouts += 1


def killer(address: str, engine_address: str, config: Path, run_dir: Path, args: argparse.Namespace, tally: Tally,
           stop: threading.Event, joiners: list[subprocess.Popen]) -> None:
    rng = random.Random(args.seed)
    with SeerClient(address, timeout_s=60) as client:
        while not stop.wait(args.kill_every_s * rng.uniform(0.5, 1.5)):
            for proc in joiners:
                proc.poll()  # reap the ones killed: a zombie must not be "killed" again
            ready = [e for e in client.status().engines if e.state == "ready" and _alive(e.pid)]
            if len(ready) < 2:
                continue
            victim = rng.choice(ready)
            try:
                os.kill(victim.pid, signal.SIGKILL)
            except ProcessLookupError:
                continue
            tally.num_kills += 1
            log = run_dir / f"joined-{len(joiners)}.log"
            joiners.append(subprocess.Popen(
                [sys.executable, "-m", "seer.cli.main", "engine", "--join", engine_address, "--config", str(config),
                 "--log-file", str(log)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                start_new_session=True))


def _alive(pid: int) -> bool:
    """A running process (not a zombie, not gone)."""
    try:
        return pid > 0 and Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def events(log_file: Path) -> list[dict]:
    out = []
    for line in log_file.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=1_000_000)
    parser.add_argument("--engines", type=int, default=3)
    parser.add_argument("--policy", default="divided")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=250, help="prompts per rollout")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--mean-output-tokens", type=int, default=8)
    parser.add_argument("--step-s", type=float, default=0.001, help="sim engine seconds per decode step")
    parser.add_argument("--kill-every-s", type=float, default=4.0)
    parser.add_argument("--leave-every", type=int, default=5, help="every N-th rollout's client leaves early (0: never)")
    parser.add_argument("--warmup", type=float, default=0.1, help="fraction of --samples before the RSS baseline")
    parser.add_argument("--window", type=float, default=0.2,
                        help="fraction of --samples whose highest RSS is compared (after warm-up, at the end)")
    parser.add_argument("--max-growth", type=float, default=5.0, help="RSS growth (%%) that fails the run")
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keep-logs", type=Path, metavar="DIR",
                        help="copy the control plane's log (every loop_stalled event) and its output here")
    args = parser.parse_args()

    from seer.cli.daemon import start_background, stop
    from seer.config import default_cache_dir

    tally = Tally()
    joiners: list[subprocess.Popen] = []
    with tempfile.TemporaryDirectory(prefix="seer-soak-") as tmp:
        run_dir = Path(tmp) / "run"
        config = write_config(Path(tmp) / "soak.toml", engines=args.engines, step_s=args.step_s,
                              mean_output_tokens=args.mean_output_tokens, policy=args.policy)
        info = start_background(str(config), run_dir, default_cache_dir(), 120.0)
        pid, address = int(info["pid"]), info["client_address"]
        start_rss = memory_kib(pid)["VmRSS"]
        print(f"daemon pid {pid}, {args.engines} sim engines, start RSS {start_rss / 1024:.1f} MiB", flush=True)
        kill_stop = threading.Event()
        kill_thread = threading.Thread(target=killer, args=(address, info["engine_address"], config, run_dir, args,
                                                            tally, kill_stop, joiners), daemon=True)
        t0 = time.monotonic()

        async def drive() -> None:
            stop_clients = asyncio.Event()

            async def watch() -> None:
                last_report = 0.0
                while tally.num_samples < args.samples:
                    await asyncio.sleep(1.0)
                    if "VmRSS" not in (mem := memory_kib(pid)):  # gone (a zombie has no memory lines)
                        tally.problems.append(f"the daemon (pid {pid}) exited after {tally.num_samples} samples")
                        break
                    tally.rss.append((tally.num_samples, mem["VmRSS"]))
                    if not tally.rss_after_warmup_kib and tally.num_samples >= args.warmup * args.samples:
                        tally.rss_after_warmup_kib = tally.rss[-1][1]
                    if time.monotonic() - last_report >= 30:
                        last_report = time.monotonic()
                        print(f"  {time.monotonic() - t0:7.0f} s  {tally.num_samples:>9} samples  "
                              f"{tally.num_kills:>4} kills  RSS {memory_kib(pid)['VmRSS'] / 1024:.1f} MiB", flush=True)
                stop_clients.set()

            await asyncio.gather(watch(), *(client_worker(address, w, args, tally, stop_clients)
                                            for w in range(args.clients)))

        kill_thread.start()
        try:
            asyncio.run(drive())
        finally:
            kill_stop.set()
            kill_thread.join(60)
            wall_s = time.monotonic() - t0
            end_rss = memory_kib(pid).get("VmRSS", 0)
            settled_rss = settled_kib(address, pid) if end_rss else 0
            stop(run_dir, 60.0)
            for proc in joiners:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGTERM)
                    proc.wait(30)
            log = events(run_dir / "controlplane.log")
            if args.keep_logs:
                args.keep_logs.mkdir(parents=True, exist_ok=True)
                for name in ("controlplane.log", "daemon.out"):
                    shutil.copy(run_dir / name, args.keep_logs / name)
    unexpected = [e for e in log if e.get("level") in ("error", "critical") and e["event"] not in EXPECTED_ERRORS]
    num_lost_engines = sum(1 for e in log if e["event"] == "engine_lost")
    stall_ms = next((e.get("max_loop_lag_ms") for e in log if e["event"] == "control_plane_stopped"), None)
    base = tally.rss_after_warmup_kib or start_rss
    point_growth = 100.0 * (end_rss - base) / base
    first, last = rss_windows(tally.rss, args.warmup * args.samples, args.window * args.samples, tally.num_samples)
    growth = 100.0 * (last - first) / first if first and last else point_growth
    print(f"samples checked {tally.num_samples} in {tally.num_rollouts} rollouts ({wall_s:.0f} s, "
          f"{tally.num_samples / wall_s:.0f} samples/s); clients that left early {tally.num_left}")
    print(f"samples lost or duplicated (problems) {len(tally.problems)}; engine kills {tally.num_kills}, "
          f"engine_lost events {num_lost_engines}")
    print(f"control-plane RSS: start {start_rss / 1024:.1f} MiB; highest right after warm-up {first / 1024:.1f} MiB, "
          f"in the last {args.window:.0%} of the samples {last / 1024:.1f} MiB ({growth:+.1f} %); "
          f"single readings after warm-up {base / 1024:.1f}, at the end {end_rss / 1024:.1f} MiB "
          f"({point_growth:+.1f} %); idle after the last rollout {settled_rss / 1024:.1f} MiB")
    print(f"worst loop stall {stall_ms} ms")
    stalls = sorted((e for e in log if e["event"] == "loop_stalled"), key=lambda e: -e.get("stall_ms", 0))
    print(f"loop stalls over {STALL_LOGGED_S * 1000:g} ms: {len(stalls)}; by cause "
          f"{dict(Counter(e.get('cause') for e in stalls))}")
    for e in stalls[:3]:  # the worst, with what the loop thread did meanwhile (controlplane/loopwatch.py)
        print("  " + ", ".join(f"{k} {e[k]}" for k in ("stall_ms", "cause", "cpu_ms", "runq_ms", "blocked_ms",
                                                        "gc_ms", "preempted", "where") if k in e))
    print(f"error events other than engine_lost: {len(unexpected)}")
    for line in tally.problems[:10] + [json.dumps(e)[:300] for e in unexpected[:10]]:
        print("  " + line)
    return 1 if tally.problems or unexpected or growth >= args.max_growth else 0


def rss_windows(readings: list[tuple[int, int]], start: float, width: float, end: int) -> tuple[int, int]:
    """Highest RSS (KiB) among the readings taken while the samples checked were in
    [start, start + width), and among those in the last ``width`` samples (0: none)."""
    first = [rss for n, rss in readings if start <= n < start + width]
    last = [rss for n, rss in readings if n >= end - width]
    return max(first, default=0), max(last, default=0)


def settled_kib(address: str, pid: int, settle_s: float = 5.0) -> int:
    """RSS once no rollout is left and the daemon has had ``settle_s`` to give memory back."""
    try:
        with SeerClient(address, timeout_s=60) as client:
            deadline = time.monotonic() + 60
            while client.status().rollouts and time.monotonic() < deadline:
                time.sleep(0.2)
    except SeerError:
        pass
    time.sleep(settle_s)
    return memory_kib(pid).get("VmRSS", 0)


if __name__ == "__main__":
    sys.exit(main())
