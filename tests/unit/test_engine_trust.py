"""Engines earn trust (issue 14, defect 5) and dispatch is bounded (defect 1): hello
capabilities against the model, chunk deadlines from measured step time, unhealthy
engines get no new work, at most max_chunks_per_engine chunks on one engine."""

from __future__ import annotations

from seer.config import EnginesConfig, SchedulerConfig
from seer.controlplane.deadlines import ChunkDeadlines
from seer.controlplane.intake import Limits, build_rollout
from seer.controlplane.membership import ModelExpectations, refuse_capabilities
from seer.controlplane.scheduler import Scheduler
from seer.controlplane.tokenizer import ByteTokenizer
from seer.protocol import EngineCapabilities, Prompt, RolloutRequest, SamplingParams
from tests.unit.chunks import finished

EXPECTED = ModelExpectations(vocab_size=259, max_model_len=512)


def caps(**overrides) -> EngineCapabilities:
    fields = dict(backend="sim", model="m", dtype="float32", max_model_len=512, vocab_size=259,
                  kv_capacity_tokens=100_000, block_size=16)
    return EngineCapabilities(**{**fields, **overrides})


def test_capabilities_that_cannot_serve_the_model_are_refused_naming_the_field():
    """A smaller vocabulary, a shorter max_model_len or no KV cache is refused naming the
    numbers; matching or larger capabilities are accepted."""
    assert "vocab_size 1" in refuse_capabilities(caps(vocab_size=1), EXPECTED)
    assert "max_model_len 2" in refuse_capabilities(caps(max_model_len=2), EXPECTED)
    assert "kv_capacity_tokens 0" in refuse_capabilities(caps(kv_capacity_tokens=0), EXPECTED)
    assert refuse_capabilities(caps(), EXPECTED) == ""
    assert refuse_capabilities(caps(vocab_size=300, max_model_len=4096), EXPECTED) == ""


def deadlines(**kw) -> ChunkDeadlines:
    return ChunkDeadlines(EnginesConfig(**{"chunk_deadline_min_s": 60.0, "chunk_deadline_factor": 10.0,
                                           "chunk_deadline_unmeasured_s": 600.0, **kw}))


def test_a_chunk_deadline_follows_the_engines_measured_time_per_token():
    """Unmeasured anywhere: the unmeasured deadline; measured: max(min, factor x budget x
    per-token time); an unmeasured engine is judged by the slowest measured one."""
    d = deadlines()
    assert d.deadline_s(0, 100, now_s=0.0) == 600.0
    d.finished(0, task_id=1, num_tokens=10, elapsed_s=1.0)  # 0.1 s per token
    assert d.deadline_s(0, 100, now_s=0.0) == 100.0  # 10 x 100 x 0.1
    assert d.deadline_s(0, 10, now_s=0.0) == 60.0  # the floor
    assert d.deadline_s(1, 100, now_s=5.0) == 105.0  # engine 1: judged by engine 0


def test_an_expired_chunk_is_reported_once_and_a_finished_one_never():
    """expired() reports a chunk past its deadline once; a chunk that finished or failed is
    never reported."""
    d = deadlines(chunk_deadline_unmeasured_s=60.0)
    d.sent(0, task_id=1, max_tokens=8, now_s=0.0)
    d.sent(0, task_id=2, max_tokens=8, now_s=0.0)
    d.sent(1, task_id=3, max_tokens=8, now_s=0.0)
    d.finished(0, task_id=2, num_tokens=8, elapsed_s=0.5)
    d.failed(1, task_id=3, now_s=0.5)
    assert d.expired(59.0) == []
    assert d.expired(61.0) == [(0, 1)]
    assert d.expired(1000.0) == [] and len(d) == 0


def sched(max_chunks: int = 4, engines: int = 1) -> Scheduler:
    s = Scheduler(SchedulerConfig(max_chunks_per_engine=max_chunks), lambda: 0.0)
    for e in range(engines):
        s.engine_joined(e, caps())
    return s


def submit(s: Scheduler, num_prompts: int, rollout_id: str = "r") -> None:
    req = RolloutRequest(call_id="c", rollout_id=rollout_id, group_size=1, sampling=SamplingParams(max_tokens=4),
                         prompts=[Prompt(prompt_token_ids=[5, 6]) for _ in range(num_prompts)])
    s.submit(build_rollout(req, ByteTokenizer(), Limits(64, 1000, 512, 259), "group", 0.0))


def test_an_engine_never_holds_more_than_max_chunks_per_engine():
    """10 waiting requests, a cap of 4: 4 go, the rest wait and go one by one as chunks finish."""
    s = sched(max_chunks=4)
    submit(s, 10)
    first = s.schedule()
    assert len(first) == 4 and s.num_waiting() == 6
    assert s.schedule() == []
    d = first[0]
    s.chunk_finished(finished(d.engine_id, d.task.task_id, [40] * 4, [-0.5] * 4, "length"))
    assert len(s.schedule()) == 1 and s.engines[0].num_inflight == 4


def test_held_requests_go_back_to_the_buffer_when_their_engine_is_lost_or_the_rollout_cancelled():
    """Requests held for a lost engine are dealt to a live one; a cancelled rollout's are dropped."""
    s = sched(max_chunks=2, engines=2)
    submit(s, 10)
    assert len(s.schedule()) == 4
    s.engine_lost(0)
    assert s.num_waiting() == 8  # engine 0's 2 in flight and 3 held, engine 1's 3 held
    assert len(s.schedule()) == 0  # engine 1 is full
    s.cancel("r")
    assert s.num_waiting() == 0


def test_an_unhealthy_engine_gets_no_new_work_until_it_finishes_a_chunk():
    """Marked unhealthy (a chunk passed its deadline), an engine is skipped by schedule();
    once it finishes a chunk it takes work again."""
    s = sched(max_chunks=8, engines=2)
    s.registry.mark_unhealthy(0)
    submit(s, 4)
    assert {d.engine_id for d in s.schedule()} == {1}
    assert s.registry.finished_chunk(0) and not s.engines[0].unhealthy
    submit(s, 4, rollout_id="r2")
    assert 0 in {d.engine_id for d in s.schedule()}


def test_deadline_bookkeeping_follows_the_chunks_in_flight():
    """Finished chunks do not pile up until their deadline: after 10,000 chunks sent and
    finished, the bookkeeping holds about as many entries as chunks in flight."""
    d = deadlines()
    for task_id in range(10_000):
        d.sent(0, task_id, max_tokens=8, now_s=0.0)
        d.finished(0, task_id, num_tokens=8, elapsed_s=0.1)
    assert len(d) == 0 and not d._chunks and not d._watched


def test_a_lost_engines_measurement_no_longer_judges_the_others():
    """After engine_gone, an unmeasured engine is judged by the remaining ones only."""
    d = deadlines()
    d.finished(0, task_id=1, num_tokens=1, elapsed_s=100.0)  # a very slow engine 0
    d.finished(1, task_id=2, num_tokens=10, elapsed_s=1.0)
    d.engine_gone(0)
    assert d.deadline_s(2, 100, now_s=0.0) == 100.0
