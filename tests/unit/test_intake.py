"""build_rollout: a RolloutRequest becomes scheduler state, or a refusal naming the problem."""

from __future__ import annotations

import msgspec
import pytest

from seer.controlplane.intake import Limits, RequestRejected, build_rollout
from seer.controlplane.state import RequestState, derive_sample_seed
from seer.controlplane.tokenizer import ByteTokenizer
from seer.protocol import ChatMessage, Prompt, RolloutRequest, SamplingParams

VOCAB = ByteTokenizer.vocab_size  # 259
LIMITS = Limits(max_group_size=8, max_prompts=100, max_model_len=64, vocab_size=VOCAB)


def request(prompts, group_size=2, **sampling) -> RolloutRequest:
    sampling.setdefault("max_tokens", 16)
    return RolloutRequest(
        call_id="call-1", rollout_id="ro", prompts=prompts, group_size=group_size, sampling=SamplingParams(**sampling)
    )


def build(req: RolloutRequest, policy: str = "group", limits: Limits = LIMITS, tokenizer=None):
    return build_rollout(req, tokenizer or ByteTokenizer(), limits, policy, now_s=5.0)


def rejected(req: RolloutRequest, policy: str = "group", limits: Limits = LIMITS) -> RequestRejected:
    with pytest.raises(RequestRejected) as info:
        build(req, policy, limits)
    return info.value


def ok_prompt(i: int = 0) -> Prompt:
    return Prompt(prompt_token_ids=[5 + i, 6, 7])


# ---------------------------------------------------------------------------- refusals


def test_empty_prompt_list_is_refused():
    """A rollout without prompts is refused with empty_rollout."""
    err = rejected(request([]))
    assert err.code == "empty_rollout"
    assert "no prompts" in str(err)


def test_too_many_prompts_is_refused_naming_the_limit_and_key():
    """More prompts than max_prompts is refused naming the count, the limit and server.max_prompts_per_rollout."""
    limits = Limits(max_group_size=8, max_prompts=3, max_model_len=64, vocab_size=VOCAB)
    err = rejected(request([ok_prompt(i) for i in range(4)]), limits=limits)
    assert err.code == "too_many_prompts"
    assert "4 prompts" in str(err) and "3" in str(err) and "server.max_prompts_per_rollout" in str(err)


@pytest.mark.parametrize("group_size", [0, 9, -1])
def test_group_size_outside_bounds_is_refused(group_size):
    """group_size 0 or above max_group_size is refused naming the bound, the value and server.max_group_size."""
    err = rejected(request([ok_prompt()], group_size=group_size))
    assert err.code == "bad_group_size"
    msg = str(err)
    assert f"got {group_size}" in msg
    assert "between 1 and 8" in msg
    assert "server.max_group_size" in msg


def test_group_size_at_the_limit_is_accepted():
    """group_size equal to max_group_size is accepted."""
    rollout = build(request([ok_prompt()], group_size=8))
    assert len(rollout.groups[0].requests) == 8


@pytest.mark.parametrize(
    ("prompt", "has"),
    [
        (Prompt(id="p-none"), "none"),
        (Prompt(id="p-two", prompt="hi", messages=[ChatMessage("user", "hi")]), "prompt, messages"),
        (Prompt(id="p-two", prompt="hi", prompt_token_ids=[5]), "prompt, prompt_token_ids"),
        (Prompt(id="p-two", messages=[ChatMessage("user", "hi")], prompt_token_ids=[5]), "messages, prompt_token_ids"),
    ],
)
def test_prompt_needs_exactly_one_source(prompt, has):
    """A prompt with none or two of prompt/messages/prompt_token_ids is refused naming its index, id and what it has."""
    err = rejected(request([ok_prompt(), prompt]))
    assert err.code == "bad_prompt"
    msg = str(err)
    assert f"prompt 1 (id {prompt.id!r})" in msg
    assert "exactly one of" in msg
    assert msg.endswith(f"it has {has}")


def test_empty_messages_list_is_refused():
    """An empty `messages` list is refused naming the prompt index and id."""
    err = rejected(request([ok_prompt(), ok_prompt(), Prompt(messages=[])]))
    assert err.code == "bad_prompt"
    assert "prompt 2 (id '2')" in str(err)
    assert "empty `messages`" in str(err)


def test_empty_token_id_list_is_refused():
    """An empty prompt_token_ids list is refused: a prompt needs at least one token."""
    err = rejected(request([Prompt(id="e", prompt_token_ids=[])]))
    assert err.code == "bad_prompt"
    assert "prompt 0 (id 'e')" in str(err) and "empty" in str(err)


@pytest.mark.parametrize(
    ("ids", "first_bad", "more"),
    [([5, -1, 7], -1, ""), ([5, VOCAB, 7], VOCAB, ""), ([VOCAB + 10, -3, 4], VOCAB + 10, " and 1 more")],
)
def test_token_ids_outside_vocabulary_are_refused(ids, first_bad, more):
    """Token ids < 0 or >= vocab_size are refused naming prompt, first bad id, the vocabulary range and the rest."""
    err = rejected(request([ok_prompt(), Prompt(id="tok", prompt_token_ids=ids)]))
    assert err.code == "bad_token_ids"
    assert str(err) == f"prompt 1 (id 'tok') has token id {first_bad} outside the vocabulary [0, {VOCAB}){more}"


def test_token_ids_at_the_vocabulary_edges_are_accepted():
    """Token ids 0 and vocab_size-1 are valid."""
    rollout = build(request([Prompt(prompt_token_ids=[0, VOCAB - 1])]))
    assert rollout.groups[0].requests[0].prompt_token_ids == [0, VOCAB - 1]


def test_prompt_longer_than_max_model_len_is_refused():
    """A prompt that leaves no room to generate is refused naming prompt, its length, the limit and model.max_model_len."""
    err = rejected(request([ok_prompt(), Prompt(id="long", prompt_token_ids=[5] * 64)], max_tokens=1))
    assert err.code == "prompt_too_long"
    msg = str(err)
    assert "prompt 1 (id 'long') has 64 tokens" in msg
    assert "64" in msg and "model.max_model_len" in msg


def test_prompt_plus_max_tokens_over_max_model_len_suggests_the_largest_max_tokens():
    """prompt + max_tokens > max_model_len is refused with the sum, the limit and the largest allowed max_tokens."""
    err = rejected(request([Prompt(id="p", prompt_token_ids=[5] * 50)], max_tokens=20))
    assert err.code == "prompt_too_long"
    msg = str(err)
    assert "prompt 0 (id 'p') has 50 tokens and max_tokens is 20" in msg
    assert "70 > model.max_model_len 64" in msg
    assert "Lower max_tokens to at most 14" in msg


def test_prompt_plus_max_tokens_exactly_max_model_len_is_accepted():
    """prompt + max_tokens == max_model_len fits."""
    rollout = build(request([Prompt(prompt_token_ids=[5] * 50)], max_tokens=14))
    assert rollout.groups[0].requests[0].remaining_tokens == 14


def test_min_tokens_above_max_tokens_is_refused():
    """min_tokens > max_tokens is refused naming both fields and values."""
    err = rejected(request([ok_prompt()], max_tokens=4, min_tokens=5))
    assert err.code == "bad_sampling"
    assert "sampling.min_tokens (5)" in str(err) and "sampling.max_tokens (4)" in str(err)


@pytest.mark.parametrize("bad", [VOCAB, VOCAB + 1000])
def test_stop_token_ids_outside_vocabulary_are_refused(bad):
    """stop_token_ids >= vocab_size are refused naming the field, the id and the vocabulary size."""
    err = rejected(request([ok_prompt()], stop_token_ids=[2, bad]))
    assert err.code == "bad_sampling"
    assert "sampling.stop_token_ids" in str(err) and str(bad) in str(err) and f"size {VOCAB}" in str(err)


def test_unknown_policy_is_refused_listing_the_available_ones():
    """An unknown policy name is refused naming it and the available policies."""
    err = rejected(request([ok_prompt()]), policy="nope")
    assert err.code == "unknown_policy"
    assert "'nope'" in str(err) and "available: context, divided, group, oracle" in str(err)


def test_refusal_is_all_or_nothing_even_for_a_late_bad_prompt():
    """One bad prompt among many refuses the whole rollout (its index is named)."""
    prompts = [ok_prompt(i) for i in range(10)] + [Prompt(id="bad", prompt_token_ids=[VOCAB])]
    err = rejected(request(prompts))
    assert err.code == "bad_token_ids" and "prompt 10 (id 'bad')" in str(err)


# ---------------------------------------------------------------------------- acceptance


class SpyTokenizer:
    """Wraps a ByteTokenizer and records which entry point intake called."""

    vocab_size = VOCAB

    def __init__(self) -> None:
        self.calls: list[str] = []
        self._inner = ByteTokenizer()

    def encode(self, text):
        self.calls.append("encode")
        return self._inner.encode(text)

    def encode_chat(self, messages):
        self.calls.append("encode_chat")
        return self._inner.encode_chat(messages)

    def decode(self, token_ids):
        return self._inner.decode(token_ids)


def test_accepted_rollout_has_request_and_group_ids_of_the_documented_shape():
    """Accepted: group ids `rollout/index`, request ids `rollout/index/sample`, all waiting, G per group."""
    rollout = build(request([ok_prompt(0), ok_prompt(1), ok_prompt(2)], group_size=3))
    assert rollout.rollout_id == "ro" and rollout.policy == "group" and rollout.accepted_s == 5.0
    assert [g.group_id for g in rollout.groups] == ["ro/0", "ro/1", "ro/2"]
    assert [g.group_index for g in rollout.groups] == [0, 1, 2]
    assert rollout.num_samples == 9
    for g in rollout.groups:
        assert [r.request_id for r in g.requests] == [f"{g.group_id}/{j}" for j in range(3)]
        assert [r.sample_index for r in g.requests] == [0, 1, 2]
        assert all(r.group is g and r.state is RequestState.WAITING for r in g.requests)
        assert all(r.sampling.max_tokens == 16 for r in g.requests)
    assert rollout.groups[1].requests[0].prompt_token_ids == [6, 6, 7]


def test_prompt_id_defaults_to_the_index_string():
    """prompt_id is the given id, or the prompt's index as a string when absent."""
    rollout = build(request([Prompt(prompt_token_ids=[5]), Prompt(id="named", prompt_token_ids=[5]),
                             Prompt(prompt_token_ids=[5])]))
    assert [g.prompt_id for g in rollout.groups] == ["0", "named", "2"]


def test_messages_are_tokenized_via_the_chat_path_and_text_via_encode():
    """`messages` go through encode_chat, `prompt` text through encode, token ids are used as given."""
    tok = SpyTokenizer()
    messages = [ChatMessage("system", "be brief"), ChatMessage("user", "2+2?")]
    rollout = build(
        request([Prompt(messages=messages), Prompt(prompt="hello"), Prompt(prompt_token_ids=[9, 8])]), tokenizer=tok
    )
    assert tok.calls == ["encode_chat", "encode"]
    ref = ByteTokenizer()
    assert rollout.groups[0].requests[0].prompt_token_ids == ref.encode_chat(messages)
    assert rollout.groups[0].requests[0].prompt_token_ids == ref.encode("<system>be brief\n<user>2+2?\n<assistant>")
    assert rollout.groups[1].requests[0].prompt_token_ids == ref.encode("hello")
    assert rollout.groups[1].requests[0].prompt_token_ids == [ByteTokenizer.BOS] + [b + 3 for b in b"hello"]
    assert rollout.groups[2].requests[0].prompt_token_ids == [9, 8]


def test_per_sample_seeds_are_derived_from_the_request_seed():
    """Each sample's seed is derive_sample_seed(seed, group, sample); no seed stays None; other fields are kept."""
    rollout = build(request([ok_prompt(0), ok_prompt(1)], group_size=3, seed=77, temperature=0.5))
    seeds = [(r.sampling.seed, derive_sample_seed(77, g.group_index, r.sample_index))
             for g in rollout.groups for r in g.requests]
    assert len(seeds) == 6
    assert all(got == want for got, want in seeds)
    assert len({got for got, _ in seeds}) == 6
    assert all(r.sampling.temperature == 0.5 for g in rollout.groups for r in g.requests)

    unseeded = build(request([ok_prompt()], group_size=2))
    assert [r.sampling.seed for r in unseeded.groups[0].requests] == [None, None]


# ---------------------------------------------------------------------------- oracle input


def with_lengths(req: RolloutRequest, lengths) -> RolloutRequest:
    import msgspec
    return msgspec.structs.replace(req, true_lengths=lengths)


def test_true_lengths_become_each_requests_oracle_length():
    """An oracle rollout's true_lengths[prompt][sample] lands on the matching request."""
    req = with_lengths(request([ok_prompt(0), ok_prompt(1)], seed=7), [[3, 16], [1, 9]])
    rollout = build(req, "oracle")
    assert [[r.oracle_length for r in g.requests] for g in rollout.groups] == [[3, 16], [1, 9]]
    assert all(r.oracle_length is None for g in build(request([ok_prompt()])).groups for r in g.requests)


@pytest.mark.parametrize("policy", ["oracle", "oracle-order"])
def test_an_oracle_rollout_without_true_lengths_is_refused(policy):
    """needs_true_lengths, naming what to send and the online alternative."""
    err = rejected(request([ok_prompt()], seed=7), policy)
    assert err.code == "needs_true_lengths"
    assert "true_lengths" in str(err) and "sampling.seed" in str(err) and "context" in str(err)


@pytest.mark.parametrize(("lengths", "seed", "says"), [
    ([[3, 4]], None, "sampling.seed"),                 # unseeded lengths are not the truth
    ([[3, 4], [5, 6]], 7, "one row per prompt"),        # too many rows
    ([[3]], 7, "one row per prompt"),                   # a short row
    ([[3, 17]], 7, "true_lengths[0][1] is 17"),         # beyond max_tokens
    ([[0, 4]], 7, "true_lengths[0][0] is 0"),           # an empty sample
])
def test_true_lengths_that_cannot_be_the_truth_are_refused(lengths, seed, says):
    """bad_true_lengths names the shape or the value that is wrong."""
    err = rejected(with_lengths(request([ok_prompt()], seed=seed), lengths), "oracle")
    assert err.code == "bad_true_lengths" and says in str(err)


def test_true_lengths_with_a_policy_that_ignores_them_are_refused():
    """A non-oracle policy with true_lengths is refused rather than silently ignoring them."""
    err = rejected(with_lengths(request([ok_prompt()], seed=7), [[3, 4]]), "context")
    assert err.code == "bad_true_lengths" and "does not use it" in str(err)


# ---------------------------------------------------------------------------- speculative switch


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_no_drafts_on_vllm_drafters_is_refused(method):
    """speculative=False on ngram/suffix engines is refused naming the method and the two that can."""
    limits = Limits(max_group_size=8, max_prompts=100, max_model_len=64, vocab_size=VOCAB, speculative_method=method)
    err = rejected(msgspec.structs.replace(request([ok_prompt()]), speculative=False), limits=limits)
    assert err.code == "speculative_unsupported"
    assert repr(method) in str(err) and "'grouped' or 'off'" in str(err) and "speculative=True" in str(err)


@pytest.mark.parametrize(("method", "speculative"), [("grouped", False), ("off", False), ("ngram", True),
                                                     ("grouped", True)])
def test_the_speculative_switch_is_accepted_where_it_can_be_kept(method, speculative):
    """grouped and off accept speculative=False; every method accepts the default; the rollout keeps the flag."""
    limits = Limits(max_group_size=8, max_prompts=100, max_model_len=64, vocab_size=VOCAB, speculative_method=method)
    rollout = build(msgspec.structs.replace(request([ok_prompt()]), speculative=speculative), limits=limits)
    assert rollout.speculative is speculative
