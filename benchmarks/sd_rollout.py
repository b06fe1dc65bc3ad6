"""Benchmark: speculative decoding in a rollout on real vLLM — no SD, vLLM's ``ngram`` and
``suffix``, Seer's grouped proposer with a fixed draft length and with the adaptive one.

Each method runs in a fresh subprocess: one ``VLLMBackend`` (Seer's engine backend,
float32, eager, the bundled SmolLM2), then the same workload at each temperature: the
first P prompts of ``examples/math_prompts.jsonl`` x G samples, every sample one
``ChunkTask`` (one chunk per request, as the group policy sends them), all submitted at
once. Reported per method and temperature: output tokens/s over the whole rollout, tail
time (from the moment 90 % of the requests have finished to the end, the paper's
definition), mean tokens per drafting step (1 + accepted drafts per row-step that had
drafts, from vLLM's own spec-decoding counters), acceptance, and the mean logprob of the
sampled tokens (a check that SD sampled correctly: it must match no SD). Sampled SD numbers
count only with Seer's plugin fix, which ``VLLMBackend`` checks in the worker at start-up.

    .venv/bin/python benchmarks/sd_rollout.py --prompts 8 --group-size 8 --max-tokens 256
    PYTHONPATH=/tmp/arctic/site .venv/bin/python benchmarks/sd_rollout.py   # with 'suffix'

``suffix`` needs arctic-inference importable (docs/speculative-decoding.md); it is skipped
with a message otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
METHODS = {  # name -> [speculative] settings
    "none": {"method": "off"},
    "ngram": {"method": "ngram"},
    "suffix": {"method": "suffix"},
    "grouped": {"method": "grouped", "adaptive": False},
    "grouped-adaptive": {"method": "grouped", "adaptive": True},
}


def _prompts(model: str, count: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    rows = [json.loads(line) for line in (REPO / "examples" / "math_prompts.jsonl").read_text().splitlines() if line]
    return [tok.apply_chat_template(r["messages"], add_generation_prompt=True, tokenize=True, return_dict=False)
            for r in rows[:count]]


async def _run_method(name: str, args: argparse.Namespace) -> list[dict]:
    from seer.config import SpeculativeConfig
    from seer.engines import model_store
    from seer.engines.vllm_backend import VLLMBackend
    from seer.protocol import ChunkTask, EngineSampling, pack_token_ids

    model = args.model or str(model_store.model_dir(Path.home() / ".cache" / "seer"))
    prompts = _prompts(model, args.prompts)
    spec = SpeculativeConfig(gamma_max=args.gamma_max, **METHODS[name])
    backend = VLLMBackend(model, dtype="float32", max_model_len=args.max_tokens + 512, enforce_eager=True,
                          gpu_memory_utilization=0.85, logprobs_mode="raw", speculative=spec)
    await backend.start()
    results = []
    task_id = 0
    try:
        for temperature in args.temperatures:
            tasks = []
            for p, prompt in enumerate(prompts):
                for g in range(args.group_size):
                    task_id += 1
                    tasks.append(ChunkTask(
                        task_id=task_id, request_id=f"q{p}/{g}", group_id=f"q{p}@{temperature}",
                        prompt_token_ids=pack_token_ids(prompt), num_generated_tokens=0, probe=g == 0,
                        sampling=EngineSampling(max_tokens=args.max_tokens, temperature=temperature, top_p=1.0,
                                                top_k=-1, min_tokens=0, seed=None, stop=[], stop_token_ids=[],
                                                ignore_eos=False)))
            before = backend.spec_counts()
            load_before = os.getloadavg()[0]
            t0 = time.monotonic()
            finished_at: list[float] = []

            async def one(task: ChunkTask) -> object:
                out = await backend.generate(task)
                finished_at.append(time.monotonic() - t0)
                return out

            outs = await asyncio.gather(*(one(t) for t in tasks))
            wall_s = time.monotonic() - t0
            drafts, draft_tokens, accepted = (a - b for a, b in zip(backend.spec_counts(), before, strict=True))
            finished_at.sort()
            tail_start = finished_at[int(0.9 * len(finished_at)) - 1] if finished_at else 0.0
            tokens = sum(len(o.token_ids) for o in outs)  # type: ignore[attr-defined]
            logprobs = [lp for o in outs for lp in o.logprobs]  # type: ignore[attr-defined]
            results.append({
                "method": name, "temperature": temperature, "requests": len(tasks), "tokens": tokens,
                "wall_s": wall_s, "tok_s": tokens / wall_s, "tail_s": wall_s - tail_start,
                "drafts": drafts, "draft_tokens": draft_tokens, "accepted_tokens": accepted,
                "mean_logprob": sum(logprobs) / max(1, len(logprobs)),
                "load_before": load_before, "load_after": os.getloadavg()[0],
                "proposer": (await backend.draft_stats())[0] if spec.method == "grouped" else {},
            })
    finally:
        await backend.shutdown()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--temperatures", default="1.0,0.6")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--gamma-max", type=int, default=4)
    parser.add_argument("--kv-gib", type=int, default=1)
    parser.add_argument("--model", default=None)
    parser.add_argument("--json", default=None, help="also write the rows to this file")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.temperatures = [float(t) for t in args.temperatures.split(",")]
    if args.one:
        print("RESULT " + json.dumps(asyncio.run(_run_method(args.one, args))))
        return
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(args.kv_gib), "VLLM_PLUGINS": "seer_fixes"}
    rows: list[dict] = []
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
        rows.extend(json.loads(line.removeprefix("RESULT ")))
        print(f"{name}: done {line.removeprefix('RESULT ')}", file=sys.stderr, flush=True)
        if args.json:  # after every method: a long run that is stopped keeps what it measured
            Path(args.json).write_text(json.dumps(rows, indent=1))
    print(f"vLLM (VLLMBackend), float32, eager; {args.prompts} prompts x {args.group_size} samples, "
          f"max_tokens {args.max_tokens}, gamma_max {args.gamma_max}")
    print("x = ratio to no SD at the same temperature; tok/step = 1 + accepted drafts per drafting row-step; "
          "load = 1-min load average before/after")
    head = (f"{'method':<18}{'temp':>5}{'tokens':>8}{'wall s':>8}{'tok/s':>8}{'x':>6}{'tail s':>8}{'x':>6}"
            f"{'tok/step':>9}{'acc %':>7}{'logprob':>9}{'load':>11}")
    print(head)
    base = {r["temperature"]: r for r in rows if r["method"] == "none"}
    for r in rows:
        b = base.get(r["temperature"])
        speed = f"{r['tok_s'] / b['tok_s']:.2f}" if b else "-"
        # A baseline tail under a second (requests ending together at max_tokens) gives no ratio.
        tail = f"{r['tail_s'] / b['tail_s']:.2f}" if b and b["tail_s"] >= 1.0 else "-"
        per_step = f"{1 + r['accepted_tokens'] / r['drafts']:.2f}" if r["drafts"] else "-"
        acc = f"{100 * r['accepted_tokens'] / r['draft_tokens']:.0f}" if r["draft_tokens"] else "-"
        load = f"{r['load_before']:.1f}/{r['load_after']:.1f}"
        print(f"{r['method']:<18}{r['temperature']:>5.1f}{r['tokens']:>8}{r['wall_s']:>8.1f}{r['tok_s']:>8.1f}"
              f"{speed:>6}{r['tail_s']:>8.1f}{tail:>6}{per_step:>9}{acc:>7}{r['mean_logprob']:>9.2f}{load:>11}")
    for r in rows:
        if r["proposer"]:
            p = r["proposer"]
            print(f"{r['method']} @ {r['temperature']}: proposer drafted {p['drafted_rows']} row-steps of "
                  f"{p['steps']} steps, {p['draft_s']:.1f} s drafting; step model fixed {p['step_fixed_s']*1e3:.1f} ms "
                  f"+ {p['step_per_seq_s']*1e3:.2f} ms/seq + {p['step_per_token_s']*1e3:.2f} ms/token; "
                  f"alpha {p['population_alpha']:.2f}")


if __name__ == "__main__":
    main()
