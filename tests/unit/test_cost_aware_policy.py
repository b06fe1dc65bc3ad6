"""The chunked policies' cost-aware decisions: siblings share their prompt's KV in
admission, placement by predicted drain time, the admission margin from the step cost, and
trace replay (exact per-sample lengths the policies are not told)."""

from __future__ import annotations

import dataclasses
import pytest

from seer.controlplane.intake import Limits, RequestRejected, build_rollout
from seer.controlplane.policies.admission import admission_margin, overflow_odds
from seer.controlplane.scheduler import Scheduler
from seer.controlplane.state import RequestState
from seer.controlplane.tokenizer import ByteTokenizer
from seer.config import SchedulerConfig
from seer.protocol import Prompt, RolloutRequest, SamplingParams
from seer.stepcost import CostModel
from tests.unit.test_chunked_policies import Clock, caps, rollout, run_chunk, scheduler


def test_siblings_on_one_engine_reserve_their_prompt_once():
    """Four samples of one group, a 64-token prompt, 16-token chunks: admission counts the
    prompt once (64 + 4 x 16 = 128 tokens), so all four start on an engine of 128 tokens;
    counted per sample (4 x 80 = 320) only one would."""
    sched = scheduler("divided", engines=1, kv_tokens=128)
    sched.submit(rollout("divided", [[16, 16, 16, 16]], prompt_len=64))
    assert len(sched.schedule()) == 4


def test_a_second_group_pays_for_its_own_prompt():
    """Prompts of different groups are not shared: on a 128-token engine a second group's
    sample (another 64-token prompt + 16) does not fit beside the first group's four."""
    sched = scheduler("divided", engines=1, kv_tokens=128)
    r = rollout("divided", [[16, 16, 16, 16], [16]], prompt_len=64)
    sched.submit(r)
    assert sorted(d.request.group.group_index for d in sched.schedule()) == [0, 0, 0, 0]


def test_the_engine_holding_the_longest_sample_gets_less_of_the_rest():
    """Placement by predicted drain time (``oracle``: exact lengths, longest first): with a
    step cost dominated by its fixed part, the engine running the 1,000-token sample is
    busy for 1,000 steps whatever else it runs, so the short samples go to the other engine
    until its predicted drain time catches up; counting chunks would split them evenly."""
    sched = scheduler("oracle", engines=2, kv_tokens=100_000, chunk_size_tokens=2048)
    policy = sched.policy("oracle")
    assert policy.places_by_drain
    policy._prior_cost = CostModel(a=1.0, b=1e-3, c=0.0, p=0.0, pool_s_per_token=0.0)
    policy.step_cost = None  # decide by the cost above
    lengths = [[1000] + [50] * 7]
    r = rollout("oracle", lengths, max_tokens=2048)
    sched.submit(r)
    ds = sched.schedule()
    long_engine = next(d.engine_id for d in ds if d.request.sample_index == 0)
    others = [d.engine_id for d in ds if d.request.sample_index != 0]
    assert others.count(long_engine) == 0, others  # 7 x 50 = 350 steps < 1,000: all on the other engine


def test_divided_without_a_length_model_places_by_chunks_in_flight():
    """``divided`` knows no lengths: it keeps the in-flight count placement; status says
    which placement and admission margin the configured policy uses."""
    sched = scheduler("divided")
    assert not sched.policy("divided").places_by_drain
    status = sched.scheduling_status()
    assert status.placement == "in-flight" and status.admission_margin_sd is None
    assert scheduler("context").scheduling_status().placement == "drain"


@pytest.mark.parametrize("cost", [CostModel.cpu_smollm2(), CostModel.gpu_h800_like()])
def test_overflow_odds_fall_as_preemption_gets_dearer(cost):
    """The accepted overflow odds fall when a re-prefill costs more (p up, longer contexts)
    and rise when a step's fixed cost is shared by fewer sequences."""
    base = overflow_odds(cost, batch=16, context=500, use=300)
    dearer = overflow_odds(dataclasses.replace(cost, p=cost.p * 10), batch=16, context=500, use=300)
    longer = overflow_odds(cost, batch=16, context=5000, use=300)
    fuller = overflow_odds(cost, batch=64, context=500, use=300)
    assert 0 < dearer < base < 1 and longer < base and fuller < base
    assert admission_margin(base) < admission_margin(dearer)  # dearer preemption: a wider margin


def test_on_this_cpu_admission_overcommits_and_on_a_gpu_it_keeps_a_margin():
    """Typical chunks of the two regimes: the CPU model (a re-prefill of ~500 tokens costs a
    few steps) admits beyond the expected use; the GPU model with long contexts keeps a
    positive margin."""
    cpu = admission_margin(overflow_odds(CostModel.cpu_smollm2(), batch=12, context=400, use=300))
    gpu = admission_margin(overflow_odds(CostModel.gpu_h800_like(), batch=40, context=30_000, use=6_000))
    assert cpu < 0 < gpu


def test_context_takes_its_margin_from_the_fitted_step_cost():
    """The same rollout on the same engines: with the step cost the fit reports for a
    CPU engine, ``context``'s admission margin is negative (it overcommits); after records
    saying prefill is 50 times dearer, it is positive."""
    def margin_after(records: list[tuple[float, float, float, float]]) -> float:
        sched = scheduler("context", engines=2, kv_tokens=8_000, chunk_size_tokens=512)  # KV binds: several rounds
        sched.engine_steps(0, records)
        r = rollout("context", [[300] * 8 for _ in range(8)], max_tokens=1024, prompt_len=256)
        sched.submit(r)
        for _ in range(3):
            for d in sched.schedule():
                run_chunk(sched, d, 300)
        return sched.policy("context").reserve_z

    cheap = CostModel.cpu_smollm2()
    dear = CostModel(a=cheap.a, b=cheap.b, c=cheap.c, p=cheap.p * 50, pool_s_per_token=cheap.pool_s_per_token)
    rows = [(b, 1000 * b, p) for b in range(1, 33) for p in (0, 200)] * 4
    assert margin_after([(cheap.step_s(*r), *r) for r in rows]) < 0
    assert margin_after([(dear.step_s(*r), *r) for r in rows]) > 0


def replay_request(lengths: list[list[int]], max_tokens: int = 64) -> RolloutRequest:
    return RolloutRequest(call_id="c", rollout_id="r", prompts=[Prompt(prompt_token_ids=[5 + i, 6, 7]) for i in range(len(lengths))],
                          group_size=len(lengths[0]), sampling=SamplingParams(max_tokens=max_tokens, seed=3),
                          replay_lengths=lengths)


LIMITS = Limits(max_group_size=64, max_prompts=100, max_model_len=4096, vocab_size=259)


def build(req: RolloutRequest, policy: str):
    return build_rollout(req, ByteTokenizer(), LIMITS, policy, now_s=0.0)


@pytest.mark.parametrize("policy", ["request", "context"])
def test_a_replayed_sample_ends_at_its_trace_length_and_the_policy_is_not_told(policy):
    """Replay lengths become each request's forced length, not its oracle length (except for
    oracles); chunks are cut to them, EOS is ignored, and a sample that reaches its length
    finishes as at an EOS ("stop"), one at max_tokens as "length"."""
    lengths = [[5, 64, 20]]
    r = build(replay_request(lengths), policy)
    assert [q.forced_length for q in r.groups[0].requests] == [5, 64, 20]
    assert all(q.oracle_length == q.forced_length for q in r.groups[0].requests)  # the truth, for oracles only
    sched = Scheduler(SchedulerConfig(policy=policy, chunk_size_tokens=16), Clock())
    sched.engine_joined(0, caps())
    sched.submit(r)
    seen_budgets = []
    for _ in range(100):
        ds = sched.schedule()
        if not ds and r.done:
            break
        for d in ds:
            q = d.request
            seen_budgets.append(q.sampling.max_tokens)
            assert d.task.sampling.ignore_eos
            assert d.task.sampling.max_tokens <= q.forced_length - q.num_generated_tokens
            run_chunk(sched, d, 10**6)  # the engine would go on: only the task's budget stops it
    assert r.done
    assert [len(q.generated_token_ids) for q in r.groups[0].requests] == [5, 64, 20]
    assert [q.finish_reason for q in r.groups[0].requests] == ["stop", "length", "stop"]
    assert set(seen_budgets) == {64}  # the policy's view: the rollout's budget, not the trace


def test_replay_lengths_of_the_wrong_shape_are_refused_before_anything_runs():
    """Rows per prompt, lengths per row and each length in 1..max_tokens."""
    with pytest.raises(RequestRejected) as e:
        build(replay_request([[5, 6], [7]]), "context")
    assert e.value.code == "bad_replay_lengths"
    with pytest.raises(RequestRejected) as e:
        build(replay_request([[5, 65]]), "context")
    assert e.value.code == "bad_replay_lengths" and "replay_lengths[0][1] is 65" in str(e.value)
    assert build(replay_request([[5, 6]]), "oracle").groups[0].requests[1].oracle_length == 6


def test_a_rollout_the_engines_kv_holds_goes_as_whole_samples_and_a_larger_one_in_chunks():
    """12 groups x 8 samples, a 1,901-token budget: two engines of 46,592 tokens hold their
    expected work, so every sample is dispatched whole at once; on engines of a quarter of
    that the same rollout goes in chunks of ``chunk_size_tokens``. ``chunking = "always"``
    keeps the chunks."""
    def first_budgets(kv_tokens: int, chunking: str = "auto") -> tuple[set[int], bool]:
        sched = scheduler("context", engines=2, kv_tokens=kv_tokens, chunk_size_tokens=512, chunking=chunking)
        sched.submit(rollout("context", [[600] * 8 for _ in range(12)], max_tokens=1901, prompt_len=64))
        ds = sched.schedule()
        return {d.task.sampling.max_tokens for d in ds}, sched.scheduling_status().whole_samples

    assert first_budgets(46_592) == ({1901}, True)
    assert first_budgets(46_592 // 4) == ({512}, False)
    assert first_budgets(46_592, chunking="always") == ({512}, False)
