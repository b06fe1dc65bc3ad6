"""Agents through the OpenAI-compatible endpoint on the real engines (the shared two-engine
vLLM daemon, ``[openai] enabled``): G = 8 plain-``openai`` trajectories per prompt, each
call's answer exactly the span its turn sampled, the tool outputs appended as SmolLM2's
template renders them (mask 0), seeded trajectories token-identical under ``sticky`` and
``context``, and under ``context`` little context computed twice (the pool keeps each
trajectory's KV between calls)."""

from __future__ import annotations

import pytest

from seer.agentic import AgentContext
from seer.client import SamplingParams, SeerClient
from seer.controlplane.tokenizer import HFTokenizer
from seer.protocol import ChatMessage, TrajectorySpec

QUESTION = "What is 17 + 25? Answer with the number."
TOOL = "The calculator says 42."


def agent(ctx: AgentContext) -> dict:
    from openai import OpenAI

    client = OpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0)
    messages = [{"role": "user", "content": QUESTION}]
    spans = []
    for _ in range(2):
        reply = client.chat.completions.create(model=ctx.model, messages=messages, max_tokens=24)
        spans.append(reply.choices[0].model_extra["token_ids"])
        messages += [{"role": "assistant", "content": reply.choices[0].message.content or ""},
                     {"role": "tool", "content": TOOL}]
    return {"spans": spans}


@pytest.mark.timeout(900)
def test_plain_openai_agents_on_the_real_engines_are_token_exact(vllm_daemon, model_dir):
    tok = HFTokenizer(str(model_dir))
    runs = {}
    with SeerClient(vllm_daemon.address, timeout_s=600) as client:
        for policy in ("sticky", "context"):
            runs[policy] = client.rollout(["unused: the agent writes its own messages"], group_size=8,
                                          sampling=SamplingParams(max_tokens=24, seed=3), agent=agent,
                                          policy=policy, trajectory=TrajectorySpec(max_turns=2),
                                          speculative=False)
    samples = {p: r.groups[0].samples for p, r in runs.items()}
    assert [s.token_ids for s in samples["sticky"]] == [s.token_ids for s in samples["context"]]
    prompt = tok.encode_chat([ChatMessage(role="user", content=QUESTION)])
    for s in samples["context"]:
        assert s.num_prompt_tokens == len(prompt)
        assert len(s.turns) == 2 and [s.token_ids[t.start:t.end] for t in s.turns] == s.agent_return["spans"]
        first, second = s.turns
        eos = s.token_ids[first.end - 1] == tok.eos_token_id
        appended = tok.encode_turn_suffix([ChatMessage(role="tool", content=TOOL)], eos)
        assert s.token_ids[first.end:second.start] == appended
        assert s.loss_mask == [1] * first.end + [0] * len(appended) + [1] * (second.end - second.start)
    context = sum(s.num_prompt_tokens + len(s.token_ids) for s in samples["context"])
    recomputed = sum(t.recomputed_tokens for s in samples["context"] for t in s.turns)
    print(f"context: recomputed {recomputed} of {context} context tokens")
    assert recomputed <= 0.05 * context
