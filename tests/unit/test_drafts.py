"""The grouped draft store (dataplane/drafts.py): hand-checkable drafts, group sharing,
multi-path drafts, idempotent appends, dropping and weight-version resets. Every test runs
on both indexes (the compiled one and the Python reference)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from structlog.testing import capture_logs

from seer.dataplane import drafts
from seer.dataplane.drafts import DraftStore, DraftStoreConfig


@pytest.fixture(autouse=True, params=["native", "python"])
def index_kind(request, monkeypatch):
    """The default index ("auto") is the compiled one where numba imports; the "python"
    run makes "auto" pick the reference index."""
    if request.param == "python":
        monkeypatch.setattr(drafts, "native_index_available", lambda: False)
    elif not drafts.native_index_available():
        pytest.skip("numba is not importable: no compiled index")
    assert DraftStore().index_kind == request.param
    return request.param


def test_own_repetition_drafts_its_continuation():
    """A request that repeats itself gets the tokens that followed the earlier copy."""
    store = DraftStore()
    store.append("g", "r0", [5, 1, 2, 3, 4, 9, 1, 2, 3])
    draft = store.speculate("g", "r0", 4)
    assert draft.match_tokens == 3  # "1 2 3" is the longest repeated suffix
    assert draft.linear == [4, 9, 1, 2]
    assert draft.probs[0] == [1.0, 1.0, 1.0, 1.0]


def test_sibling_tokens_give_drafts_self_only_cannot():
    """With only its own tokens the request has nothing to draft; a sibling that already
    wrote the same words supplies the continuation."""
    store = DraftStore()
    store.append("g", "r0", [7, 8, 1, 2, 3])
    assert store.speculate("g", "r0", 4).paths == []
    store.append("g", "r1", [1, 2, 3, 4, 5])
    assert store.speculate("g", "r0", 4).linear == [4, 5]


def test_other_groups_never_leak_into_a_draft():
    """Drafts come only from the request's own group."""
    store = DraftStore()
    store.append("g0", "r0", [1, 2, 3])
    store.append("g1", "s0", [1, 2, 3, 4, 5])
    assert store.speculate("g0", "r0", 4).paths == []
    assert store.speculate("missing", "r0", 4).paths == []


def test_majority_continuation_wins_and_probabilities_are_frequencies():
    """Three siblings continue "1 2" with 7, one with 8: the linear draft takes 7 (p 3/4)."""
    store = DraftStore()
    for rid, nxt in [("a", 7), ("b", 8), ("c", 7), ("d", 7)]:
        store.append("g", rid, [1, 2, nxt, 0])
    draft = store.speculate("g", "x", 2, context_tail=[1, 2])
    assert draft.linear == [7, 0]
    assert draft.probs[0] == [0.75, 0.75]


def test_longest_pattern_beats_a_more_frequent_short_one():
    """After "5 1 2" the one sibling that also wrote "5 1 2" is followed, not the
    majority after "1 2" alone."""
    store = DraftStore()
    store.append("g", "a", [1, 2, 7])
    store.append("g", "b", [1, 2, 7])
    store.append("g", "c", [5, 1, 2, 8])
    draft = store.speculate("g", "x", 1, context_tail=[5, 1, 2])
    assert (draft.match_tokens, draft.linear) == (3, [8])
    assert store.speculate("g", "x", 1, context_tail=[6, 1, 2]).linear == [7]


def test_pattern_bounds_limit_matching():
    """A match shorter than min_pattern_tokens drafts nothing; the search starts at max."""
    store = DraftStore(DraftStoreConfig(min_pattern_tokens=2, max_pattern_tokens=3))
    store.append("g", "a", [1, 2, 3, 4, 9, 9])
    assert store.speculate("g", "x", 2, context_tail=[8, 4]).paths == []  # only "4" matches
    assert store.speculate("g", "x", 2, context_tail=[0, 1, 2, 3]).match_tokens == 3
    assert store.speculate("g", "x", 2, context_tail=[0, 1, 2, 3], max_pattern_tokens=2).match_tokens == 2


def test_multi_path_branches_where_siblings_disagree():
    """Continuations 5 6 7 (twice) and 5 6 9: the linear draft is 5 6 7; the second path
    shares 5 6 and branches to 9; path probabilities are products of shares."""
    store = DraftStore()
    store.append("g", "a", [1, 5, 6, 7])
    store.append("g", "b", [1, 5, 6, 9])
    store.append("g", "c", [1, 5, 6, 7])
    draft = store.speculate("g", "x", 3, context_tail=[1], top_k=4)
    assert draft.paths == [[5, 6, 7], [5, 6, 9]]  # only two distinct continuations exist
    assert draft.probs[1] == pytest.approx([1.0, 1.0, 1 / 3])
    assert store.speculate("g", "x", 3, context_tail=[1], top_k=1).paths == [[5, 6, 7]]


def test_linear_draft_maximises_expected_accepted_tokens():
    """Not the most frequent next token but the best whole path: after 9, token 4 is
    more frequent (3 of 5) but its tail splits three ways (expected 0.6 + 0.2 + 0.2 =
    1.0 accepted tokens), while 5 5 5 (2 of 5, then certain) is worth 0.4 * 3 = 1.2.
    The second path then covers the 4 branch."""
    store = DraftStore(DraftStoreConfig(min_token_prob=0.0))
    for rid, cont in [("a", [4, 1, 0]), ("b", [4, 2, 0]), ("c", [4, 3, 0]), ("d", [5, 5, 5]), ("e", [5, 5, 5])]:
        store.append("g", rid, [9, *cont])
    draft = store.speculate("g", "x", 3, context_tail=[9], top_k=2)
    assert draft.paths[0] == [5, 5, 5]
    assert draft.probs[0] == pytest.approx([0.4, 0.4, 0.4])
    assert draft.paths[1][0] == 4 and draft.probs[1][:2] == pytest.approx([0.6, 0.2])


def test_min_token_prob_cuts_unlikely_tokens():
    """A continuation seen once among five occurrences (p 0.2) is not drafted at 0.25."""
    store = DraftStore(DraftStoreConfig(min_token_prob=0.25))
    for rid, nxt in [("a", 7), ("b", 7), ("c", 7), ("d", 7), ("e", 8)]:
        store.append("g", rid, [1, nxt])
    assert store.speculate("g", "x", 1, context_tail=[1], top_k=4).paths == [[7]]


def test_draft_length_is_capped_by_max_spec_tokens():
    """Never more than max_spec_tokens tokens per path."""
    store = DraftStore()
    store.append("g", "a", list(range(20)))
    assert store.speculate("g", "x", 3, context_tail=[4]).linear == [5, 6, 7]


def test_prompt_is_used_as_context_and_as_a_source():
    """A response with fewer tokens than the pattern length is matched together with
    the end of the prompt; the prompt's own text can be drafted (copying a number)."""
    store = DraftStore()
    store.set_prompt("g", [40, 41, 42, 43, 44])
    store.append("g", "r0", [41])
    draft = store.speculate("g", "r0", 2)  # own context: prompt tail + [41]
    assert draft.linear == [42, 43]


def test_chunked_appends_equal_one_append():
    """Appending in pieces indexes exactly what one append does."""
    whole, pieces = DraftStore(), DraftStore()
    tokens = [1, 2, 3, 1, 2, 4, 1, 2, 3, 5, 1, 2]
    whole.append("g", "a", tokens)
    for i in range(0, len(tokens), 5):
        pieces.append("g", "a", tokens[i:i + 5])
    assert whole.speculate("g", "a", 3, top_k=3) == pieces.speculate("g", "a", 3, top_k=3)
    assert pieces.tokens("g", "a") == tokens


def test_start_pos_makes_resent_chunks_idempotent_and_refuses_gaps():
    """Re-sent tokens are skipped, overlap is trimmed, and a gap is refused."""
    store = DraftStore()
    assert store.append("g", "a", [1, 2, 3], start_pos=0)
    assert store.append("g", "a", [1, 2, 3], start_pos=0)  # duplicate chunk
    assert store.append("g", "a", [3, 4], start_pos=2)  # overlaps one token
    assert not store.append("g", "a", [9], start_pos=6)  # tokens 4..5 missing
    assert store.tokens("g", "a") == [1, 2, 3, 4]
    assert store.num_tokens("g") == 4
    with pytest.raises(ValueError, match="start_pos"):
        store.append("g", "a", [5], start_pos=-1)


def test_drop_group_forgets_it():
    """A dropped group drafts nothing and holds no tokens."""
    store = DraftStore()
    store.append("g", "a", [1, 2, 1])
    assert store.speculate("g", "a", 1).linear == [2]
    with capture_logs() as logs:
        store.drop_group("g")
    assert store.group_ids() == [] and store.speculate("g", "a", 1).paths == []
    assert logs[0]["event"] == "draft_group_dropped" and logs[0]["num_tokens"] == 3


def test_reset_for_new_weights_drops_trees_and_refuses_stale_tokens():
    """After a weight update no old-policy token drafts anything, including tokens
    still in flight from the previous version."""
    store = DraftStore(weights_version=1)
    store.append("g", "a", [1, 2, 3, 1, 2], weights_version=1)
    with capture_logs() as logs:
        store.reset(2)
    assert logs[0]["event"] == "draft_store_reset" and logs[0]["num_groups_dropped"] == 1
    assert not store.append("g", "a", [3], weights_version=1)
    assert store.speculate("g", "a", 2, context_tail=[1, 2]).paths == []
    assert store.append("g", "b", [1, 2, 7], weights_version=2)
    assert store.speculate("g", "a", 2, context_tail=[1, 2]).linear == [7]


def test_config_rejects_bad_bounds():
    """Pattern bounds must be ordered and positive."""
    with pytest.raises(ValueError, match="min_pattern_tokens"):
        DraftStoreConfig(min_pattern_tokens=4, max_pattern_tokens=2)
    with pytest.raises(ValueError, match="min_token_prob"):
        DraftStoreConfig(min_token_prob=1.5)


def _brute_force_match(seqs: list[list[int]], context: list[int], lo: int, hi: int) -> tuple[int, set[int]]:
    """Longest context suffix (lo..hi tokens) followed by something somewhere, and the
    set of tokens that follow it."""
    for n in range(min(hi, len(context)), lo - 1, -1):
        pattern = context[-n:]
        nexts = {s[i + n] for s in seqs for i in range(len(s) - n) if s[i:i + n] == pattern}
        if nexts:
            return n, nexts
    return 0, set()


@settings(max_examples=150, deadline=None)
@given(seqs=st.lists(st.lists(st.integers(0, 3), max_size=25), min_size=1, max_size=4),
       context=st.lists(st.integers(0, 3), min_size=1, max_size=6))
def test_match_length_and_first_token_agree_with_brute_force(seqs, context):
    """The matched pattern is the longest one any sequence continues, and every path
    starts with a token that really followed it."""
    store = DraftStore(DraftStoreConfig(min_pattern_tokens=1, max_pattern_tokens=4, min_token_prob=0.0))
    for i, seq in enumerate(seqs):
        store.append("g", f"r{i}", seq)
    draft = store.speculate("g", "x", 3, context_tail=context, top_k=4)
    n, nexts = _brute_force_match(seqs, context, 1, 4)
    assert draft.match_tokens == n
    assert {p[0] for p in draft.paths} <= nexts
    assert bool(draft.paths) == bool(nexts)
