"""Reference outputs from vLLM's own offline ``LLM.generate`` (run as a subprocess by
the engine tests, so its engine is gone before Seer's start).

stdin: {"model", "dtype", "max_model_len", "prompts": [[ids]], "max_tokens"}, optionally
"trajectories": [{"prompt": [ids], "turns": T, "max_tokens": n, "suffix": [ids], "suffix_eos": [ids]}]
and "eos": id -- multi-turn greedy trajectories run by this one engine alone: each turn
generates up to n tokens from the whole context so far, then ``suffix_eos`` (the turn ended
with EOS) or ``suffix`` is appended, for T turns (no suffix after the last).
stdout (the line starting "SEER_REFERENCE "): {"outputs": [{"token_ids": [...], "logprobs": [...]}],
"trajectories": [{"token_ids": [...every token after the prompt...], "turns": [[start, end], ...]}]}
"""

import json
import sys

if __name__ == "__main__":
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    spec = json.loads(sys.stdin.read())
    llm = LLM(model=spec["model"], dtype=spec["dtype"], max_model_len=spec["max_model_len"], enforce_eager=True)
    params = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], logprobs=0)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]], params)
    result = []
    for out in outs:
        comp = out.outputs[0]
        result.append({"token_ids": list(comp.token_ids),
                       "logprobs": [pos[t].logprob for pos, t in zip(comp.logprobs, comp.token_ids)]})
    trajectories = spec.get("trajectories", [])
    contexts = [list(t["prompt"]) for t in trajectories]
    after = [{"token_ids": [], "turns": []} for _ in trajectories]
    for k in range(max((t["turns"] for t in trajectories), default=0)):
        live = [i for i, t in enumerate(trajectories) if k < t["turns"]]
        outs = llm.generate([TokensPrompt(prompt_token_ids=contexts[i]) for i in live],
                            [SamplingParams(temperature=0.0, max_tokens=trajectories[i]["max_tokens"]) for i in live])
        for i, out in zip(live, outs):
            ids = list(out.outputs[0].token_ids)
            start = len(after[i]["token_ids"])
            after[i]["turns"].append([start, start + len(ids)])
            tail = ids
            if k + 1 < trajectories[i]["turns"]:
                ended_with_eos = bool(ids) and ids[-1] == spec["eos"]
                tail = ids + trajectories[i]["suffix_eos" if ended_with_eos else "suffix"]
            after[i]["token_ids"] += tail
            contexts[i] += tail
    print("SEER_REFERENCE " + json.dumps({"outputs": result, "trajectories": after}), flush=True)
