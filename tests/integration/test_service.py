"""The rollout service over real sockets and processes, with simulated engines."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
import zmq

from seer.client import AsyncSeerClient, SamplingParams, SeerClient, SeerServiceError
from seer.protocol import ErrorReply, ServerMessage
from seer.wire import VERSION_FRAME


def test_rollout_returns_every_sample_in_prompt_order(sim_daemon):
    """4 prompts x G=4 give 16 samples: groups in prompt order, samples in index order."""
    prompts = [{"id": f"p{i}", "prompt": f"question {i}"} for i in range(4)]
    with SeerClient(sim_daemon.address) as client:
        result = client.rollout(prompts, group_size=4, sampling=SamplingParams(max_tokens=32, seed=7),
                                policy="group")
    assert [g.prompt_id for g in result.groups] == ["p0", "p1", "p2", "p3"]
    assert [g.group_index for g in result.groups] == [0, 1, 2, 3]
    assert sum(len(g.samples) for g in result.groups) == 16
    for group in result.groups:
        assert [s.sample_index for s in group.samples] == [0, 1, 2, 3]
        assert len({s.engine_ids[0] for s in group.samples}) == 1  # group baseline: one engine per group
        for s in group.samples:
            assert 1 <= len(s.token_ids) <= 32
            assert len(s.logprobs) == len(s.token_ids)
            assert s.finish_reason in ("stop", "length")
            assert s.finished_s >= s.first_scheduled_s >= 0
    assert result.stats.num_samples == 16
    assert result.stats.num_output_tokens == sum(len(s.token_ids) for g in result.groups for s in g.samples)
    assert result.stats.policy == "group"
    assert set(result.stats.per_engine_output_tokens) == {"0", "1"}


def test_same_seed_gives_same_samples_and_siblings_differ(sim_daemon):
    """A seeded rollout is reproducible, and the G samples of one prompt are not copies."""
    with SeerClient(sim_daemon.address) as client:
        a = client.rollout(["same prompt"], group_size=4, sampling=SamplingParams(max_tokens=24, seed=1))
        b = client.rollout(["same prompt"], group_size=4, sampling=SamplingParams(max_tokens=24, seed=1))
    tokens_a = [s.token_ids for s in a.groups[0].samples]
    assert tokens_a == [s.token_ids for s in b.groups[0].samples]
    assert len({tuple(t) for t in tokens_a}) == 4


def test_stream_rollout_yields_each_group_once_with_stats_at_the_end(sim_daemon):
    """stream_rollout yields every group exactly once as it completes, then sets stats."""

    async def go():
        async with AsyncSeerClient(sim_daemon.address) as client:
            stream = client.stream_rollout([f"q{i}" for i in range(6)], 2, SamplingParams(max_tokens=16))
            seen = [g.group_index async for g in stream]
            return seen, stream.stats

    seen, stats = asyncio.run(go())
    assert sorted(seen) == list(range(6))
    assert stats is not None and stats.num_groups == 6


def test_concurrent_rollouts_on_one_async_client(sim_daemon):
    """Several rollouts in flight on one client each get exactly their own groups."""

    async def go():
        async with AsyncSeerClient(sim_daemon.address) as client:
            return await asyncio.gather(*[
                client.rollout([f"r{r}-q{i}" for i in range(3)], 2, SamplingParams(max_tokens=8)) for r in range(5)])

    results = asyncio.run(go())
    assert len({r.rollout_id for r in results}) == 5
    for r in results:
        assert [len(g.samples) for g in r.groups] == [2, 2, 2]


@pytest.mark.parametrize(
    ("prompts", "group_size", "sampling", "code", "needle"),
    [
        ([], 2, SamplingParams(), "empty_rollout", "no prompts"),
        (["x"], 0, SamplingParams(), "bad_group_size", "between 1 and 16"),
        (["x"], 17, SamplingParams(), "bad_group_size", "server.max_group_size"),
        (["y" * 600], 2, SamplingParams(), "prompt_too_long", "model.max_model_len"),
        (["y" * 400], 2, SamplingParams(max_tokens=200), "prompt_too_long", "Lower max_tokens"),
        ([[1, 2, 99999]], 2, SamplingParams(), "bad_token_ids", "99999"),
        ([[-1]], 2, SamplingParams(), "bad_token_ids", "-1"),
        ([{"id": "both", "prompt": "a", "prompt_token_ids": [5]}], 2, SamplingParams(), "bad_prompt", "exactly one"),
        (["x"], 2, SamplingParams(min_tokens=10, max_tokens=5), "bad_sampling", "min_tokens"),
        (["x"], 2, SamplingParams(temperature=-1.0), "invalid_message", "temperature"),
    ],
)
def test_bad_rollouts_are_refused_with_a_precise_error_and_the_daemon_keeps_serving(
        sim_daemon, prompts, group_size, sampling, code, needle):
    """Each bad rollout gets its own error code and a message naming the problem; the
    next good rollout still works."""
    with SeerClient(sim_daemon.address, timeout_s=10) as client:
        with pytest.raises(SeerServiceError) as info:
            client.rollout(prompts, group_size=group_size, sampling=sampling)
        assert info.value.code == code
        assert needle in info.value.message
        ok = client.rollout(["fine"], group_size=2, sampling=SamplingParams(max_tokens=4))
        assert len(ok.groups[0].samples) == 2


def _raw_call(address: str, frames: list[bytes]) -> ServerMessage:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    try:
        sock.send_multipart(frames)
        assert sock.poll(10_000), "the daemon did not answer a raw frame"
        reply = sock.recv_multipart()
        return msgspec.msgpack.decode(reply[1], type=ServerMessage)
    finally:
        sock.close(0)
        ctx.term()


def _rollout_payload(**overrides) -> bytes:
    body = {"type": "rollout", "call_id": "c1", "rollout_id": "raw-1", "prompts": [{"prompt": "hi"}],
            "group_size": 1, "sampling": {"max_tokens": 4}}
    body.update(overrides)
    return msgspec.msgpack.encode(body)


@pytest.mark.parametrize(
    ("frames", "code", "needle"),
    [
        ([VERSION_FRAME, b"\xc1garbage"], "invalid_message", "invalid message"),
        ([b"seer/999", _rollout_payload()], "protocol_mismatch", "seer/999"),
        ([VERSION_FRAME], "malformed_frame", "expected 2 frames"),
        ([VERSION_FRAME, _rollout_payload(sampling={"max_tokens": 4, "presence_penalty": 1.0})],
         "invalid_message", "presence_penalty"),
        ([VERSION_FRAME, _rollout_payload(sampling={"max_tokens": "many"})], "invalid_message", "max_tokens"),
        ([VERSION_FRAME, _rollout_payload(prompts=[{"text": "hi"}])], "invalid_message", "text"),
        ([VERSION_FRAME, b"\x00" * 300_000], "frame_too_large", "server.max_request_bytes"),
    ],
)
def test_malformed_frames_get_an_error_reply_and_the_daemon_keeps_serving(sim_daemon, frames, code, needle):
    """Garbage, wrong protocol versions, unknown or mistyped fields and oversized frames
    are answered with an ErrorReply naming the problem; the daemon stays up."""
    reply = _raw_call(sim_daemon.address, frames)
    assert isinstance(reply, ErrorReply)
    assert reply.code == code
    assert needle in reply.message
    with SeerClient(sim_daemon.address, timeout_s=10) as client:
        assert client.status().engines[0].state == "ready"


def test_update_weights_bumps_the_version_and_refuses_bad_paths(sim_daemon, tmp_path):
    """update_weights returns a new version reported by status and rollouts; a missing
    checkpoint is refused with a message naming the path."""
    ckpt = tmp_path / "model.safetensors"
    ckpt.write_bytes(b"sim engines do not read it")
    with SeerClient(sim_daemon.address) as client:
        before = client.status().weights_version
        version = client.update_weights(ckpt)
        assert version == before + 1
        assert client.status().weights_version == version
        assert all(e.weights_version == version for e in client.status().engines)
        result = client.rollout(["after update"], 2, SamplingParams(max_tokens=4))
        assert result.weights_version == version
        with pytest.raises(SeerServiceError) as info:
            client.update_weights(tmp_path / "missing.safetensors")
        assert info.value.code == "bad_weights_path" and "missing.safetensors" in info.value.message


def test_update_weights_is_refused_while_a_rollout_runs(sim_daemon, tmp_path):
    """Weights cannot change under a running rollout; the refusal says why."""
    ckpt = tmp_path / "w.safetensors"
    ckpt.write_bytes(b"x")

    async def go():
        async with AsyncSeerClient(sim_daemon.address) as client:
            stream = client.stream_rollout(["long"] * 2, 2, SamplingParams(max_tokens=500, ignore_eos=True))
            iterator = stream.__aiter__()
            first = asyncio.ensure_future(iterator.__anext__())
            for _ in range(100):  # until accepted; it then runs >= 1 s (500 steps x 2 ms)
                if (await client.status()).rollouts:
                    break
                await asyncio.sleep(0.01)
            try:
                await client.update_weights(ckpt)
            except SeerServiceError as exc:
                error = exc
            else:
                error = None
            await first
            async for _ in iterator:
                pass
            return error

    error = asyncio.run(go())
    assert error is not None and error.code == "rollout_running"


def test_sim_backend_continuation_equals_one_shot():
    """The simulated engine is chunk-invariant: prompt+first half continued gives the
    one-shot tokens (what lossless chunking relies on)."""
    from seer.engines.sim_backend import SimBackend
    from seer.protocol import ChunkTask, EngineSampling, pack_token_ids

    def task(task_id: int, tokens: list[int], max_tokens: int) -> ChunkTask:
        sampling = EngineSampling(max_tokens=max_tokens, temperature=1.0, top_p=1.0, top_k=-1, min_tokens=0,
                                  seed=5, stop=[], stop_token_ids=[], ignore_eos=True)
        return ChunkTask(task_id=task_id, request_id="r", group_id="g", prompt_token_ids=pack_token_ids(tokens),
                         sampling=sampling)

    async def go():
        backend = SimBackend(step_s=0.0, mean_output_tokens=50, max_model_len=512)
        await backend.start()
        prompt = [1, 40, 41, 42]
        whole = await backend.generate(task(1, prompt, 20))
        first = await backend.generate(task(2, prompt, 8))
        rest = await backend.generate(task(3, prompt + first.token_ids, 12))
        await backend.shutdown()
        return whole, first, rest

    whole, first, rest = asyncio.run(go())
    assert len(whole.token_ids) == 20
    assert first.token_ids + rest.token_ids == whole.token_ids
    assert first.logprobs + rest.logprobs == whole.logprobs


@pytest.mark.parametrize("policy", ["divided", "context"])
def test_chunked_policies_through_the_daemon_return_the_same_greedy_samples(sim_daemon, policy):
    """A chunked policy over real sockets returns every sample, in order, generated in
    several chunks, and (greedy) token-identical to the unchunked `group` baseline."""
    prompts = [f"prompt number {i}" for i in range(5)]
    sampling = SamplingParams(temperature=0.0, max_tokens=120)
    with SeerClient(sim_daemon.address) as client:
        base = client.rollout(prompts, 3, sampling, policy="group")
        chunked = client.rollout(prompts, 3, sampling, policy=policy)
    assert chunked.stats.policy == policy
    assert chunked.stats.num_chunks > chunked.stats.num_samples == 15
    assert base.stats.num_chunks == 15
    for gb, gc in zip(base.groups, chunked.groups):
        assert [s.token_ids for s in gc.samples] == [s.token_ids for s in gb.samples]
        assert [s.logprobs for s in gc.samples] == [s.logprobs for s in gb.samples]
        assert [s.finish_reason for s in gc.samples] == [s.finish_reason for s in gb.samples]


def test_the_default_policy_is_seers_context_policy(sim_daemon):
    """Without a policy, a rollout runs under Seer's context-aware scheduling (the default)."""
    with SeerClient(sim_daemon.address) as client:
        result = client.rollout(["default policy"], group_size=2, sampling=SamplingParams(max_tokens=8, seed=3))
    assert result.stats.policy == "context"
