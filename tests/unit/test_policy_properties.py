"""Scheduler invariants of the chunked policies, property-based: for any small workload,
engine count, KV size, chunk size and completion order, probes precede the rest of their
group (context), L̂ never decreases once a sample finished, no task is dispatched twice,
every request finishes exactly once with its true length, and no engine is over-admitted."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from seer.config import SchedulerConfig
from seer.controlplane.policies.ordered import group_estimate
from seer.controlplane.prior import LengthPrior, prompt_key
from seer.controlplane.scheduler import Scheduler
from seer.controlplane.state import Group, Request, RequestState, Rollout
from seer.protocol import EngineCapabilities, SamplingParams
from tests.unit.chunks import finished

BLOCK = 16
MAX_TOKENS = 64


def make_scheduler(policy: str, engines: int, kv: int, chunk: int, interval: int) -> Scheduler:
    config = SchedulerConfig(policy=policy, chunk_size_tokens=chunk, kv_admission_fraction=1.0,  # type: ignore[arg-type]
                             starvation_interval=interval)
    sched = Scheduler(config, lambda: 0.0)
    for e in range(engines):
        sched.engine_joined(e, EngineCapabilities(backend="sim", model="m", dtype="none", max_model_len=4096,
                                                  vocab_size=259, kv_capacity_tokens=kv, block_size=BLOCK))
    return sched


def make_rollout(policy: str, lengths: list[list[int]], rid: str) -> Rollout:
    r = Rollout(rollout_id=rid, policy=policy, accepted_s=0.0)
    for gi, group_lengths in enumerate(lengths):
        g = Group(group_id=f"{rid}/{gi}", rollout=r, group_index=gi, prompt_id=str(gi))
        prompt = [gi + 1] * 16  # the same prompt for group gi in every rollout
        for si, n in enumerate(group_lengths):
            q = Request(request_id=f"{rid}/{gi}/{si}", group=g, sample_index=si, prompt_token_ids=prompt,
                        sampling=SamplingParams(max_tokens=MAX_TOKENS, seed=1))
            q.oracle_length = n
            g.requests.append(q)
        r.groups.append(g)
    return r


EXPECTED_USE = ("context", "oracle-group")  # admission by the length model's expected use


def reservation(policy: str, q: Request, expected: dict[str, int]) -> int:
    """KV a chunk in flight may occupy by its end, as each policy's admission counts it:
    the worst case (context + budget), the exact use for ``oracle`` and ``oracle-full`` (true lengths), the
    length model's expected use for ``context`` and ``oracle-group`` (re-derived from the
    dispatch-time state)."""
    if policy in ("oracle", "oracle-full"):
        return q.context_tokens + min(q.chunk_max_tokens, q.oracle_length - q.num_generated_tokens)
    if policy in EXPECTED_USE:
        return q.context_tokens + min(q.chunk_max_tokens, expected[q.request_id])
    return q.context_tokens + q.chunk_max_tokens


def engine_reserved(view, reservation_of) -> int:
    """An engine's reserved KV as admission counts it: each chunk's reservation rounded up to
    blocks, less its prompt's full blocks, which count once per group in flight there (the
    engine's prefix cache shares them between the group's running samples)."""
    shared = {q.group: len(q.prompt_token_ids) // BLOCK * BLOCK for q in view.inflight.values()}
    own = sum(-(-reservation_of(q) // BLOCK) * BLOCK - shared[q.group] for q in view.inflight.values())
    return own + sum(shared.values())


def run_checked(sched: Scheduler, r: Rollout, lengths: list[list[int]], rng: random.Random, *,
                admits: bool = True) -> list:
    """Drive the rollout to the end, finishing in-flight chunks in random order, checking
    the invariants after every step (with ``admits``, also that no engine is over-admitted:
    the chunked policies' KV admission). Returns the dispatch log."""
    log: list = []
    inflight: dict[int, object] = {}
    task_ids: set[int] = set()
    last_estimate: dict[str, int] = {}
    expected: dict[str, int] = {}  # context: the expected use its admission counted, per request in flight
    for _ in range(20_000):
        for d in sched.schedule():
            if r.policy in EXPECTED_USE:
                q = d.request
                expected[q.request_id] = sched.policy(r.policy)._reserve(q, q.chunk_max_tokens) - q.context_tokens
            assert d.task.task_id not in task_ids, "a task id was dispatched twice"
            assert all(o.request is not d.request for o in inflight.values()), "two chunks of one request in flight"
            task_ids.add(d.task.task_id)
            inflight[d.task.task_id] = d
            log.append(d)
        for view in sched.engines.values():
            reserved = engine_reserved(view, lambda q: reservation(r.policy, q, expected))
            assert not admits or reserved <= view.capabilities.kv_capacity_tokens or view.num_inflight == 1, \
                "over-admitted"
        if not inflight:
            break
        d = inflight.pop(rng.choice(sorted(inflight)))
        q = d.request
        left = lengths[q.group.group_index][q.sample_index] - q.num_generated_tokens
        n = min(d.task.sampling.max_tokens, left)
        done = sched.chunk_finished(finished(d.engine_id, d.task.task_id, [7] * n, [-0.5] * n,
                                    "stop" if n == left else "length"))
        assert done is not None
        assert sched.chunk_finished(finished(d.engine_id, d.task.task_id, [7], [-0.5], "stop")) is None, "finished twice"
        for g in r.groups:
            if g.num_finished:
                est = group_estimate(g, g.requests[0])
                assert est >= last_estimate.get(g.group_id, 0), "L̂ decreased"
                last_estimate[g.group_id] = est
    assert r.done
    for g, gl in zip(r.groups, lengths):
        assert [q.num_generated_tokens for q in g.requests] == [min(n, MAX_TOKENS) for n in gl]
        assert [q.state for q in g.requests] == [RequestState.FINISHED] * len(gl)
        assert r.num_samples_done == sum(len(x) for x in lengths)
    return log


workloads = st.lists(st.lists(st.integers(1, 70), min_size=1, max_size=5), min_size=1, max_size=6)


@settings(max_examples=60, deadline=None, database=None)
@given(policy=st.sampled_from(["divided", "context", "oracle", "oracle-full", "oracle-order", "oracle-group"]),
       lengths=workloads,
       engines=st.integers(1, 3),
       kv=st.sampled_from([48, 96, 400]), chunk=st.sampled_from([8, 16, 64]), interval=st.sampled_from([0, 1, 3]),
       seed=st.integers(0, 1000))
def test_chunked_policies_keep_the_scheduler_invariants(policy, lengths, engines, kv, chunk, interval, seed):
    """Every request finishes once with its true length; no task twice; no over-admission;
    L̂ never decreases; and under context no sample of a group starts before its probe."""
    sched = make_scheduler(policy, engines, kv, chunk, interval)
    r = make_rollout(policy, lengths, "r")
    sched.submit(r)
    log = run_checked(sched, r, lengths, random.Random(seed))
    if policy == "context":
        first: dict[str, int] = {}
        for i, d in enumerate(log):
            first.setdefault(d.request.request_id, i)
        for g in r.groups:
            probe = first[g.requests[0].request_id]
            assert all(first[q.request_id] > probe for q in g.requests[1:]), "a sample started before its probe"


@settings(max_examples=25, deadline=None, database=None)
@given(lengths=workloads, again=workloads, engines=st.integers(1, 3), seed=st.integers(0, 1000))
def test_the_length_prior_keeps_the_invariants_across_rollouts(lengths, again, engines, seed):
    """With the cross-iteration prior, a second rollout of the same prompts keeps every
    invariant, and the prior holds the first rollout's lengths of each prompt."""
    rng = random.Random(seed)
    sched = make_scheduler("context", engines, 400, 16, 3)
    policy = sched.policy("context")
    policy.prior = LengthPrior()
    first = make_rollout("context", lengths, "r1")
    sched.submit(first)
    run_checked(sched, first, lengths, rng)
    second = make_rollout("context", again, "r2")
    sched.submit(second)
    run_checked(sched, second, again, rng)
    # The first rollout's last finishes are learned by the second's first round at the latest.
    for gi, gl in enumerate(lengths[len(again):], start=len(again)):
        assert policy.prior.estimate(prompt_key([gi + 1] * 16)) == min(max(gl), MAX_TOKENS)


def test_prior_replaces_the_max_length_placeholder_until_the_group_has_its_own_finish():
    """A prompt seen before starts at its longest past length, not max_tokens; once a sample
    of the group finishes, L̂ is the group's own again; a new rollout replaces old lengths."""
    prior = LengthPrior(max_prompts=2)
    key = prompt_key([1, 2, 3])
    assert prior.estimate(key) is None
    prior.observe(key, "r1", 40)
    prior.observe(key, "r1", 90)
    assert prior.estimate(key) == 90
    prior.observe(key, "r2", 30)
    assert prior.estimate(key) == 30
    prior.observe(prompt_key([4]), "r2", 1)
    prior.observe(prompt_key([5]), "r2", 1)
    assert prior.estimate(key) is None and len(prior) == 2  # least recently updated evicted

    def fresh(prior_length: int | None):
        sched = make_scheduler("context", 1, 400, 16, 0)
        policy = sched.policy("context")
        policy.prior = LengthPrior() if prior_length is not None else None
        r = make_rollout("context", [[5, 5]], "r1")
        for q in r.groups[0].requests:  # a budget far above every estimate here
            q.sampling = SamplingParams(max_tokens=100_000, seed=1)
        if prior_length is not None:
            policy.prior.observe(prompt_key(r.groups[0].requests[0].prompt_token_ids), "r0", prior_length)
        return policy, r

    estimates = {}
    for past in (None, 50, 5000):
        policy, r = fresh(past)
        sibling = r.groups[0].requests[1]
        before = policy._estimate(sibling)
        probe = r.groups[0].requests[0]
        probe.generated_token_ids, probe.state, probe.finish_reason = [7] * 5, RequestState.FINISHED, "stop"
        r.groups[0].num_finished = 1
        estimates[past] = (before, policy._estimate(sibling))
    # The prompt's past lengths set the estimate while the group has no finish of its own ...
    assert estimates[50][0] < estimates[None][0] and estimates[50][0] < estimates[5000][0]
    # ... and are ignored once it has one.
    assert estimates[50][1] == estimates[5000][1] == estimates[None][1]
