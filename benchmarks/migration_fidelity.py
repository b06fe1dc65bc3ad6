"""How faithful is a response generated in chunks that move between engines?

For one dtype: greedy one-shot outputs from vLLM's own ``LLM.generate`` (a subprocess,
before any Seer engine starts) against Seer with two engines, the ``divided`` policy,
``placement = "migrate"`` (every chunk on the other engine) and, in turn,
(a) the prefix's KV loaded from the host pool, (b) the prefix re-prefilled
(``kv_pool.enabled = false``). Reports per mode how many samples match one-shot token
for token, where the first divergence happens, and the largest logprob difference over
the common prefix.

    .venv/bin/python benchmarks/migration_fidelity.py --dtype bfloat16 --max-tokens 128
    .venv/bin/python benchmarks/migration_fidelity.py --dtype float32 --max-tokens 128
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

QUESTIONS = [
    "What is 12 times 7? Explain your steps.",
    "Write a short story about a lighthouse keeper.",
    "Explain how a bicycle stays upright.",
    "List five uses of a paperclip and explain each one.",
    "Describe the water cycle for a ten-year-old.",
    "Why do leaves change colour in autumn?",
    "Give three tips for learning a new language, with reasons.",
    "What happens when you mix baking soda and vinegar?",
]


def reference(spec: dict) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=spec["model"], dtype=spec["dtype"], max_model_len=spec["max_model_len"], enforce_eager=True)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]],
                        SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], logprobs=0))
    print("SEER_REFERENCE " + json.dumps([
        {"token_ids": list(o.outputs[0].token_ids),
         "logprobs": [pos[t].logprob for pos, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]}
        for o in outs]), flush=True)


def seer_run(dtype: str, prompts: list[list[int]], max_tokens: int, chunk: int, pool: bool) -> tuple[list, Path]:
    from seer.cli.daemon import start_background, stop
    from seer.client import SamplingParams, SeerClient
    from seer.config import default_cache_dir

    root = Path(tempfile.mkdtemp(prefix="seer-fidelity-"))
    config = root / "seer.toml"
    config.write_text(f"""
[model]
dtype = "{dtype}"
max_model_len = 1024
[engines]
count = 2
[scheduler]
chunk_size_tokens = {chunk}
placement = "migrate"
[kv_pool]
enabled = {"true" if pool else "false"}
min_load_tokens = 1
""")
    run_dir = root / "run"
    info = start_background(str(config), run_dir, default_cache_dir(), 1200)
    try:
        with SeerClient(info["client_address"], timeout_s=900) as client:
            result = client.rollout([{"prompt_token_ids": p} for p in prompts], 1,
                                    SamplingParams(temperature=0.0, max_tokens=max_tokens), policy="divided")
    finally:
        stop(run_dir, 120)
    return [g.samples[0] for g in result.groups], run_dir


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--chunk", type=int, default=16)
    parser.add_argument("--reference", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.reference:
        reference(json.loads(sys.stdin.read()))
        return 0
    from transformers import AutoTokenizer

    from seer.config import default_cache_dir

    model = str(default_cache_dir() / "models" / "SmolLM2-135M-Instruct")
    tok = AutoTokenizer.from_pretrained(model)
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True,
                                       return_dict=False) for q in QUESTIONS]
    spec = {"model": model, "dtype": args.dtype, "max_model_len": 1024, "prompts": prompts,
            "max_tokens": args.max_tokens}
    proc = subprocess.run([sys.executable, __file__, "--reference"], input=json.dumps(spec), capture_output=True,
                          text=True, env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}, check=True)
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("SEER_REFERENCE "))
    refs = json.loads(line.removeprefix("SEER_REFERENCE "))
    print(f"{len(prompts)} chat prompts, greedy, {args.max_tokens} tokens, {args.dtype}, chunks of {args.chunk} "
          "tokens, every chunk on the other engine (2 engines); one-shot = vLLM LLM.generate")
    print("| prefix KV of a moved chunk | samples equal to one-shot | first divergence (token index) "
          "| max logprob diff before it |")
    print("|---|---|---|---|")
    for pool in (True, False):
        samples, run_dir = seer_run(args.dtype, prompts, args.max_tokens, args.chunk, pool)
        equal, firsts, diffs = 0, [], []
        for s, ref in zip(samples, refs):
            n = next((i for i, (a, b) in enumerate(zip(s.token_ids, ref["token_ids"])) if a != b), None)
            if n is None and len(s.token_ids) == len(ref["token_ids"]):
                equal += 1
            else:
                firsts.append(n if n is not None else min(len(s.token_ids), len(ref["token_ids"])))
            common = firsts[-1] if n is not None else min(len(s.token_ids), len(ref["token_ids"]))
            diffs.append(max((abs(a - b) for a, b in zip(s.logprobs[:common], ref["logprobs"][:common])),
                             default=0.0))
        label = "loaded from the pool" if pool else "re-prefilled (pool off)"
        print(f"| {label} | {equal} / {len(samples)} | {sorted(firsts) or '-'} | {max(diffs):.2e} |")
        print(f"  (logs: {run_dir})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
