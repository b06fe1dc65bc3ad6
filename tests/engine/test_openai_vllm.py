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


RETRY = "What is 20 + 22? Answer with the number."


def rewriting_agent(ctx: AgentContext) -> dict:
    """Asks, then asks another question in place of the first (a retry), then goes on."""
    from openai import OpenAI

    client = OpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0)
    spans, segments = [], []
    messages = [{"role": "user", "content": QUESTION}]
    for k in range(3):
        if k == 1:
            messages = [{"role": "user", "content": RETRY}]
        reply = client.chat.completions.create(model=ctx.model, messages=messages, max_tokens=24)
        spans.append(reply.choices[0].model_extra["token_ids"])
        segments.append(reply.choices[0].model_extra["seer"]["segment"])
        messages += [{"role": "assistant", "content": reply.choices[0].message.content or ""},
                     {"role": "tool", "content": TOOL}]
    return {"spans": spans, "segments": segments}


@pytest.mark.timeout(600)
def test_a_rewritten_history_runs_as_a_new_segment_on_the_real_engines(vllm_daemon, model_dir):
    """The retry starts segment 1 from its own messages: the first call's tokens are kept
    apart, every answer is its turn's span in its segment, and the new segment's KV is kept
    between its calls like any trajectory's."""
    tok = HFTokenizer(str(model_dir))
    with SeerClient(vllm_daemon.address, timeout_s=600) as client:
        result = client.rollout(["unused"], group_size=4, sampling=SamplingParams(max_tokens=24, seed=5),
                                agent=rewriting_agent, policy="context", trajectory=TrajectorySpec(max_turns=3),
                                speculative=False)
    for s in result.groups[0].samples:
        assert s.agent_return["segments"] == [0, 1, 1] and [t.segment for t in s.turns] == [0, 1, 1]
        (old,) = s.segments
        assert old.prompt_token_ids == tok.encode_chat([ChatMessage(role="user", content=QUESTION)])
        assert old.token_ids[s.turns[0].start:s.turns[0].end] == s.agent_return["spans"][0]
        assert s.prompt_token_ids == tok.encode_chat([ChatMessage(role="user", content=RETRY)])
        assert [s.token_ids[t.start:t.end] for t in s.turns[1:]] == s.agent_return["spans"][1:]
        assert sum(s.loss_mask) == sum(t.end - t.start for t in s.turns[1:])
        assert s.turns[1].recomputed_tokens == 0
    recomputed = sum(s.turns[2].recomputed_tokens for s in result.groups[0].samples)
    context = sum(s.num_prompt_tokens + len(s.token_ids) for s in result.groups[0].samples)
    print(f"new segments: recomputed {recomputed} of {context} context tokens in their second calls")
    assert recomputed <= 0.05 * context
