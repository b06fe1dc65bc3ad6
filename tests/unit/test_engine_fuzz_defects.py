"""Regression tests for the defects the engine-socket fuzz found (tests/integration/
test_engine_fuzz.py): malformed results, untrusted timings, a second process joining
under a registered identity, and agent or engine pools that are not pools."""

from __future__ import annotations

import math

import msgspec

from seer.config import EnginesConfig, KVPoolConfig, SchedulerConfig
from seer.controlplane.deadlines import ChunkDeadlines
from seer.controlplane.intake import Limits, build_rollout
from seer.controlplane.kvpool.agents import MAX_POOL_BLOCKS, Agents
from seer.controlplane.membership import ModelExpectations, refuse_capabilities
from seer.controlplane.result_check import refuse_result
from seer.controlplane.scheduler import Scheduler
from seer.controlplane.tokenizer import ByteTokenizer
from seer.protocol import (
    JOIN_ENGINE_ID,
    PROTOCOL_VERSION,
    AgentHello,
    EngineCapabilities,
    HelloRejected,
    PoolGeometry,
    Prompt,
    RolloutRequest,
    SamplingParams,
)
from tests.unit.chunks import finished
from tests.unit.test_outbox import Plane, hello


def caps(**overrides) -> EngineCapabilities:
    fields = dict(backend="sim", model="m", dtype="float32", max_model_len=512, vocab_size=259,
                  kv_capacity_tokens=100_000, block_size=16)
    return EngineCapabilities(**{**fields, **overrides})


def _check(msg, budget: int = 8) -> str:
    return refuse_result(msg, budget_tokens=budget, context_tokens=10, vocab_size=259)


def test_a_result_that_cannot_be_its_chunks_is_refused_naming_why():
    """Ragged arrays, token and logprob counts that differ, more tokens than the chunk's
    budget, ids outside the vocabulary, a KV save past the context and negative token
    counts (they raised in the Prometheus counters) are refused; a
    correct result (also an empty stop) is not."""
    good = finished(0, 1, [5, 6, 7], [-0.1] * 3, "length")
    assert _check(good) == ""
    assert _check(finished(0, 1, [], [], "stop")) == ""
    assert "4-byte" in _check(msgspec.structs.replace(good, token_ids=b"\x01\x02\x03"))
    assert "4-byte" in _check(msgspec.structs.replace(good, logprobs=b"\x00" * 5))
    assert "3 token ids but 2 logprobs" in _check(msgspec.structs.replace(good, logprobs=b"\x00" * 8))
    assert "3 tokens for a chunk of at most 2" in _check(good, budget=2)
    assert "[0, 259)" in _check(finished(0, 1, [5, 259], [0.0, 0.0], "length"))
    assert "[0, 259)" in _check(finished(0, 1, [-1], [0.0], "length"))
    assert "kv_saved_tokens 14" in _check(finished(0, 1, [5], [0.0], "length", kv_saved_tokens=14))
    assert "kv_saved_tokens -1" in _check(finished(0, 1, [5], [0.0], "length", kv_saved_tokens=-1))
    for name in ("num_prompt_tokens", "num_cached_tokens", "kv_loaded_tokens", "kv_load_failed_tokens"):
        assert f"{name} -3 is negative" in _check(msgspec.structs.replace(good, **{name: -3}))


def _scheduler_with_a_chunk() -> tuple[Scheduler, object]:
    s = Scheduler(SchedulerConfig(policy="divided", chunk_size_tokens=4), clock=lambda: 0.0)
    s.engine_joined(0, caps())
    req = RolloutRequest(call_id="c", rollout_id="r", prompts=[Prompt(prompt_token_ids=[5, 6])], group_size=1,
                         sampling=SamplingParams(max_tokens=8))
    s.submit(build_rollout(req, ByteTokenizer(), Limits(max_group_size=4, max_prompts=4, max_model_len=512,
                                                        vocab_size=259), "divided", 0.0))
    [dispatch] = s.schedule()
    return s, dispatch


def test_the_scheduler_checks_a_result_against_the_chunk_it_sent():
    """refuse_result uses the chunk's budget and the engine's vocabulary; results for
    unknown tasks or from another engine are left to chunk_finished (which ignores them)."""
    s, d = _scheduler_with_a_chunk()
    budget = d.task.sampling.max_tokens
    assert s.refuse_result(finished(0, d.task.task_id, [9] * budget, [0.0] * budget, "length")) == ""
    assert "for a chunk of at most" in s.refuse_result(
        finished(0, d.task.task_id, [9] * (budget + 1), [0.0] * (budget + 1), "length"))
    assert s.refuse_result(finished(0, 999, [9] * 99, [], "length")) == ""
    assert s.refuse_result(finished(1, d.task.task_id, [9] * 99, [], "length")) == ""


def test_a_refused_result_leaves_the_request_to_go_again_once_failed():
    """What the server does with a refused result (chunk_failed): the chunk is no longer in
    flight, the request waits again with one failure and goes out as a new chunk."""
    s, d = _scheduler_with_a_chunk()
    request = s.chunk_failed(0, d.task.task_id)
    assert request is not None and request.num_failures == 1 and request.generated_token_ids == []
    assert s.engines[0].inflight == {}
    [again] = s.schedule()
    assert again.task.task_id != d.task.task_id


def deadlines() -> ChunkDeadlines:
    return ChunkDeadlines(EnginesConfig(chunk_deadline_min_s=10.0, chunk_deadline_factor=10.0,
                                        chunk_deadline_unmeasured_s=100.0))


def test_an_engine_reported_time_never_lengthens_deadlines():
    """inf, NaN or a huge elapsed_ms is capped by the time the control plane saw; a result
    for a chunk never sent here measures nothing; a shorter report than seen is kept."""
    d = deadlines()
    for elapsed_s in (math.inf, math.nan, 1e300, -5.0):
        d.sent(0, task_id=1, max_tokens=10, now_s=100.0)
        d.finished(0, task_id=1, num_tokens=10, elapsed_s=elapsed_s, now_s=101.0)  # 1 s seen here
        assert math.isfinite(d.per_token_s[0]) and d.per_token_s[0] <= 0.1
    assert d.deadline_s(0, 10, now_s=0.0) == 10.0
    d.finished(1, task_id=77, num_tokens=1, elapsed_s=1e300, now_s=200.0)  # never sent here
    assert 1 not in d.per_token_s
    assert d.deadline_s(1, 10, now_s=0.0) == 10.0  # judged by engine 0, not by a fabricated time
    d.sent(2, task_id=5, max_tokens=10, now_s=0.0)
    d.finished(2, task_id=5, num_tokens=10, elapsed_s=0.5, now_s=3.0)
    assert d.per_token_s[2] == 0.05


def test_a_late_result_still_measures_its_engine_but_not_after_the_engine_is_gone():
    """A chunk past its deadline that comes back late measures the time seen here; once
    its engine is gone nothing of it is kept."""
    d = deadlines()
    d.sent(0, task_id=1, max_tokens=10, now_s=0.0)
    assert d.expired(200.0) == [(0, 1)]
    d.finished(0, task_id=1, num_tokens=10, elapsed_s=1e9, now_s=300.0)
    assert d.per_token_s[0] == 30.0
    d.sent(3, task_id=2, max_tokens=10, now_s=0.0)
    d.engine_gone(3)
    d.finished(3, task_id=2, num_tokens=10, elapsed_s=1.0, now_s=1.0)
    assert 3 not in d.per_token_s


def test_a_second_process_joining_under_a_registered_identity_supersedes_it(tmp_path):
    """A joiner's identity registered as engine N: a hello from another process under it
    names N (lost before the new one is admitted); a repeated hello of the same process,
    an unknown identity and a spawned engine's id do not."""
    plane = Plane(tmp_path)
    joiner = hello(JOIN_ENGINE_ID, pid=10)
    answer = plane.membership.on_hello(b"join-a", joiner, plane.weights)
    [engine_id] = plane.registry.ready_ids()
    assert answer.admitted
    assert plane.membership.superseded(b"join-a", joiner) is None  # the same process repeating itself
    assert plane.membership.superseded(b"join-a", hello(JOIN_ENGINE_ID, pid=11)) == engine_id
    assert plane.membership.superseded(b"join-b", hello(JOIN_ENGINE_ID, pid=11)) is None
    plane.membership.on_hello(b"engine-0", hello(0, pid=20), plane.weights)
    assert plane.membership.superseded(b"engine-0", hello(0, pid=21)) is None  # refused by on_hello instead


def geometry(**overrides) -> PoolGeometry:
    return PoolGeometry(**{**dict(num_layers=2, num_kv_heads=2, head_size=8, block_size=16, dtype="float32"),
                           **overrides})


def agent_hello(**overrides) -> AgentHello:
    fields = dict(host_id="other-host", protocol_version=PROTOCOL_VERSION, pid=5, pool_name="p", geometry=geometry(),
                  num_blocks=64, transport="tcp", address="tcp://10.0.0.2:1")
    return AgentHello(**{**fields, **overrides})


def test_an_agent_whose_pool_is_not_a_pool_is_refused_before_anything_is_allocated():
    """num_blocks outside [1, MAX_POOL_BLOCKS] (2**40 used to build a 2**40-entry free list)
    and a geometry with a size below 1 or an unknown dtype are refused with HelloRejected;
    a sane agent registers."""
    s = Scheduler(SchedulerConfig(), clock=lambda: 0.0)
    agents = Agents(KVPoolConfig(), s, lambda: 0.0, local_host_id="here")
    for bad in (agent_hello(num_blocks=2**40), agent_hello(num_blocks=0), agent_hello(num_blocks=MAX_POOL_BLOCKS + 1),
                agent_hello(geometry=geometry(block_size=0)), agent_hello(geometry=geometry(head_size=-1)),
                agent_hello(geometry=geometry(dtype="nope"))):
        [reply] = agents.on_hello(b"agent", bad)
        assert isinstance(reply.msg, HelloRejected), bad
    assert agents.on_hello(b"agent", agent_hello()) == [] and "other-host" in agents.by_host


def test_an_engine_whose_kv_geometry_is_not_one_is_refused():
    """A hello whose kv_geometry has a zero block size or an unknown dtype is refused (it
    used to raise while the pool was created, leaving the engine unanswered)."""
    expected = ModelExpectations(vocab_size=259, max_model_len=512)
    assert "block_size" in refuse_capabilities(caps(kv_geometry=geometry(block_size=0)), expected)
    assert "dtype" in refuse_capabilities(caps(kv_geometry=geometry(dtype="nope")), expected)
    assert refuse_capabilities(caps(kv_geometry=geometry()), expected) == ""
