"""Multi-turn trajectories on the real engines (the shared two-engine vLLM daemon):
a feedback environment on arithmetic questions, its answers appended as SmolLM2's chat
template renders them, seeded trajectories token-identical under ``sticky`` and
``divided`` (every chunk of which moves to the other engine: ``placement = "migrate"``),
and later turns reusing the earlier turns' KV: from vLLM's prefix cache on the same
engine, from the host KV pool on the other."""

from __future__ import annotations

import pytest

from seer.agentic import EnvReply, Turn
from seer.client import SamplingParams, SeerClient
from seer.controlplane.tokenizer import HFTokenizer
from seer.protocol import ChatMessage, TrajectorySpec

QUESTIONS = [("What is 12 times 7? Answer with the number only.", "84"),
             ("What is 9 plus 15? Answer with the number only.", "24")]
FEEDBACK = "That is not right. Think again and answer with the number only."


def arithmetic(turn: Turn) -> EnvReply:
    """Right answer: done, reward 1. Wrong: feedback, up to the trajectory's last turn."""
    answer = QUESTIONS[turn.group_index][1]
    if answer in turn.text:
        return EnvReply(done=True, reward=1.0)
    return EnvReply(messages=[ChatMessage(role="user", content=FEEDBACK)], reward=0.0, tool_name="judge")


def run(client: SeerClient, policy: str):
    return client.rollout([{"messages": [{"role": "user", "content": q}]} for q, _ in QUESTIONS], group_size=2,
                          sampling=SamplingParams(max_tokens=24, temperature=1.0, seed=17), policy=policy,
                          env=arithmetic, trajectory=TrajectorySpec(max_turns=3), speculative=False)


@pytest.mark.timeout(900)
def test_seeded_feedback_trajectories_are_identical_under_every_policy(vllm_daemon, model_dir):
    tok = HFTokenizer(str(model_dir))
    with SeerClient(vllm_daemon.address, timeout_s=300) as client:
        results = {policy: run(client, policy) for policy in ("sticky", "divided")}
    samples = {policy: [s for g in r.groups for s in g.samples] for policy, r in results.items()}
    assert [(s.token_ids, s.loss_mask) for s in samples["sticky"]] == \
        [(s.token_ids, s.loss_mask) for s in samples["divided"]]
    multi = same_engine = 0
    for s in samples["sticky"]:
        assert len(s.token_ids) == len(s.loss_mask) == len(s.logprobs)
        assert 1 <= len(s.turns) <= 3
        assert all(lp <= 0.0 for lp, m in zip(s.logprobs, s.loss_mask) if m == 1)
        for k, turn in enumerate(s.turns[:-1]):
            assert turn.outcome == "continue"
            nxt = s.turns[k + 1]
            ended_with_eos = s.token_ids[turn.end - 1] == tok.eos_token_id
            expected = tok.encode_turn_suffix([ChatMessage(role="user", content=FEEDBACK)], ended_with_eos)
            assert s.token_ids[turn.end:nxt.start] == expected
            assert s.loss_mask[turn.end:nxt.start] == [0] * len(expected)
            multi += 1
            if nxt.engine_ids[0] == turn.engine_ids[-1]:
                # Back on its engine (always, under sticky): the previous turn's whole
                # context (its prompt) is in that engine's prefix cache, in full blocks.
                assert nxt.reused_tokens >= (s.num_prompt_tokens + turn.start) // 16 * 16, (turn, nxt)
                same_engine += 1
        assert s.turns[-1].outcome in ("done", "max_turns")
        assert s.reward in (0.0, 1.0)
        assert s.finish_reason in ("stop", "length", "max_turns")
    assert multi > 0, "no trajectory had a second turn: the feedback path was not exercised"
    assert same_engine == multi  # sticky: every later turn on its trajectory's engine
    # Forced migrations, and the earlier turns' KV from the host pool: under ``divided``
    # every chunk moves to the other engine, and a turn's KV is saved as it goes
    # (``KVDescriptor.save_each_step``), so a later turn on the other engine prefills
    # little more than the appended tokens.
    for policy in ("sticky", "divided"):
        print(policy, "recomputed per later turn:", [t.recomputed_tokens for s in samples[policy] for t in s.turns[1:]],
              "reused:", [t.reused_tokens for s in samples[policy] for t in s.turns[1:]])
    for s in samples["divided"]:
        for turn, nxt in zip(s.turns, s.turns[1:]):
            assert nxt.reused_tokens >= (s.num_prompt_tokens + turn.end - 1) // 16 * 16, (turn, nxt)
    assert any(len(set(t.engine_ids)) > 1 or t.engine_ids != s.turns[0].engine_ids
               for s in samples["divided"] for t in s.turns)


@pytest.mark.timeout(900)
def test_greedy_trajectories_equal_one_engine_running_them_alone(vllm_daemon, model_dir, trajectory_reference):
    """Greedy trajectories with a fixed tool answer after each turn, under ``context`` (every
    chunk, so every turn boundary, moves to the other engine: ``placement = "migrate"``)
    and ``sticky`` (every turn on its first engine): token for token what one vLLM engine
    alone generates for the same turns (``reference_generate.py``, before Seer started),
    with the same turn spans."""
    from tests.engine.conftest import (TRAJECTORY_MAX_TOKENS, TRAJECTORY_QUESTIONS, TRAJECTORY_TOOL,
                                       TRAJECTORY_TURNS, _chat)

    def tool(turn: Turn) -> EnvReply:
        return EnvReply(messages=[ChatMessage(role="tool", content=TRAJECTORY_TOOL)], tool_name="calc")

    prompts = [{"prompt_token_ids": ids} for ids in _chat(model_dir, TRAJECTORY_QUESTIONS)]
    with SeerClient(vllm_daemon.address, timeout_s=300) as client:
        results = {policy: client.rollout(prompts, group_size=2, policy=policy, env=tool, speculative=False,
                                          sampling=SamplingParams(max_tokens=TRAJECTORY_MAX_TOKENS, temperature=0.0),
                                          trajectory=TrajectorySpec(max_turns=TRAJECTORY_TURNS))
                   for policy in ("context", "sticky")}
    moved = 0
    for policy, result in results.items():
        for group, ref in zip(result.groups, trajectory_reference, strict=True):
            for s in group.samples:
                assert s.token_ids == ref["token_ids"], (policy, group.group_index, s.sample_index)
                assert [[t.start, t.end] for t in s.turns] == ref["turns"]
                assert s.finish_reason == "max_turns"
                moved += sum(len(t.engine_ids) > 1 for t in s.turns) if policy == "context" else 0
    assert moved > 0, "no turn moved between engines under context: the migration path was not exercised"
