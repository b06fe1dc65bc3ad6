"""Engine runs for the speculative-decoding fidelity tests (tests/engine/test_sd_fidelity.py),
each in its own subprocess so its engine is gone before the next starts.

stdin: JSON {"mode": ..., "model": ...} plus the mode's fields; stdout: one line
"SEER_SD_RESULT {json}".

- ``sample``: offline ``vllm.LLM``; ``n`` seeded samples of ``prompt`` at temperature 1.0,
  2 tokens each. With ``draft_token`` set, speculative decoding is on with
  ``FixedDraftProposer`` below (every row gets that one token as its draft after its first
  token), so the second token is always a verified draft position. Returns the (x1, x2)
  pairs, whether Seer's plugin fix is in the worker, and, for the most frequent x1, the
  top-``top`` logprobs of the next token without SD (temperature 1: raw = sampled).
- ``grouped``: Seer's ``VLLMBackend`` with grouped SD (fixed gamma); each prompt as a group
  of two requests, once as one chunk per request (the group policy) and once in
  ``chunk_tokens`` chunks (the divided policy's continuation, prompt + output so far):
  greedy and drafting (``whole`` / ``divided``), then seeded at temperature 1.0 with
  drafting turned off per chunk, ``ChunkTask.draft = False`` (``seeded_whole`` /
  ``seeded_divided``), and the seeded chunks once more while greedy drafting groups share
  the engine's steps (``seeded_mixed``: only the seeded outputs are reported). Each run
  reports its outputs, logprobs and the SD counters it moved.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections import Counter


class FixedDraftProposer:
    """A ``custom_class`` proposer that drafts one fixed token (env SEER_TEST_DRAFT_TOKEN)."""

    def __init__(self, vllm_config: object) -> None:
        self.token = int(os.environ["SEER_TEST_DRAFT_TOKEN"])

    def load_model(self, *args: object, **kwargs: object) -> None:
        return

    def propose(self, sampled_token_ids: list[list[int]], *args: object, **kwargs: object) -> list[list[int]]:
        return [[self.token] if s else [] for s in sampled_token_ids]


def _sample(spec: dict) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    draft = spec.get("draft_token")
    if draft is not None:
        os.environ["SEER_TEST_DRAFT_TOKEN"] = str(draft)
    llm = LLM(model=spec["model"], dtype="float32", max_model_len=512, enforce_eager=True, seed=0,
              enable_chunked_prefill=False,  # seeded requests: see engines/vllm_args.py
              worker_extension_cls="seer.engines.vllm_worker_ext.SeerWorkerExtension",
              speculative_config=None if draft is None else {
                  "method": "custom_class", "model": "tests.engine.sd_sampling.FixedDraftProposer", "num_speculative_tokens": 1})
    fix = llm.collective_rpc("seer_expand_fix_installed")
    prompt = TokensPrompt(prompt_token_ids=spec["prompt"])
    params = [SamplingParams(temperature=1.0, max_tokens=2, seed=1000 + i, ignore_eos=True) for i in range(spec["n"])]
    outs = llm.generate([prompt] * spec["n"], params, use_tqdm=False)
    pairs = [list(o.outputs[0].token_ids) for o in outs]
    x1 = Counter(p[0] for p in pairs).most_common(1)[0][0]
    ref = llm.generate([TokensPrompt(prompt_token_ids=spec["prompt"] + [x1])],
                       SamplingParams(temperature=1.0, max_tokens=1, logprobs=spec.get("top", 20)), use_tqdm=False)
    top = {int(t): lp.logprob for t, lp in ref[0].outputs[0].logprobs[0].items()}
    return {"pairs": pairs, "x1": x1, "top": top, "fix_installed": all(fix)}


async def _grouped(spec: dict) -> dict:
    from seer.config import SpeculativeConfig
    from seer.engines.vllm_backend import VLLMBackend
    from seer.protocol import ChunkTask, EngineSampling, pack_token_ids

    backend = VLLMBackend(spec["model"], dtype="float32", max_model_len=1024, enforce_eager=True,
                          gpu_memory_utilization=0.85, logprobs_mode="raw",
                          speculative=SpeculativeConfig(method="grouped", gamma_max=4, adaptive=False))
    caps = await backend.start()
    ids = iter(range(1, 1_000_000))
    max_tokens, chunk = spec["max_tokens"], spec["chunk_tokens"]

    def task(group: str, request: str, prompt: list[int], done: list[int], budget: int,
             seed: int | None) -> ChunkTask:
        # seed None: greedy and drafting; a seed: temperature 1.0 and no drafts for this chunk.
        sampling = EngineSampling(max_tokens=budget, temperature=0.0 if seed is None else 1.0, top_p=1.0, top_k=-1,
                                  min_tokens=0, seed=seed, stop=[], stop_token_ids=[], ignore_eos=False)
        return ChunkTask(task_id=next(ids), request_id=request, group_id=group,
                         prompt_token_ids=pack_token_ids(prompt + done), sampling=sampling,
                         num_generated_tokens=len(done), draft=seed is None)

    async def whole(group: str, request: str, prompt: list[int], seed: int | None) -> tuple[list[int], list[float]]:
        out = await backend.generate(task(group, request, prompt, [], max_tokens, seed))
        return out.token_ids, out.logprobs

    async def divided(group: str, request: str, prompt: list[int], seed: int | None) -> tuple[list[int], list[float]]:
        done: list[int] = []
        logprobs: list[float] = []
        while len(done) < max_tokens:
            out = await backend.generate(task(group, request, prompt, done, min(chunk, max_tokens - len(done)), seed))
            done += out.token_ids
            logprobs += out.logprobs
            if out.finish_reason != "length":
                break
        return done, logprobs

    try:
        result = {}
        for name, run, seeded in (("whole", whole, False), ("divided", divided, False),
                                  ("seeded_whole", whole, True), ("seeded_divided", divided, True)):
            before = backend.spec_counts()
            outs = await asyncio.gather(*(run(f"{name}-q{p}", f"{name}-q{p}/{g}", prompt,
                                              1000 + 2 * p + g if seeded else None)
                                          for p, prompt in enumerate(spec["prompts"]) for g in range(2)))
            after = backend.spec_counts()
            result[name] = {"outputs": [o[0] for o in outs], "logprobs": [o[1] for o in outs],
                            "draft_tokens": after[1] - before[1], "accepted_tokens": after[2] - before[2]}
        # The seeded chunks again, sharing the engine's steps with greedy drafting groups.
        before = backend.spec_counts()
        seeded = [divided(f"mixed-q{p}", f"mixed-q{p}/{g}", prompt, 1000 + 2 * p + g)
                  for p, prompt in enumerate(spec["prompts"]) for g in range(2)]
        drafting = [whole(f"mixed-drafting-q{p}", f"mixed-drafting-q{p}/{g}", prompt, None)
                    for p, prompt in enumerate(spec["prompts"]) for g in range(2)]
        outs = (await asyncio.gather(*seeded, *drafting))[:len(seeded)]
        after = backend.spec_counts()
        result["seeded_mixed"] = {"outputs": [o[0] for o in outs], "logprobs": [o[1] for o in outs],
                                  "draft_tokens": after[1] - before[1], "accepted_tokens": after[2] - before[2]}
        # Seeded chunks admitted with exactly one token left to compute: each prompt is padded
        # (repeated) to block_size - EDGE + 1 tokens and its first chunk takes EDGE tokens, so
        # the continuation's first block_size tokens are one full block in vLLM's prefix cache
        # (the first chunk computed them). One request at a time, so no other prefill shares
        # the step. Reported next to the same padded prompts generated in one chunk.
        edge = spec.get("edge_first_chunk", 8)
        edge_prompts = [(prompt * (caps.block_size // len(prompt) + 1))[-(caps.block_size - edge + 1):]
                        for prompt in spec["prompts"]]
        edge_runs: dict[str, list] = {"seeded_edge_whole": [], "seeded_edge_split": []}
        first_chunks = []
        for p, prompt in enumerate(edge_prompts):
            seed = 2000 + p
            edge_runs["seeded_edge_whole"].append(await whole(f"edge-w{p}", f"edge-w{p}/0", prompt, seed))
            out = await backend.generate(task(f"edge-s{p}", f"edge-s{p}/0", prompt, [], edge, seed))
            done, logprobs = list(out.token_ids), list(out.logprobs)
            first_chunks.append(len(done))
            if out.finish_reason == "length":
                rest = await backend.generate(task(f"edge-s{p}", f"edge-s{p}/0", prompt, done, max_tokens - edge, seed))
                done += rest.token_ids
                logprobs += rest.logprobs
            edge_runs["seeded_edge_split"].append((done, logprobs))
        for name, outs in edge_runs.items():
            result[name] = {"outputs": [o[0] for o in outs], "logprobs": [o[1] for o in outs]}
        result["seeded_edge_split"]["first_chunks"] = first_chunks
        result["seeded_edge_split"]["prompt_tokens"] = [len(p) for p in edge_prompts]
        result["block_size"] = caps.block_size
        return result
    finally:
        await backend.shutdown()


if __name__ == "__main__":
    spec = json.loads(sys.stdin.read())
    result = _sample(spec) if spec["mode"] == "sample" else asyncio.run(_grouped(spec))
    print("SEER_SD_RESULT " + json.dumps(result), flush=True)
