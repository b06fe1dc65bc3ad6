"""Microbenchmark: chunk decisions per CPU second of a chunked policy on the pure scheduler core.

A rollout of ``--requests`` samples waits on ``--engines`` engines whose KV holds about
``--inflight`` chunks each. The loop finishes one in-flight chunk at a time (each chunk
ends at its budget, so its request goes back to the queue and the queue stays full) and
asks the scheduler for work; every dispatch is one decision. The time is CPU time of the
whole loop (``chunk_finished`` + ``schedule``), so it bounds the policy's cost from above.

    .venv/bin/python benchmarks/sim_policy_speed.py --policy context --requests 10000 --engines 16
"""

from __future__ import annotations

import argparse
import time

from seer.config import SchedulerConfig
from seer.controlplane.scheduler import Scheduler
from seer.controlplane.state import Group, Request, Rollout
from seer.protocol import EngineCapabilities, SamplingParams

PROMPT = 1024
CHUNK = 512
GROUP = 16


def build(policy: str, requests: int, engines: int, inflight: int) -> tuple[Scheduler, Rollout]:
    config = SchedulerConfig(policy=policy, chunk_size_tokens=CHUNK)
    sched = Scheduler(policy, lambda: 0.0, config)
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


def run(policy: str, requests: int, engines: int, inflight: int, decisions: int) -> tuple[float, int, int]:
    sched, _ = build(policy, requests, engines, inflight)
    running = list(sched.schedule())
    t0 = time.process_time()
    made = 0
    min_waiting = sched.num_waiting()
    while made < decisions and running:
        d = running.pop(0)
        n = d.task.sampling.max_tokens
        sched.chunk_finished(d.engine_id, d.task.task_id, [7] * n, [0.0] * n, "length")
        new = sched.schedule()
        made += len(new)
        running.extend(new)
        min_waiting = min(min_waiting, sched.num_waiting())
    return time.process_time() - t0, made, min_waiting


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policy", default="context")
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--engines", type=int, default=16)
    parser.add_argument("--inflight", type=int, default=64, help="chunks each engine's KV holds, about")
    parser.add_argument("--decisions", type=int, default=50_000)
    args = parser.parse_args()
    seconds, made, min_waiting = run(args.policy, args.requests, args.engines, args.inflight, args.decisions)
    print(f"{args.policy}: {made} chunk decisions in {seconds:.2f} s CPU = {made / seconds:,.0f} decisions/s "
          f"({args.engines} engines, >= {min_waiting} requests waiting throughout)")


if __name__ == "__main__":
    main()
