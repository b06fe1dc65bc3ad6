"""Multi-turn trajectories on a real daemon with simulated engine processes
(``RolloutRequest.trajectory``, ``seer.agentic``): the environment's answers are appended
as the chat template's token ids with loss mask 0, every turn is recorded, and each way a
trajectory can end (done, max_turns, context budget, an environment that raises or does
not answer, a malformed answer) ends that trajectory alone, with its own finish reason.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from seer.agentic import EnvReply, Turn, tool_message
from seer.client import AsyncSeerClient, SamplingParams, SeerClient
from seer.controlplane.tokenizer import ByteTokenizer
from seer.protocol import ChatMessage, TrajectorySpec

TOK = ByteTokenizer()


def feedback(turn: Turn) -> EnvReply:
    """Two rounds of feedback, then done with a reward of the turn count."""
    if turn.turn < 2:
        return EnvReply(messages=[ChatMessage(role="user", content=f"try again {turn.turn}")], tool_name="judge")
    return EnvReply(done=True, reward=float(turn.turn + 1))


def check_spans(sample) -> None:
    """Sampled spans have mask 1, everything between turns mask 0 with logprob 0.0, and
    what lies between turns is exactly the chat template's rendering of the answer."""
    assert len(sample.loss_mask) == len(sample.token_ids) == len(sample.logprobs)
    covered = [0] * len(sample.token_ids)
    for k, turn in enumerate(sample.turns):
        assert 0 <= turn.start <= turn.end <= len(sample.token_ids)
        for i in range(turn.start, turn.end):
            covered[i] = 1
        assert turn.engine_ids, "every turn ran somewhere"
        if turn.outcome == "continue":
            nxt = sample.turns[k + 1]
            assert nxt.start - turn.end == turn.appended_tokens > 0
            assert all(sample.logprobs[i] == 0.0 for i in range(turn.end, nxt.start))
    assert covered == sample.loss_mask


def test_feedback_turns_are_appended_as_template_tokens_with_mask_zero(sim_daemon):
    with SeerClient(sim_daemon.address) as client:
        result = client.rollout(["q0", "q1"], group_size=3, sampling=SamplingParams(max_tokens=12, seed=3),
                                env=feedback, trajectory=TrajectorySpec(max_turns=5))
    samples = [s for g in result.groups for s in g.samples]
    assert len(samples) == 6
    for s in samples:
        assert [t.outcome for t in s.turns] == ["continue", "continue", "done"]
        assert s.reward == 3.0
        assert s.finish_reason in ("stop", "length") and s.finish_reason == s.turns[-1].finish_reason
        check_spans(s)
        first, second = s.turns[0], s.turns[1]
        ended_with_eos = s.token_ids[first.end - 1] == TOK.EOS
        expected = TOK.encode_turn_suffix([ChatMessage(role="user", content="try again 0")], ended_with_eos)
        assert s.token_ids[first.end:second.start] == expected
        assert first.tool_name == "judge" and first.tool_s >= 0.0
    # Tool and template tokens are not output tokens.
    assert result.stats.num_output_tokens == sum(sum(s.loss_mask) for s in samples)


def test_seeded_trajectories_are_the_same_under_every_policy(sim_daemon):
    """Same seed, same environment: token-identical trajectories whatever the policy
    (divided rollout chunks and migrates them; context orders them)."""
    runs = {}
    with SeerClient(sim_daemon.address) as client:
        for policy in ("group", "divided", "context"):
            result = client.rollout(["a", "b"], group_size=2, sampling=SamplingParams(max_tokens=40, seed=11),
                                    env=feedback, policy=policy)
            runs[policy] = [(s.token_ids, s.loss_mask) for g in result.groups for s in g.samples]
    assert runs["group"] == runs["divided"] == runs["context"]


def test_each_limit_and_failure_ends_only_its_own_trajectory(sim_daemon):
    """Sample 0 raises, sample 1 never answers in time, sample 2 answers with a role the
    template cannot take... no: sample 2 talks past the context budget, sample 3 always
    goes on (max_turns); every one ends with its own reason and the rollout completes."""

    async def env(turn: Turn) -> EnvReply:
        if turn.sample_index == 0:
            raise RuntimeError("sandbox exploded")
        if turn.sample_index == 1:
            await asyncio.sleep(30)
        if turn.sample_index == 2:
            return EnvReply(messages=[tool_message("x" * 400)])
        return EnvReply(messages=[tool_message("ok")])

    started = time.monotonic()
    with SeerClient(sim_daemon.address) as client:
        result = client.rollout(["limits"], group_size=4, sampling=SamplingParams(max_tokens=8, seed=5), env=env,
                                trajectory=TrajectorySpec(max_turns=3, max_total_tokens=300, tool_timeout_s=1.0))
    assert time.monotonic() - started < 25  # the sleeping environment was not waited for
    by_index = {s.sample_index: s for s in result.groups[0].samples}
    assert by_index[0].finish_reason == "tool_error"
    assert "RuntimeError: sandbox exploded" in by_index[0].turns[-1].error
    assert by_index[1].finish_reason == "tool_timeout"
    assert by_index[2].finish_reason == "context_budget"
    assert "300-token budget" in by_index[2].turns[-1].error
    assert by_index[3].finish_reason == "max_turns" and len(by_index[3].turns) == 3
    for s in by_index.values():
        check_spans(s)
        assert len(s.token_ids) + s.num_prompt_tokens <= 300


def test_a_malformed_reply_is_a_tool_error_and_a_trajectory_without_env_is_refused(sim_daemon):
    def env(turn: Turn):
        return {"role": "tool"}  # not an EnvReply

    with SeerClient(sim_daemon.address) as client:
        result = client.rollout(["bad"], group_size=2, sampling=SamplingParams(max_tokens=8), env=env)
        assert {s.finish_reason for s in result.groups[0].samples} == {"tool_error"}
        assert "must return an EnvReply" in result.groups[0].samples[0].turns[0].error
        with pytest.raises(Exception, match="needs an environment"):
            client.rollout(["x"], group_size=1, trajectory=TrajectorySpec())


def test_a_client_that_leaves_mid_trajectory_frees_everything(sim_daemon):
    """The caller stops iterating while trajectories wait on their environment: the rollout
    is cancelled and the daemon holds none of it."""

    async def slow(turn: Turn) -> EnvReply:
        await asyncio.sleep(0.5)
        return EnvReply(messages=[tool_message("more")])

    async def go() -> None:
        async with AsyncSeerClient(sim_daemon.address) as client:
            stream = client.stream_rollout([f"p{i}" for i in range(4)], 2, SamplingParams(max_tokens=8), env=slow,
                                           trajectory=TrajectorySpec(max_turns=50))
            async for _group in stream:
                break
            await asyncio.sleep(1.0)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                status = await client.status()
                if not status.rollouts:
                    return
                await asyncio.sleep(0.2)
            raise AssertionError(f"the daemon still runs {status.rollouts}")

    asyncio.run(go())


def test_a_replayed_trace_decodes_exactly_each_turns_length(sim_daemon):
    """``replay_turns`` (benchmarks): turn k decodes exactly its trace length, EOS ignored,
    and the trajectory has the trace's turns, under a chunked policy too."""
    lengths = [[[5, 9, 3], [12, 1]], [[7], [2, 2, 2, 2]]]

    def env(turn: Turn) -> EnvReply:
        return EnvReply(messages=[tool_message("tool says hi")])

    async def go(policy: str):
        async with AsyncSeerClient(sim_daemon.address) as client:
            stream = client.stream_rollout(["a", "b"], 2, SamplingParams(max_tokens=16, seed=2), env=env,
                                           policy=policy, trajectory=TrajectorySpec(max_turns=10),
                                           replay_turns=lengths)
            return [g async for g in stream]

    for policy in ("sticky", "context"):
        groups = sorted(asyncio.run(go(policy)), key=lambda g: g.group_index)
        for g in groups:
            for s in g.samples:
                want = lengths[g.group_index][s.sample_index]
                assert [t.end - t.start for t in s.turns] == want, policy
                assert s.finish_reason == "max_turns" and sum(s.loss_mask) == sum(want)


def test_recomputed_context_is_counted_per_turn_and_per_rollout(sim_daemon):
    """The simulated engines keep no prefix cache and the sim config no pool: every later
    turn computes its earlier context again, and the turn records, the rollout's stats
    and the chunk events say how much (``turns.recomputed_tokens``)."""
    with SeerClient(sim_daemon.address) as client:
        result = client.rollout(["q"], group_size=2, sampling=SamplingParams(max_tokens=6, seed=4), env=feedback,
                                policy="sticky")
    for s in result.groups[0].samples:
        first, *later = s.turns
        assert first.recomputed_tokens == 0 and first.num_chunks == 1
        for prev, turn in zip(s.turns, later):
            # Its whole context but what was new (the appended answer, the last sampled token).
            assert turn.recomputed_tokens == s.num_prompt_tokens + turn.start - prev.appended_tokens - 1
    assert result.stats.num_recomputed_tokens == sum(t.recomputed_tokens for s in result.groups[0].samples
                                                     for t in s.turns)
