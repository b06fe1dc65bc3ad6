"""Benchmark: speculative decoding in a rollout on real vLLM — no SD, Seer's grouped proposer
(adaptive, with and without drafts from history, or a fixed draft length), and vLLM's
``ngram`` and ``suffix``.

Each method runs in a fresh subprocess: one ``VLLMBackend`` (Seer's engine backend,
float32, eager, the bundled SmolLM2), then the same workload at each temperature, each
``--epochs`` times: P prompts of ``examples/math_prompts.jsonl`` (from ``--first-prompt``:
a held-out set) x G samples, every sample one ``ChunkTask`` (one chunk per request, as the
group policy sends them), all submitted at once. An epoch's groups are new groups of the
same prompts (a later rollout), so epoch 2 can draft from epoch 1 (history). The method
list runs ``--reps`` times, interleaved (A B C A B C), and ratios pair runs of the same
repetition.

Reported per method, temperature and epoch: output tokens/s, tail time (from the moment
90 % of the requests have finished to the end, the paper's definition), the tail phase's
engine steps and tokens per step (all rows), accepted drafts per step in the tail, mean
tokens per drafting row-step and acceptance (vLLM's own counters), and the mean logprob of
the sampled tokens (SD must not move it). Sampled SD numbers count only with Seer's plugin
fix, which ``VLLMBackend`` checks in the worker at start-up.

    .venv/bin/python benchmarks/sd_rollout.py --methods none,grouped --first-prompt 16 --prompts 8 \\
        --group-size 8 --max-tokens 2048 --max-model-len 4096 --temperatures 1.0 --reps 2
    # drafts from history: two epochs, with and without
    .venv/bin/python benchmarks/sd_rollout.py --methods grouped-nohist,grouped --epochs 2 ...
    PYTHONPATH=/tmp/arctic/site .venv/bin/python benchmarks/sd_rollout.py --methods none,suffix   # 'suffix'
    # the tail phase of `rollout_policies.py --out` runs, from their daemon's logs
    .venv/bin/python benchmarks/sd_rollout.py --tail-from runs/policies.json

``suffix`` needs arctic-inference importable (docs/speculative-decoding.md); it is skipped
with a message otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
METHODS = {  # name -> [speculative] settings
    "none": {"method": "off"},
    "ngram": {"method": "ngram"},
    "suffix": {"method": "suffix"},
    "grouped": {"method": "grouped"},
    "grouped-nohist": {"method": "grouped", "history_max_tokens": 0},
    "grouped-fixed": {"method": "grouped", "adaptive": False},
}


def _prompts(model: str, first: int, count: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    rows = [json.loads(line) for line in (REPO / "examples" / "math_prompts.jsonl").read_text().splitlines() if line]
    return [tok.apply_chat_template(r["messages"], add_generation_prompt=True, tokenize=True, return_dict=False)
            for r in rows[first:first + count]]


def _counters(backend) -> tuple[int, int, int, int, int]:
    """(steps, generated tokens, drafting row-steps, draft tokens, accepted) so far."""
    r = backend._recorder
    return (r.num_steps, r.num_generated_tokens, *r.spec_counts)


async def _run_method(name: str, args: argparse.Namespace) -> list[dict]:
    from seer.config import SpeculativeConfig
    from seer.engines import model_store
    from seer.engines.vllm_backend import VLLMBackend
    from seer.protocol import ChunkTask, EngineSampling, pack_token_ids

    model = args.model or str(model_store.model_dir(Path.home() / ".cache" / "seer"))
    prompts = _prompts(model, args.first_prompt, args.prompts)
    spec = SpeculativeConfig(gamma_max=args.gamma_max, **METHODS[name])
    backend = VLLMBackend(model, dtype="float32", max_model_len=args.max_model_len or args.max_tokens + 512,
                          enforce_eager=True, gpu_memory_utilization=0.85, logprobs_mode="raw", speculative=spec)
    await backend.start()
    results = []
    task_id = 0
    try:
        for temperature in args.temperatures:
            for epoch in range(args.epochs):
                tasks = []
                for p, prompt in enumerate(prompts):
                    group = f"q{p}@{temperature}#e{epoch}"
                    for g in range(args.group_size):
                        task_id += 1
                        tasks.append(ChunkTask(
                            task_id=task_id, request_id=f"{group}/{g}", group_id=group,
                            prompt_token_ids=pack_token_ids(prompt), num_generated_tokens=0, probe=g == 0,
                            sampling=EngineSampling(max_tokens=args.max_tokens, temperature=temperature, top_p=1.0,
                                                    top_k=-1, min_tokens=0, seed=None, stop=[], stop_token_ids=[],
                                                    ignore_eos=False)))
                before = _counters(backend)
                load_before = os.getloadavg()[0]
                t0 = time.monotonic()
                finished_at: list[float] = []
                tail_count = max(1, int(0.9 * len(tasks)))
                at_tail: list[tuple[int, ...]] = []

                async def one(task: ChunkTask) -> object:
                    out = await backend.generate(task)
                    finished_at.append(time.monotonic() - t0)
                    if len(finished_at) == tail_count:
                        at_tail.append(_counters(backend))
                    return out

                outs = await asyncio.gather(*(one(t) for t in tasks))
                wall_s = time.monotonic() - t0
                after = _counters(backend)
                steps, generated, drafts, draft_tokens, accepted = (a - b for a, b in zip(after, before, strict=True))
                tail = [a - b for a, b in zip(after, at_tail[0] if at_tail else after, strict=True)]
                finished_at.sort()
                tokens = sum(len(o.token_ids) for o in outs)  # type: ignore[attr-defined]
                logprobs = [lp for o in outs for lp in o.logprobs]  # type: ignore[attr-defined]
                results.append({
                    "method": name, "temperature": temperature, "epoch": epoch, "requests": len(tasks),
                    "tokens": tokens, "wall_s": wall_s, "tok_s": tokens / wall_s,
                    "tail_s": wall_s - finished_at[tail_count - 1],
                    "tail_steps": tail[0], "tail_tokens": tail[1], "tail_drafts": tail[2], "tail_accepted": tail[4],
                    "steps": steps, "drafts": drafts, "draft_tokens": draft_tokens, "accepted_tokens": accepted,
                    "lengths": sorted(len(o.token_ids) for o in outs),  # type: ignore[attr-defined]
                    "mean_logprob": sum(logprobs) / max(1, len(logprobs)),
                    "load_before": load_before, "load_after": os.getloadavg()[0],
                    "proposer": (await backend.draft_stats())[0] if spec.method == "grouped" else {},
                })
    finally:
        await backend.shutdown()
    return results


def _ratio(rows: list[dict], r: dict, key: str, minimum: float = 0.0) -> float | None:
    base = next((b for b in rows if b["method"] == "none" and b["rep"] == r["rep"]
                 and b["temperature"] == r["temperature"] and b["epoch"] == r["epoch"]), None)
    if base is None or base[key] <= minimum:
        return None
    return r[key] / base[key]


def print_table(rows: list[dict], args: argparse.Namespace) -> None:
    print(f"vLLM (VLLMBackend), float32, eager; prompts {args.first_prompt}..{args.first_prompt + args.prompts - 1} "
          f"x {args.group_size} samples, max_tokens {args.max_tokens}, max_model_len "
          f"{args.max_model_len or args.max_tokens + 512}, gamma_max {args.gamma_max}, {args.reps} interleaved rep(s)")
    print("x = ratio to no SD in the same repetition, temperature and epoch; tail = after 90 % of requests "
          "finished; tail tok/step = tokens per engine step in the tail (all rows); tail acc/step = accepted "
          "drafts per engine step in the tail; tok/drafting = 1 + accepted per drafting row-step")
    head = (f"{'method':<15}{'T':>4}{'ep':>3}{'rep':>4}{'tokens':>8}{'wall s':>8}{'tok/s':>7}{'x':>6}{'tail s':>8}"
            f"{'x':>6}{'tail steps':>11}{'tail tok/step':>14}{'tail acc/step':>14}{'tok/drafting':>13}{'acc %':>6}"
            f"{'logprob':>8}{'load':>10}")
    print(head)
    for r in rows:
        speed = _ratio(rows, r, "tok_s")
        tail = _ratio(rows, r, "tail_s", minimum=1.0)
        tail_tok = f"{r['tail_tokens'] / r['tail_steps']:.2f}" if r["tail_steps"] else "-"
        tail_acc = f"{r['tail_accepted'] / r['tail_steps']:.2f}" if r["tail_steps"] else "-"
        per_step = f"{1 + r['accepted_tokens'] / r['drafts']:.2f}" if r["drafts"] else "-"
        acc = f"{100 * r['accepted_tokens'] / r['draft_tokens']:.0f}" if r["draft_tokens"] else "-"
        print(f"{r['method']:<15}{r['temperature']:>4.1f}{r['epoch'] + 1:>3}{r['rep'] + 1:>4}{r['tokens']:>8}"
              f"{r['wall_s']:>8.1f}{r['tok_s']:>7.1f}{f'{speed:.2f}' if speed else '-':>6}{r['tail_s']:>8.1f}"
              f"{f'{tail:.2f}' if tail else '-':>6}{r['tail_steps']:>11}{tail_tok:>14}{tail_acc:>14}{per_step:>13}"
              f"{acc:>6}{r['mean_logprob']:>8.2f}{r['load_before']:>5.1f}/{r['load_after']:<4.1f}")
    methods = list(dict.fromkeys(r["method"] for r in rows if r["method"] != "none"))
    for method in methods:
        for temperature in args.temperatures:
            for epoch in range(args.epochs):
                mine = [r for r in rows if (r["method"], r["temperature"], r["epoch"]) == (method, temperature, epoch)]
                speeds = [x for x in (_ratio(rows, r, "tok_s") for r in mine) if x]
                tails = [x for x in (_ratio(rows, r, "tail_s", 1.0) for r in mine) if x]
                if speeds:
                    print(f"{method} T={temperature} epoch {epoch + 1}: paired median x none "
                          f"{statistics.median(speeds):.2f}"
                          + (f", tail x none {statistics.median(tails):.2f}" if tails else ""))
    for r in rows:
        p = r["proposer"]
        if p:
            print(f"{r['method']} T={r['temperature']} epoch {r['epoch'] + 1} rep {r['rep'] + 1}: drafted "
                  f"{p['drafted_rows']} row-steps in {p['steps']} steps (steps by longest draft {p['gamma_steps']}), "
                  f"{p['draft_s']:.1f} s drafting; step fit {p['step_fixed_s'] * 1e3:.0f} ms + "
                  f"{p['step_per_seq_s'] * 1e3:.2f} ms/seq + {p['step_per_token_s'] * 1e3:.2f} ms/token + "
                  f"{p['step_per_context_token_s'] * 1e6:.2f} us/context token + "
                  f"{p['step_per_attended_token_s'] * 1e6:.3f} us/attended token ({p['step_observations']} steps, "
                  f"{p['step_refused']} refused); alpha {p['population_alpha']:.2f}; history drafts "
                  f"{p['history_drafts']} ({p['history_accepted_tokens']} accepted), retired age "
                  f"{p['history_retired_age']}")


def tail_from_logs(policies_json: Path) -> list[dict]:
    """The tail phase of each rollout of a ``benchmarks/rollout_policies.py --out`` file,
    from its daemon's logs: the control plane's rollout records give each rollout's end and
    tail time, the engines' step records (``engine_steps``) what every engine step in that
    window did. Per run: engine steps (all engines), tokens per step, accepted drafts per
    step, tokens per drafting row-step."""
    from seer.controlplane.trace import build_trace, read_log

    saved = json.loads(policies_json.read_text())
    run_dir = Path(saved["run_dir"])
    trace = build_trace(*read_log(run_dir))
    steps: list[list[float]] = []
    for log_file in sorted(run_dir.glob("engine-*.log")):
        for line in log_file.read_text().splitlines():
            if '"engine_steps"' in line:
                steps.extend(json.loads(line)["steps"])
    out = []
    for run in saved["runs"]:
        record = trace.rollouts.get(run["rollout_id"])
        if record is None or record.ended_s is None or record.tail_time_s is None:
            continue
        start = record.ended_s - record.tail_time_s
        window = [st for st in steps if start <= st[0] <= record.ended_s and len(st) >= 8]
        n = len(window)
        generated = sum(st[3] for st in window)
        drafting, accepted = sum(st[5] for st in window), sum(st[7] for st in window)
        out.append({"policy": run["policy"], "rep": run["rep"], "tail_s": record.tail_time_s, "tail_steps": n,
                    "tail_tokens_per_step": generated / n if n else 0.0,
                    "tail_accepted_per_step": accepted / n if n else 0.0,
                    "tail_tokens_per_drafting_row_step": 1 + accepted / drafting if drafting else 0.0})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", default="none,grouped")
    parser.add_argument("--temperatures", default="1.0")
    parser.add_argument("--first-prompt", type=int, default=16, help="prompts before this one are not used (held out)")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=2048)
    parser.add_argument("--max-model-len", type=int, default=4096, help="0: max_tokens + 512")
    parser.add_argument("--gamma-max", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=1, help="rollouts of the same prompts per temperature")
    parser.add_argument("--reps", type=int, default=1, help="interleaved repetitions of the method list")
    parser.add_argument("--kv-gib", type=int, default=2)
    parser.add_argument("--model", default=None)
    parser.add_argument("--json", default=None, help="also write the rows to this file (after every run)")
    parser.add_argument("--replot", default=None, metavar="JSON", help="run nothing: print the table of a --json file")
    parser.add_argument("--tail-from", default=None, metavar="POLICIES_JSON",
                        help="run nothing: the tail phase of each run of a rollout_policies.py --out file, "
                             "from its daemon's logs (engine step records)")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.temperatures = [float(t) for t in args.temperatures.split(",")]
    if args.tail_from:
        print(f"{'policy':<12}{'rep':>4}{'tail s':>8}{'engine steps':>13}{'tokens/step':>12}{'accepted/step':>14}"
              f"{'tokens/drafting row-step':>25}")
        for r in tail_from_logs(Path(args.tail_from)):
            print(f"{r['policy']:<12}{r['rep'] + 1:>4}{r['tail_s']:>8.1f}{r['tail_steps']:>13}"
                  f"{r['tail_tokens_per_step']:>12.2f}{r['tail_accepted_per_step']:>14.2f}"
                  f"{r['tail_tokens_per_drafting_row_step']:>25.2f}")
        return
    if args.replot:
        rows = json.loads(Path(args.replot).read_text())
        args.reps = 1 + max(r["rep"] for r in rows)
        print_table(rows, args)
        return
    if args.one:
        print("RESULT " + json.dumps(asyncio.run(_run_method(args.one, args))))
        return
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(args.kv_gib), "VLLM_PLUGINS": "seer_fixes"}
    rows: list[dict] = []
    for rep in range(args.reps):
        for name in args.methods.split(","):
            if name not in METHODS:
                raise SystemExit(f"unknown method {name!r}; choose from {', '.join(METHODS)}")
            if name == "suffix" and subprocess.run([sys.executable, "-c", "import arctic_inference"],
                                                   capture_output=True).returncode != 0:
                print("suffix: skipped (arctic_inference is not importable; see the docstring)", file=sys.stderr)
                continue
            cmd = [sys.executable, __file__, "--one", name] + [a for a in sys.argv[1:] if a != "--one"]
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
            if proc.returncode != 0:
                log_path = REPO / "runs" / f"sd_rollout-{name}.stderr.log"
                log_path.parent.mkdir(exist_ok=True)
                log_path.write_text(proc.stderr)
                print(f"{name}: failed (full stderr in {log_path})\n{proc.stderr[-2000:]}", file=sys.stderr)
                continue
            line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
            rows.extend({**r, "rep": rep} for r in json.loads(line.removeprefix("RESULT ")))
            print(f"rep {rep + 1} {name}: done", file=sys.stderr, flush=True)
            if args.json:  # after every run: a long run that is stopped keeps what it measured
                Path(args.json).write_text(json.dumps(rows, indent=1))
    print_table(rows, args)


if __name__ == "__main__":
    main()
