"""Benchmark: the control plane under load, on simulated engines.

Starts one daemon with simulated engines (no model) and drives it with

1. one large rollout (``--requests`` samples, default 10,000 = 1,250 prompts x G 8),
   checking that every sample comes back exactly once;
2. ``--clients`` concurrent client calls at once (default 100 clients, each with its own
   socket, each running a small rollout, plus as many status calls in flight);
3. ``--repeats`` more large rollouts (default 5), reading the control-plane process's
   RSS after each, to see whether memory keeps growing;

and prints the control plane's peak RSS (``VmHWM`` of /proc/PID/status) and RSS after
each round: as the client gets its last result, and settled (``--settle-s`` after the
daemon has no rollout left: it collects what an ended rollout held and gives the pages
back on its next ticks, controlplane/memory.py). Exits non-zero if any sample is missing
or duplicated, any call fails, the control-plane log has an error event, or the settled
RSS after a later large rollout exceeds the one after the second by ``--max-growth`` % or
more. The integration test ``tests/integration/test_load.py`` drives the same functions.

    .venv/bin/python benchmarks/load.py --engines 2 --requests 10000 --clients 100 --repeats 5
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from seer.client import AsyncSeerClient, RolloutResult, SamplingParams


def write_config(path: Path, *, engines: int, step_s: float, policy: str, mean_output_tokens: int) -> Path:
    """A sim-engine seer.toml sized for load: generous timeouts, room for a 10k-sample call."""
    path.write_text(
        "[engines]\n"
        f'backend = "sim"\ncount = {engines}\nsim_step_s = {step_s}\n'
        f"sim_mean_output_tokens = {mean_output_tokens}\nheartbeat_timeout_s = 60.0\n"
        # A loaded 2-core box can stall the loop for seconds; never abort a healthy client.
        "\n[server]\nclient_timeout_s = 120.0\nmax_group_size = 64\n"
        f'\n[scheduler]\npolicy = "{policy}"\nchunk_size_tokens = 16\n'
        "\n[model]\nmax_model_len = 512\n"
        '\n[logging]\nlevel = "info"\n'
    )
    return path


def memory_kib(pid: int) -> dict[str, int]:
    """VmRSS (now) and VmHWM (peak) of a process, in KiB."""
    fields: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            fields[name] = int(value.split()[0])
    return fields


def sample_problems(result: RolloutResult, num_prompts: int, group_size: int) -> list[str]:
    """Everything that is not 'every sample exactly once, in its place'."""
    problems: list[str] = []
    indices = [g.group_index for g in result.groups]
    if indices != list(range(num_prompts)):
        missing = sorted(set(range(num_prompts)) - set(indices))
        extra = len(indices) - len(set(indices))
        problems.append(f"rollout {result.rollout_id}: {len(indices)} groups, missing {missing[:10]}, "
                        f"{extra} duplicated")
    for g in result.groups:
        samples = [s.sample_index for s in g.samples]
        if samples != list(range(group_size)):
            problems.append(f"group {g.group_index}: sample indices {samples}")
        for s in g.samples:
            if not s.token_ids or len(s.logprobs) != len(s.token_ids) or s.finish_reason not in ("stop", "length"):
                problems.append(f"group {g.group_index} sample {s.sample_index}: {len(s.token_ids)} tokens, "
                                f"{len(s.logprobs)} logprobs, finish {s.finish_reason}")
    if result.stats.num_samples != num_prompts * group_size:
        problems.append(f"stats say {result.stats.num_samples} samples, expected {num_prompts * group_size}")
    return problems


@dataclass
class Round:
    name: str
    wall_s: float
    num_samples: int
    rss_kib: int
    hwm_kib: int
    problems: list[str] = field(default_factory=list)
    settled_kib: int = 0  # RSS once the daemon had no rollout left for ``settle_s`` (0: not measured)


async def big_rollout(address: str, num_prompts: int, group_size: int, max_tokens: int, tag: str,
                      timeout_s: float) -> tuple[RolloutResult, list[str]]:
    async with AsyncSeerClient(address, timeout_s=timeout_s) as client:
        result = await client.rollout([f"{tag} prompt {i}" for i in range(num_prompts)], group_size,
                                      SamplingParams(max_tokens=max_tokens, seed=1), timeout_s=timeout_s)
    return result, sample_problems(result, num_prompts, group_size)


async def concurrent_calls(address: str, num_clients: int, prompts_per_client: int, group_size: int,
                           max_tokens: int, timeout_s: float) -> tuple[int, list[str]]:
    """``num_clients`` clients, each its own socket, each a rollout and a status call at once."""
    clients = [AsyncSeerClient(address, timeout_s=timeout_s) for _ in range(num_clients)]
    problems: list[str] = []
    try:
        rollouts = [c.rollout([f"client {i} prompt {j}" for j in range(prompts_per_client)], group_size,
                              SamplingParams(max_tokens=max_tokens, seed=i), timeout_s=timeout_s)
                    for i, c in enumerate(clients)]
        statuses = [c.status() for c in clients]
        outcomes = await asyncio.gather(*rollouts, *statuses, return_exceptions=True)
    finally:
        await asyncio.gather(*(c.close() for c in clients))
    num_samples = 0
    for i, outcome in enumerate(outcomes):
        if isinstance(outcome, BaseException):
            problems.append(f"call {i}: {type(outcome).__name__}: {outcome}")
        elif isinstance(outcome, RolloutResult):
            problems += sample_problems(outcome, prompts_per_client, group_size)
            num_samples += outcome.stats.num_samples
    if len({o.rollout_id for o in outcomes if isinstance(o, RolloutResult)}) != num_clients:
        problems.append("rollout ids are not distinct per client")
    return num_samples, problems


def error_events(log_file: Path) -> list[str]:
    """Error-level events in the control-plane log (JSON lines)."""
    errors = []
    for line in log_file.read_text().splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if event.get("level") in ("error", "critical"):
            errors.append(line)
    return errors


def worst_loop_stall_ms(log_file: Path) -> int | None:
    """The loop's worst stall (``control_plane_stopped.max_loop_lag_ms``; the daemon has stopped)."""
    for line in log_file.read_text().splitlines():
        if '"control_plane_stopped"' in line:
            return json.loads(line).get("max_loop_lag_ms")
    return None


def settled_rss_kib(address: str, pid: int, settle_s: float, timeout_s: float = 60.0) -> int:
    """RSS once the daemon has had no rollout for ``settle_s`` seconds."""

    async def idle() -> None:
        async with AsyncSeerClient(address, timeout_s=timeout_s) as client:
            deadline = time.monotonic() + timeout_s
            while (await client.status()).rollouts and time.monotonic() < deadline:
                await asyncio.sleep(0.1)

    asyncio.run(idle())
    time.sleep(settle_s)
    return memory_kib(pid)["VmRSS"]


def run_load(address: str, pid: int, *, num_requests: int, group_size: int, max_tokens: int, num_clients: int,
             prompts_per_client: int, num_repeats: int, timeout_s: float, settle_s: float = 0.0,
             on_round=lambda r: None) -> list[Round]:
    """The three phases against a running daemon; one Round per rollout or burst
    (``settle_s`` > 0: each round also reads the RSS the daemon settles to, idle)."""
    num_prompts = num_requests // group_size
    rounds: list[Round] = []

    def record(name: str, t0: float, num_samples: int, problems: list[str]) -> None:
        mem = memory_kib(pid)
        r = Round(name, time.monotonic() - t0, num_samples, mem["VmRSS"], mem["VmHWM"], problems)
        if settle_s > 0:
            r.settled_kib = settled_rss_kib(address, pid, settle_s)
        rounds.append(r)
        on_round(r)

    t0 = time.monotonic()
    result, problems = asyncio.run(big_rollout(address, num_prompts, group_size, max_tokens, "r1", timeout_s))
    record("rollout 1", t0, result.stats.num_samples, problems)
    t0 = time.monotonic()
    num_samples, problems = asyncio.run(concurrent_calls(address, num_clients, prompts_per_client, group_size,
                                                         max_tokens, timeout_s))
    record(f"{num_clients} clients + {num_clients} status", t0, num_samples, problems)
    for k in range(2, num_repeats + 1):
        t0 = time.monotonic()
        result, problems = asyncio.run(big_rollout(address, num_prompts, group_size, max_tokens, f"r{k}", timeout_s))
        record(f"rollout {k}", t0, result.stats.num_samples, problems)
    return rounds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engines", type=int, default=2)
    parser.add_argument("--requests", type=int, default=10_000, help="samples per large rollout")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--mean-output-tokens", type=int, default=16)
    parser.add_argument("--step-s", type=float, default=0.002, help="sim engine seconds per decode step")
    parser.add_argument("--policy", default="group")
    parser.add_argument("--clients", type=int, default=100)
    parser.add_argument("--prompts-per-client", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5, help="large rollouts in total")
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--settle-s", type=float, default=5.0,
                        help="after each round, seconds idle before the settled RSS is read (0: not read)")
    parser.add_argument("--max-growth", type=float, default=5.0,
                        help="settled RSS growth (%%) from the second large rollout on that fails the run")
    args = parser.parse_args()

    from seer.cli.daemon import start_background, stop
    from seer.config import default_cache_dir

    with tempfile.TemporaryDirectory(prefix="seer-load-") as tmp:
        run_dir = Path(tmp) / "run"
        config = write_config(Path(tmp) / "load.toml", engines=args.engines, step_s=args.step_s,
                              policy=args.policy, mean_output_tokens=args.mean_output_tokens)
        info = start_background(str(config), run_dir, default_cache_dir(), 120.0)
        pid = int(info["pid"])
        print(f"daemon pid {pid}, {args.engines} sim engines, policy {args.policy}, "
              f"start RSS {memory_kib(pid)['VmRSS'] / 1024:.1f} MiB")
        print(f"{'round':<28} {'samples':>8} {'wall s':>8} {'samples/s':>10} {'RSS MiB':>8} {'settled':>8} "
              f"{'peak MiB':>9}")

        def show(r: Round) -> None:
            print(f"{r.name:<28} {r.num_samples:>8} {r.wall_s:>8.1f} {r.num_samples / r.wall_s:>10.0f} "
                  f"{r.rss_kib / 1024:>8.1f} {r.settled_kib / 1024:>8.1f} {r.hwm_kib / 1024:>9.1f}", flush=True)

        try:
            rounds = run_load(info["client_address"], pid, num_requests=args.requests, group_size=args.group_size,
                              max_tokens=args.max_tokens, num_clients=args.clients,
                              prompts_per_client=args.prompts_per_client, num_repeats=args.repeats,
                              timeout_s=args.timeout, settle_s=args.settle_s, on_round=show)
            errors = error_events(run_dir / "controlplane.log")
        finally:
            stop(run_dir, 60.0)
            stall_ms = worst_loop_stall_ms(run_dir / "controlplane.log")
    problems = [p for r in rounds for p in r.problems]
    large = [r for r in rounds if r.name.startswith("rollout")]
    growth = (large[-1].rss_kib - large[0].rss_kib) / 1024
    print(f"control-plane peak RSS {rounds[-1].hwm_kib / 1024:.1f} MiB; RSS after {large[0].name} "
          f"{large[0].rss_kib / 1024:.1f} MiB, after {large[-1].name} {large[-1].rss_kib / 1024:.1f} MiB "
          f"({growth:+.1f} MiB)")
    level_growth = 0.0
    if args.settle_s > 0 and len(large) >= 3:
        level = [r.settled_kib for r in large[1:]]
        level_growth = 100.0 * (max(level) - level[0]) / level[0]
        print(f"settled RSS from {large[1].name} on: {' '.join(f'{k / 1024:.1f}' for k in level)} MiB "
              f"(highest {level_growth:+.1f} % over {large[1].name})")
    print(f"the control-plane loop's worst stall: {stall_ms} ms")
    print(f"problems: {len(problems)}; error events in the control-plane log: {len(errors)}")
    for line in (problems + errors)[:20]:
        print("  " + line)
    return 1 if problems or errors or level_growth >= args.max_growth else 0


if __name__ == "__main__":
    sys.exit(main())
