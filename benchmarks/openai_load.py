"""Benchmark: the OpenAI-compatible endpoint under load, against the ZeroMQ client path.

Starts one daemon with simulated engines (``--engines`` sim engines, ``--step-s`` per
decode step, ``[openai] enabled = true``) and runs, interleaved A B A B for ``--reps``,
the same rollout two ways: ``--prompts`` x ``--group-size`` trajectories (256 by default)
of ``--turns`` turns each, every turn decoding exactly ``--tokens`` tokens
(``SamplingParams(max_tokens=N, ignore_eos=True)``; the sim engine honours ignore_eos):

* **A, the ZeroMQ client path:** ``rollout(..., env=fn, trajectory=TrajectorySpec(max_turns=T))``;
  the async ``fn`` answers each turn end with ``EnvReply(messages=[tool_message(...)])`` and
  ends the last turn with ``EnvReply(done=True)``. A turn's latency is from the moment the
  env returned for turn k-1 to the moment it is called for turn k of the same trajectory
  (the env's own time, ~0, is left out): the answer's trip to the daemon, the turn's
  sampling and its ``TurnEnded`` back. Turn 0 has no earlier answer and is not timed.
* **B, the HTTP endpoint:** ``rollout(..., agent=fn)``; the ``async def`` agent opens one
  HTTP client per trajectory (``--http``: aiohttp by default, or httpx, the openai SDK's;
  ``http_session``) and makes T chat-completions calls to
  ``ctx.base_url`` with ``ctx.api_key`` (``max_tokens`` = N each), appending
  ``{"role": "assistant", ...}`` and ``{"role": "tool", "content": "result k"}`` each time.
  A call's latency is from the POST to its decoded JSON answer, as the agent sees it.

Both paths send the same chat prompts and append the same tool messages, so every turn
samples the same number of tokens from contexts of the same length. Per path it reports
the median and p90 of per-turn latency (B over all calls and over calls 1..T-1, the ones
A's figure compares with; B's call 0 also waits for its rollout's admission), the wall
time of the rollout, turns completed, and the daemon's and this process's CPU seconds;
then the endpoint's overhead per call: B's median (calls 1..T-1) minus A's. Before the
timed runs, both paths run once untimed at small scale (8 trajectories of 2 turns), so
neither pays first-use costs (httpx and anyio import their backends on the first call).

Checks (exit 1 if any fails): every trajectory has exactly T turns (``SampleResult.turns``),
A's env was called once per turn (turns 0..T-1, none twice), every B call got HTTP 200 (no
error, no timeout), every B call was answered exactly once (one response per call, its
``seer.turn`` the call's index, its response id unique over the run, and as many responses
as calls in all), every B call's ``choices[0].token_ids`` equals the span its turn sampled
(``SampleResult.turns[k]``), every turn sampled exactly ``--tokens`` tokens, and the
daemon logged no error.

    .venv/bin/python benchmarks/openai_load.py --reps 2 --out runs/openai_load.json

``--profile DIR`` (a separate run: sampling slows both paths a little) writes, per path and
rep, py-spy's collapsed stacks (``py-spy record --format raw --nonblocking``) of the daemon's
control plane and of this process (the client and its agents); ``--py-spy PATH`` names the
binary (``pip install py-spy``; not a dependency of Seer).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import platform
import signal
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from seer.agentic import AgentContext, EnvReply, Turn, tool_message
from seer.client import AsyncSeerClient, SamplingParams
from seer.protocol import TrajectorySpec


def write_config(path: Path, *, engines: int, step_s: float, max_model_len: int, policy: str | None) -> Path:
    lines = ["[engines]", 'backend = "sim"', f"count = {engines}", f"sim_step_s = {step_s}",
             "", "[server]", "client_timeout_s = 600.0", "max_group_size = 64",
             "", "[model]", f"max_model_len = {max_model_len}",
             "", "[openai]", "enabled = true", "port = 0"]
    if policy is not None:
        lines += ["", "[scheduler]", f'policy = "{policy}"']
    path.write_text("\n".join(lines) + "\n")
    return path


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    if not xs:
        return float("nan")
    return xs[min(len(xs) - 1, int(q * len(xs)))]


@contextlib.contextmanager
def profiled(args: argparse.Namespace, name: str, daemon_pid: int):
    """py-spy (sampling, never pausing the process) on the daemon's control plane and on
    this process around one path's rollout (``--profile``): collapsed stacks per process."""
    if args.profile is None:
        yield
        return
    args.profile.mkdir(parents=True, exist_ok=True)
    spies = [subprocess.Popen([args.py_spy, "record", "--pid", str(pid), "--format", "raw", "--rate", "250",
                               "--nonblocking", "--output", str(args.profile / f"{who}-{name}.txt")],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
             for who, pid in (("daemon", daemon_pid), ("client", os.getpid()))]
    time.sleep(1.0)  # py-spy attaches
    try:
        yield
    finally:
        for spy in spies:
            spy.send_signal(signal.SIGINT)  # py-spy writes its file and exits
        for spy in spies:
            spy.wait(60)


def prompt_messages(i: int) -> list[dict]:
    return [{"role": "system", "content": "You are a careful assistant with a calculator tool."},
            {"role": "user", "content": f"Task {i}: add up the numbers the tool gives you."}]


@dataclass
class Run:
    path: str  # "A" or "B"
    rep: int
    wall_s: float = 0.0
    latencies: list[float] = field(default_factory=list)  # the timed turns (A: 1..T-1, B: every call)
    later: list[float] = field(default_factory=list)  # B: calls 1..T-1 (A: same as latencies)
    first: list[float] = field(default_factory=list)  # B: call 0
    turns_completed: int = 0
    trajectories: int = 0
    daemon_cpu_s: float = 0.0
    client_cpu_s: float = 0.0
    load_before: str = ""
    load_after: str = ""
    problems: list[str] = field(default_factory=list)

    def summary(self) -> dict:
        return {"path": self.path, "rep": self.rep, "wall_s": round(self.wall_s, 3),
                "median_ms": round(1e3 * statistics.median(self.later), 2) if self.later else None,
                "p90_ms": round(1e3 * pct(self.later, 0.9), 2) if self.later else None,
                "median_all_ms": round(1e3 * statistics.median(self.latencies), 2) if self.latencies else None,
                "p90_all_ms": round(1e3 * pct(self.latencies, 0.9), 2) if self.latencies else None,
                "first_call_median_ms": round(1e3 * statistics.median(self.first), 2) if self.first else None,
                "timed_turns": len(self.later), "turns_completed": self.turns_completed,
                "trajectories": self.trajectories, "daemon_cpu_s": round(self.daemon_cpu_s, 2),
                "client_cpu_s": round(self.client_cpu_s, 2), "load_before": self.load_before,
                "load_after": self.load_after, "problems": self.problems[:50], "num_problems": len(self.problems)}


def check_samples(run: Run, result, args: argparse.Namespace) -> None:
    """Every trajectory has exactly T turns of exactly N sampled tokens each."""
    for group in result.groups:
        for s in group.samples:
            run.trajectories += 1
            run.turns_completed += len(s.turns)
            where = f"{run.path} rep {run.rep} g{group.group_index} s{s.sample_index}"
            if len(s.turns) != args.turns:
                run.problems.append(f"{where}: {len(s.turns)} turns, expected {args.turns} "
                                    f"(finish_reason {s.finish_reason}, outcomes {[t.outcome for t in s.turns]})")
            spans = [t.end - t.start for t in s.turns]
            if any(n != args.tokens for n in spans):
                run.problems.append(f"{where}: turn spans {spans}, expected {args.tokens} tokens each")
    expected = args.prompts * args.group_size
    if run.trajectories != expected:
        run.problems.append(f"{run.path} rep {run.rep}: {run.trajectories} trajectories came back, expected {expected}")


async def timed_rollout(run: Run, client: AsyncSeerClient, args: argparse.Namespace, daemon_pid: int, **how):
    """The path's rollout (``how``: its env or agent and trajectory), with its wall time,
    the daemon's and this process's CPU seconds and the load average around it."""
    prompts = [{"messages": prompt_messages(i)} for i in range(args.prompts)]
    sampling = SamplingParams(max_tokens=args.tokens, ignore_eos=True, seed=run.rep)
    run.load_before = loadavg()
    d0, c0, t0 = cpu_s(daemon_pid), time.process_time(), time.perf_counter()
    with profiled(args, f"{run.path}-{run.rep}", daemon_pid):
        result = await client.rollout(prompts, args.group_size, sampling, policy=args.policy, timeout_s=args.timeout,
                                      **how)
    run.wall_s = time.perf_counter() - t0
    run.daemon_cpu_s, run.client_cpu_s = cpu_s(daemon_pid) - d0, time.process_time() - c0
    run.load_after = loadavg()
    return result


async def run_a(client: AsyncSeerClient, args: argparse.Namespace, rep: int, daemon_pid: int) -> Run:
    run = Run("A", rep)
    called: dict[tuple[int, int], list[tuple[int, float, float]]] = {}  # (g, s) -> (turn, entered, left)
    last = args.turns - 1

    async def env(turn: Turn) -> EnvReply:
        entered = time.perf_counter()
        if turn.turn >= last:
            reply = EnvReply(done=True)
        else:
            reply = EnvReply(messages=[tool_message(f"result {turn.turn}")], tool_name="calc")
        called.setdefault((turn.group_index, turn.sample_index), []).append((turn.turn, entered, time.perf_counter()))
        return reply

    result = await timed_rollout(run, client, args, daemon_pid, env=env, tool_parser=None,
                                 trajectory=TrajectorySpec(max_turns=args.turns, tool_timeout_s=600.0))
    for (g, s), calls in sorted(called.items()):
        order = [k for k, _, _ in calls]
        if order != list(range(args.turns)):
            run.problems.append(f"A rep {rep} g{g} s{s}: env called for turns {order}, expected 0..{last} once each")
            continue
        for (_, _, left), (_, entered, _) in itertools.pairwise(calls):
            run.latencies.append(entered - left)
    run.later = list(run.latencies)
    missing = args.prompts * args.group_size - len(called)
    if missing:
        run.problems.append(f"A rep {rep}: {missing} trajectories never reached their env")
    check_samples(run, result, args)
    return run


# One TLS context for every httpx client: httpx.AsyncClient() loads the CA bundle each time
# (~10-70 ms of CPU on this machine, blocking the loop the agents share); the endpoint is
# plain http, so nothing uses it, but 256 loads cost seconds of every call.
_TLS = ssl.create_default_context()


@contextlib.asynccontextmanager
async def http_session(kind: str, base_url: str, api_key: str, timeout: float):
    """One trajectory's HTTP client (one keep-alive connection): ``post(path, body)`` gives
    (status, decoded JSON). ``httpx`` is what the openai SDK uses; ``aiohttp`` (vLLM's
    dependency, a C-accelerated client) costs this process less CPU per call, so more of a
    call's time is the endpoint's on a machine the client shares with the daemon."""
    headers = {"Authorization": f"Bearer {api_key}"}
    if kind == "httpx":
        async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=timeout, verify=_TLS) as http:
            async def post(path: str, body: dict) -> tuple[int, object]:
                response = await http.post(path, json=body)
                return response.status_code, response.json()
            yield post
        return
    import aiohttp

    async with aiohttp.ClientSession(base_url=base_url.rstrip("/") + "/", headers=headers,
                                     timeout=aiohttp.ClientTimeout(total=timeout),
                                     connector=aiohttp.TCPConnector(limit=1)) as http:
        async def post(path: str, body: dict) -> tuple[int, object]:
            async with http.post(path.lstrip("/"), json=body) as response:
                return response.status, await response.json(content_type=None)
        yield post


async def run_b(client: AsyncSeerClient, args: argparse.Namespace, rep: int, daemon_pid: int) -> Run:
    run = Run("B", rep)
    calls: dict[tuple[int, int], list[dict]] = {}  # (g, s) -> one record per call, in order
    sent = Counter()  # POSTs made
    answered = Counter()  # responses received

    async def agent(ctx: AgentContext) -> int:
        records = calls.setdefault((ctx.group_index, ctx.sample_index), [])
        messages = [dict(m) for m in prompt_messages(ctx.group_index)]
        async with http_session(args.http, ctx.base_url, ctx.api_key, args.timeout) as post:
            for k in range(args.turns):
                body = {"model": ctx.model, "messages": messages, "max_tokens": args.tokens}
                sent["calls"] += 1
                t0 = time.perf_counter()
                try:
                    status, data = await post("/chat/completions", body)
                except Exception as exc:  # noqa: BLE001 - recorded as the call's failure
                    records.append({"k": k, "status": -1, "error": f"{type(exc).__name__}: {exc}"})
                    return k
                seconds = time.perf_counter() - t0
                answered["responses"] += 1
                if status != 200:
                    records.append({"k": k, "status": status, "error": json.dumps(data)[:300]})
                    return k
                choice = data["choices"][0]
                records.append({"k": k, "status": 200, "s": seconds, "id": data["id"], "turn": choice["seer"]["turn"],
                                "group": choice["seer"]["group_index"], "sample": choice["seer"]["sample_index"],
                                "token_ids": choice["token_ids"]})
                messages += [{"role": "assistant", "content": choice["message"]["content"] or ""},
                             {"role": "tool", "content": f"result {k}"}]
        return args.turns

    result = await timed_rollout(run, client, args, daemon_pid, agent=agent,
                                 trajectory=TrajectorySpec(max_turns=args.turns))
    ids = Counter()
    for group in result.groups:
        for s in group.samples:
            where = f"B rep {rep} g{group.group_index} s{s.sample_index}"
            records = calls.get((group.group_index, s.sample_index), [])
            if s.agent_return != args.turns:
                run.problems.append(f"{where}: the agent returned {s.agent_return!r} "
                                    f"(finish_reason {s.finish_reason})")
            for r in records:
                if r["status"] != 200:
                    run.problems.append(f"{where} call {r['k']}: HTTP {r['status']}: {r['error']}")
                    continue
                ids[r["id"]] += 1
                (run.first if r["k"] == 0 else run.later).append(r["s"])
                run.latencies.append(r["s"])
                if (r["turn"], r["group"], r["sample"]) != (r["k"], group.group_index, s.sample_index):
                    run.problems.append(f"{where} call {r['k']}: answered as turn {r['turn']} of "
                                        f"g{r['group']} s{r['sample']}")
                elif r["k"] >= len(s.turns):
                    run.problems.append(f"{where} call {r['k']}: answered, but the sample has {len(s.turns)} turns")
                else:
                    t = s.turns[r["k"]]
                    if r["token_ids"] != s.token_ids[t.start:t.end]:
                        run.problems.append(f"{where} call {r['k']}: token_ids differ from the span its turn "
                                            f"sampled ({len(r['token_ids'])} vs {t.end - t.start} tokens)")
    doubles = [i for i, n in ids.items() if n > 1]
    if doubles:
        run.problems.append(f"B rep {rep}: {len(doubles)} response ids answered twice, e.g. {doubles[:3]}")
    if sent["calls"] != answered["responses"]:
        run.problems.append(f"B rep {rep}: {sent['calls']} calls made, {answered['responses']} responses received")
    expected = args.prompts * args.group_size * args.turns
    if sent["calls"] != expected:
        run.problems.append(f"B rep {rep}: {sent['calls']} calls made, expected {expected}")
    check_samples(run, result, args)
    return run


def error_events(log_file: Path) -> list[str]:
    out = []
    if not log_file.exists():
        return out
    for line in log_file.read_text(errors="replace").splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if event.get("level") in ("error", "critical"):
            out.append(line[:400])
    return out


def print_table(runs: list[Run], args: argparse.Namespace) -> dict:
    head = ["path", "rep", "median ms", "p90 ms", "B all calls: median / p90 ms", "B call 0 median ms",
            "wall s", "turns completed", "daemon CPU s", "client CPU s", "load avg before -> after", "checks"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in runs:
        s = r.summary()
        both = f"{s['median_all_ms']:.1f} / {s['p90_all_ms']:.1f}" if r.path == "B" and r.latencies else "-"
        first = f"{s['first_call_median_ms']:.1f}" if r.first else "-"
        med = f"{s['median_ms']:.1f}" if r.later else "-"
        p90 = f"{s['p90_ms']:.1f}" if r.later else "-"
        print(f"| {r.path} | {r.rep} | {med} | {p90} | {both} | {first} | {r.wall_s:.1f} | "
              f"{r.turns_completed}/{args.prompts * args.group_size * args.turns} | {r.daemon_cpu_s:.1f} | "
              f"{r.client_cpu_s:.1f} | {r.load_before} -> {r.load_after} | "
              f"{'ok' if not r.problems else f'{len(r.problems)} FAILED'} |")
    a = [x for r in runs if r.path == "A" for x in r.later]
    b = [x for r in runs if r.path == "B" for x in r.later]
    overhead = {}
    if a and b:
        ma, mb = statistics.median(a), statistics.median(b)
        paired = []
        for rep in range(args.reps):
            ra = [r for r in runs if r.path == "A" and r.rep == rep and r.later]
            rb = [r for r in runs if r.path == "B" and r.rep == rep and r.later]
            if ra and rb:
                paired.append(1e3 * (statistics.median(rb[0].later) - statistics.median(ra[0].later)))
        overhead = {"a_median_ms": round(1e3 * ma, 2), "b_median_ms": round(1e3 * mb, 2),
                    "overhead_ms": round(1e3 * (mb - ma), 2), "overhead_per_rep_ms": [round(x, 2) for x in paired],
                    "a_p90_ms": round(1e3 * pct(a, 0.9), 2), "b_p90_ms": round(1e3 * pct(b, 0.9), 2)}
        print(f"\nall reps: A median {1e3 * ma:.1f} ms (p90 {1e3 * pct(a, 0.9):.1f}), B median {1e3 * mb:.1f} ms "
              f"(p90 {1e3 * pct(b, 0.9):.1f}) over turns 1..{args.turns - 1}; the endpoint's overhead per call "
              f"(B - A medians): {1e3 * (mb - ma):+.1f} ms (per rep: {', '.join(f'{x:+.1f}' for x in paired)} ms); "
              f"goal <= 5 ms")
    print("median / p90: per-turn latency of turns 1..T-1 (A: the env's answer for turn k-1 to the env's call for "
          "turn k; B: a chat-completions call, POST to decoded answer). B call 0 also waits for the rollout's "
          "admission. daemon CPU: the control plane's process (not its engines).")
    return overhead


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=2, help="A B pairs, interleaved")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--turns", type=int, default=10, help="turns (B: calls) per trajectory")
    parser.add_argument("--tokens", type=int, default=16, help="tokens every turn decodes (ignore_eos)")
    parser.add_argument("--engines", type=int, default=2)
    parser.add_argument("--step-s", type=float, default=0.001, help="sim engine seconds per decode step")
    parser.add_argument("--policy", default=None, help="the rollouts' policy (default: the daemon's)")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--timeout", type=float, default=900.0, help="bound on each rollout and each HTTP call")
    parser.add_argument("--http", choices=("aiohttp", "httpx"), default="aiohttp",
                        help="B's HTTP client per trajectory (httpx: the openai SDK's)")
    parser.add_argument("--out", type=Path, help="write the figures as JSON")
    parser.add_argument("--profile", type=Path, metavar="DIR", help="profile each path's rollout into DIR")
    parser.add_argument("--py-spy", metavar="PATH", default="py-spy", help="--profile: py-spy's binary")
    parser.add_argument("--keep-run-dir", type=Path, help="run the daemon here and keep its logs")
    args = parser.parse_args()

    from seer.cli.daemon import start_background, stop

    from seer.config import default_cache_dir

    with tempfile.TemporaryDirectory(prefix="seer-openai-load-") as tmp:
        run_dir = args.keep_run_dir or Path(tmp) / "run"
        config = write_config(Path(tmp) / "openai_load.toml", engines=args.engines, step_s=args.step_s,
                              max_model_len=args.max_model_len, policy=args.policy)
        info = start_background(str(config), run_dir, default_cache_dir(), 120.0)
        pid = int(info["pid"])
        print(f"daemon pid {pid}: {args.engines} sim engines, step {args.step_s * 1e3:g} ms, openai at "
              f"{info.get('openai_url')}; {args.prompts} prompts x G {args.group_size} = "
              f"{args.prompts * args.group_size} trajectories x {args.turns} turns x {args.tokens} tokens; "
              f"{os.cpu_count()} CPUs ({cpu_model()}), load {loadavg()}", flush=True)
        runs: list[Run] = []
        warmup_problems: list[str] = []

        async def go() -> None:
            async with AsyncSeerClient(info["client_address"], timeout_s=args.timeout) as client:
                # Untimed: both paths once at small scale, so neither pays first-use costs
                # (httpx and anyio import their backends on the first call; so do the daemon's).
                small = argparse.Namespace(**{**vars(args), "prompts": 1, "group_size": 8, "turns": 2, "profile": None})
                for fn in (run_a, run_b):
                    warm = await fn(client, small, 1000, pid)
                    warmup_problems.extend(f"warm-up: {p}" for p in warm.problems)
                for rep in range(args.reps):
                    for fn in (run_a, run_b):
                        r = await fn(client, args, rep, pid)
                        s = r.summary()
                        print(f"  {r.path} rep {rep}: median {s['median_ms']} ms, p90 {s['p90_ms']} ms, wall "
                              f"{r.wall_s:.1f} s, {r.turns_completed} turns, {len(r.problems)} problems", flush=True)
                        runs.append(r)

        try:
            asyncio.run(go())
        finally:
            stop(run_dir, 60.0)
            errors = error_events(run_dir / "controlplane.log")
    print()
    overhead = print_table(runs, args)
    problems = warmup_problems + [p for r in runs for p in r.problems] + [f"daemon log: {e}" for e in errors]
    print(f"\nproblems: {len(problems)}")
    for line in problems[:30]:
        print("  " + line)
    if args.out:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False,
                                cwd=Path(__file__).parent).stdout.strip()
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({
            "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "commit": commit, "date": time.strftime("%Y-%m-%d %H:%M"), "cpus": os.cpu_count(), "cpu": cpu_model(),
            "runs": [r.summary() for r in runs], "overhead": overhead, "daemon_errors": errors[:50],
            "problems": problems[:200]}, indent=1))
        print(f"wrote {args.out}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
