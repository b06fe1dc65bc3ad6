"""The incremental bookkeeping behind the scheduler's speed (issue 12): in-flight maps
count their changes, admission re-reads an engine only when it changed (or came back
with other capabilities), and chunk contexts packed by extension equal a full packing."""

from __future__ import annotations

from seer.config import SchedulerConfig
from seer.controlplane.intake import Limits, build_rollout
from seer.controlplane.scheduler import Scheduler
from seer.controlplane.state import EngineView, Inflight
from seer.controlplane.tokenizer import ByteTokenizer
from seer.protocol import EngineCapabilities, Prompt, RolloutRequest, SamplingParams, pack_token_ids
from tests.unit.chunks import finished


def caps(**overrides) -> EngineCapabilities:
    fields = dict(backend="sim", model="m", dtype="float32", max_model_len=512, vocab_size=259,
                  kv_capacity_tokens=100_000, block_size=16)
    return EngineCapabilities(**{**fields, **overrides})


def test_an_inflight_map_counts_every_change_and_a_plain_dict_is_converted():
    """Insertions, removals (also of a missing key with a default) and clear() move the
    version; reads do not; an EngineView given a plain dict holds an Inflight."""
    m = Inflight()
    m[1] = "a"
    m[2] = "b"
    v = m.version
    _ = m.get(1), len(m), list(m.values())
    assert m.version == v
    m.pop(1)
    del m[2]
    m.pop(3, None)
    m.clear()
    assert m.version == v + 4
    view = EngineView(engine_id=0, inflight={5: "x"})
    assert isinstance(view.inflight, Inflight) and view.inflight[5] == "x"


def _submit(s: Scheduler, max_tokens: int, group_size: int = 2) -> None:
    req = RolloutRequest(call_id="c", rollout_id=f"r{len(s.rollouts)}", prompts=[Prompt(prompt_token_ids=[5, 6, 7])],
                         group_size=group_size, sampling=SamplingParams(max_tokens=max_tokens))
    s.submit(build_rollout(req, ByteTokenizer(), Limits(max_group_size=8, max_prompts=8, max_model_len=4096,
                                                        vocab_size=259), "divided", 0.0))


def test_a_readmitted_engine_with_a_shorter_max_model_len_is_budgeted_by_it():
    """Admission caches per engine set; an engine admitted again with other capabilities
    (same record) is read afresh: chunk budgets follow its new max_model_len."""
    s = Scheduler(SchedulerConfig(policy="divided", chunk_size_tokens=64), clock=lambda: 0.0)
    s.engine_joined(0, caps(max_model_len=4096))
    _submit(s, max_tokens=1000, group_size=1)
    [d] = s.schedule()
    assert d.task.sampling.max_tokens == 64
    s.engine_lost(0)
    s.engine_joined(0, caps(max_model_len=20))
    [again] = s.schedule()
    assert again.task.sampling.max_tokens == 20 - 3  # the prompt's 3 tokens leave 17


def test_a_chunk_context_packed_by_extension_equals_the_whole_context_packed():
    """Over several chunks of two samples sharing a prompt, every task's prompt_token_ids
    is exactly prompt + generated so far, packed."""
    s = Scheduler(SchedulerConfig(policy="divided", chunk_size_tokens=4), clock=lambda: 0.0)
    s.engine_joined(0, caps())
    _submit(s, max_tokens=16)
    pending = s.schedule()
    num_checked = 0
    while pending:
        d = pending.pop(0)
        r = d.request
        assert d.task.prompt_token_ids == pack_token_ids(r.prompt_token_ids + r.generated_token_ids)
        num_checked += 1
        out = [10 + num_checked] * d.task.sampling.max_tokens
        s.chunk_finished(finished(0, d.task.task_id, out, [0.0] * len(out), "length"))
        pending += s.schedule()
    assert num_checked == 8


def test_an_inflight_log_gives_changes_in_order_or_none_once_trimmed_or_reset():
    """changes_since returns (added, request) after a version; a reader behind the kept
    log, or across a clear(), gets None (it must rescan)."""
    m = Inflight()
    m[1] = "a"
    v = m.version
    m[2] = "b"
    m.pop(1)
    assert m.changes_since(v) == [(True, "b"), (False, "a")]
    for i in range(3, 3 + 2 * Inflight.LOG_LIMIT):
        m[i] = "x"
    assert m.changes_since(v) is None
    w = m.version
    m.clear()
    assert m.changes_since(w) is None and m.changes_since(m.version) == []


def test_admission_reports_what_left_an_engine_whatever_path_it_takes():
    """Reservations.reserved from the change log (one chunk left) and from a rescan (two
    left at once; a chunk assigned with add but never put in flight) report the same
    departures and totals a full recount gives."""
    from seer.controlplane.policies.admission import Reservations

    s = Scheduler(SchedulerConfig(policy="divided", chunk_size_tokens=4), clock=lambda: 0.0)
    s.engine_joined(0, caps())
    _submit(s, max_tokens=16, group_size=4)
    view = s.engines[0]
    res = Reservations()
    s.schedule()  # four chunks in flight; this fresh Reservations has seen none of them
    full = lambda: sum(-(-(r.context_tokens + r.chunk_max_tokens) // 16) * 16 for r in view.inflight.values())  # noqa: E731
    assert res.reserved(view) == full() and res.departed == []
    tasks = sorted(view.inflight)
    view.inflight.pop(tasks[0])  # one left: replayed from the log
    assert res.reserved(view) == full() and len(res.departed) == 1
    view.inflight.pop(tasks[1])
    view.inflight.pop(tasks[2])  # two at once: rescanned
    assert res.reserved(view) == full() and len(res.departed) == 3
    gone = [q for q in next(iter(s.rollouts.values())).groups[0].requests if q not in view.inflight.values()]
    res.add(view, gone[0], 32)  # assigned, but the chunk never went in flight
    assert res.reserved(view) == full() and res.departed[-1] is gone[0] and len(res.departed) == 4
