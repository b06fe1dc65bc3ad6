"""Microbenchmark: chunk decisions per CPU second of a chunked policy on the pure scheduler core.

A rollout of ``--requests`` samples (default: enough that >= 10,000 always wait) waits on ``--engines`` engines whose KV holds about
``--inflight`` chunks each. The loop finishes one in-flight chunk at a time (each chunk
ends at its budget, so its request goes back to the queue and the queue stays full) and
asks the scheduler for work; every dispatch is one decision. The time is CPU time of the
whole loop (``chunk_finished`` + ``schedule``), of ``schedule`` alone (the policy plus
the scheduler applying its assignments and building the chunk tasks) and of the policy's
``assign`` alone, each as decisions per CPU second, with the timers' own cost taken out
(``clock_call_s``).

``--baseline-python PY`` also runs this same script under another interpreter whose
``seer`` is another checkout (e.g. ``OTHER_CHECKOUT/.venv/bin/python``),
interleaved with this checkout ``--repeat`` times, and prints the medians side by side
with their ratio and the goal (20,000 decisions/s), so both are measured under
the same machine load.

The run uses the collector settings the daemon uses (``controlplane/gc_tuning.py``:
start-up frozen, young collections every 50,000 allocations); ``--cpython-gc`` keeps
CPython's defaults, and a baseline checkout without that module runs with the defaults.

    .venv/bin/python benchmarks/sim_policy_speed.py --policy context --requests 10000 --engines 16
    .venv/bin/python benchmarks/sim_policy_speed.py --policy context \
        --baseline-python OTHER_CHECKOUT/.venv/bin/python --repeat 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

from seer.config import SchedulerConfig
from seer.controlplane.scheduler import Scheduler
from seer.controlplane.state import Group, Request, Rollout
from seer.protocol import ChunkFinished, EngineCapabilities, SamplingParams, pack_logprobs, pack_token_ids

PROMPT = 1024
CHUNK = 512
GROUP = 16


def build(policy: str, requests: int, engines: int, inflight: int) -> tuple[Scheduler, Rollout]:
    config = SchedulerConfig(policy=policy, chunk_size_tokens=CHUNK)
    sched = Scheduler(config, lambda: 0.0)
    kv = inflight * (PROMPT + 4 * CHUNK)
    for e in range(engines):
        sched.engine_joined(e, EngineCapabilities(backend="sim", model="m", dtype="none", max_model_len=1 << 20,
                                                  vocab_size=32000, kv_capacity_tokens=kv, block_size=16))
    rollout = Rollout(rollout_id="speed", policy=policy, accepted_s=0.0)
    for gi in range(-(-requests // GROUP)):
        g = Group(group_id=f"speed/{gi}", rollout=rollout, group_index=gi, prompt_id=str(gi))
        prompt = [gi % 30000 + 1] * PROMPT
        for si in range(GROUP):
            q = Request(request_id=f"speed/{gi}/{si}", group=g, sample_index=si, prompt_token_ids=prompt,
                        sampling=SamplingParams(max_tokens=1 << 18, seed=1))
            q.oracle_length = 1 << 18
            g.requests.append(q)
        rollout.groups.append(g)
    sched.submit(rollout)
    return sched, rollout


def run(policy: str, requests: int, engines: int, inflight: int, decisions: int,
        daemon_gc: bool = True) -> dict[str, float]:
    """CPU seconds of the whole loop, of ``schedule()`` alone and of the policy's
    ``assign`` alone, the decisions made, and the fewest requests waiting at any point.
    ``daemon_gc``: with the garbage-collector settings the daemon runs with
    (``controlplane/gc_tuning.py``), else CPython's defaults."""
    sched, _ = build(policy, requests, engines, inflight)
    if daemon_gc:
        try:  # the daemon's collector settings (a checkout from before them has none)
            from seer.controlplane.gc_tuning import tune_for_service
        except ImportError:
            pass
        else:
            tune_for_service()
    target = sched.policy(policy)
    assign = target.assign
    spent = [0.0]

    def timed(views, *limit):  # the policy's own share of each round (a checkout before Policy.assign took a limit passes none)
        t = time.process_time()
        try:
            return assign(views, *limit)
        finally:
            spent[0] += time.process_time() - t

    target.assign = timed  # type: ignore[method-assign]
    running = list(sched.schedule())
    spent[0] = 0.0
    made, rounds, in_schedule, min_waiting = 0, 0, 0.0, sched.num_waiting()
    t0 = time.process_time()
    while made < decisions and running:
        d = running.pop(0)
        n = d.task.sampling.max_tokens
        sched.chunk_finished(ChunkFinished(engine_id=d.engine_id, task_id=d.task.task_id, token_ids=pack_token_ids([7] * n),
                                           logprobs=pack_logprobs([0.0] * n), finish_reason="length", num_prompt_tokens=0,
                                           num_cached_tokens=0, elapsed_ms=0.0))
        t = time.process_time()
        new = sched.schedule()
        in_schedule += time.process_time() - t
        rounds += 1
        made += len(new)
        running.extend(new)
        min_waiting = min(min_waiting, sched.num_waiting())
    loop_s = time.process_time() - t0
    # The timers' own cost, taken out: an interval between two clock reads holds about one
    # call of the clock; ``schedule``'s also holds the two of the ``assign`` timer inside it,
    # and the loop all four per round.
    call_s = clock_call_s()
    return {"loop_s": loop_s - 4 * rounds * call_s, "schedule_s": in_schedule - 3 * rounds * call_s,
            "assign_s": spent[0] - rounds * call_s, "decisions": made, "min_waiting": min_waiting,
            "clock_call_us": call_s * 1e6}


def clock_call_s(calls: int = 50_000) -> float:
    """CPU seconds one ``time.process_time()`` call costs here: a system call on some
    virtual machines (measured 1.1 us, against ~40 us per decision), so the timers would
    otherwise be a few percent of what they time."""
    clock = time.process_time
    t = clock()
    for _ in range(calls):
        clock()
    return (clock() - t) / calls


GOAL_PER_S = 20_000  # the goal: chunk decisions/s for ``context``, 10,000 waiting, 16 engines
METRICS = [("assign_s", "policy.assign"), ("schedule_s", "scheduler.schedule"), ("loop_s", "loop with chunk_finished")]


def _child(python: str, args: argparse.Namespace) -> dict[str, float]:
    cmd = [python, __file__, "--json", "--policy", args.policy, "--requests", str(args.requests), "--engines",
           str(args.engines), "--inflight", str(args.inflight), "--decisions", str(args.decisions)]
    if args.cpython_gc:
        cmd.append("--cpython-gc")
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def compare(args: argparse.Namespace) -> None:
    runs: dict[str, list[dict[str, float]]] = {"baseline": [], "this": []}
    for _ in range(args.repeat):  # interleaved: both see the same load
        runs["baseline"].append(_child(args.baseline_python, args))
        runs["this"].append(_child(sys.executable, args))
    rates = {name: {key: statistics.median(r["decisions"] / r[key] for r in rs) for key, _ in METRICS}
             for name, rs in runs.items()}
    print(f"{args.policy}, {args.engines} engines, >= {runs['this'][0]['min_waiting']} waiting, "
          f"{runs['this'][0]['decisions']} decisions per run, median of {args.repeat} interleaved runs "
          f"(decisions per CPU second); baseline: {args.baseline_python}")
    print(f"| part | baseline /s | this /s | this / baseline | this / goal {GOAL_PER_S:,} |")
    print("|---|---|---|---|---|")
    for key, label in METRICS:
        base, this = rates["baseline"][key], rates["this"][key]
        print(f"| {label} | {base:,.0f} | {this:,.0f} | {this / base:.2f} | {this / GOAL_PER_S:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policy", default="context")
    parser.add_argument("--requests", type=int, default=12_000, help="samples in the rollout (some are in flight)")
    parser.add_argument("--engines", type=int, default=16)
    parser.add_argument("--inflight", type=int, default=64, help="chunks each engine's KV holds, about")
    parser.add_argument("--decisions", type=int, default=50_000)
    parser.add_argument("--baseline-python",
                        help="also run under this interpreter (another checkout), interleaved")
    parser.add_argument("--repeat", type=int, default=3, help="runs of each side with --baseline-python")
    parser.add_argument("--cpython-gc", action="store_true",
                        help="keep CPython's default collector settings (default: the daemon's, controlplane/gc_tuning.py)")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON line (used by --baseline-python)")
    args = parser.parse_args()
    if args.baseline_python:
        compare(args)
        return
    r = run(args.policy, args.requests, args.engines, args.inflight, args.decisions, daemon_gc=not args.cpython_gc)
    if args.json:
        print(json.dumps(r))
        return
    made = r["decisions"]
    print(f"{args.policy}: {made} chunk decisions, {args.engines} engines, >= {r['min_waiting']} requests waiting "
          f"throughout; CPU s and decisions/s: policy.assign {r['assign_s']:.2f} s = {made / r['assign_s']:,.0f}/s, "
          f"scheduler.schedule {r['schedule_s']:.2f} s = {made / r['schedule_s']:,.0f}/s, whole loop with "
          f"chunk_finished {r['loop_s']:.2f} s = {made / r['loop_s']:,.0f}/s (timers' own cost taken out: "
          f"{r['clock_call_us']:.2f} us per clock read)")


if __name__ == "__main__":
    main()
