"""Reference outputs from vLLM's own offline ``LLM.generate`` (run as a subprocess by
the engine tests, so its engine is gone before Seer's start).

stdin: {"model", "dtype", "max_model_len", "prompts": [[ids]], "max_tokens"}
stdout (the line starting "SEER_REFERENCE "): {"outputs": [{"token_ids": [...], "logprobs": [...]}]}
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
    print("SEER_REFERENCE " + json.dumps({"outputs": result}), flush=True)
