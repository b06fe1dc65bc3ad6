"""The compiled draft index (dataplane/draft_index.py) drafts exactly what the Python
reference index (dataplane/drafts.py) drafts: same paths, same probabilities bit for bit,
same matched length and history support, for any interleaving of appends and queries."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from seer.dataplane.drafts import DraftStore, DraftStoreConfig, native_index_available

pytestmark = pytest.mark.skipif(not native_index_available(), reason="numba is not importable: no compiled index")


def _pair(**config) -> tuple[DraftStore, DraftStore]:
    return (DraftStore(DraftStoreConfig(index="python", **config)),
            DraftStore(DraftStoreConfig(index="native", **config)))


def _replay(seed: int, steps: int = 200) -> None:
    rng = random.Random(seed)
    lo = rng.randint(1, 3)
    config = dict(min_pattern_tokens=lo, max_pattern_tokens=rng.randint(lo, 8),
                  max_occurrences=rng.choice([1, 3, 256]), min_token_prob=rng.choice([0.0, 0.1, 0.3]))
    stores = _pair(**config)
    vocab = rng.choice([2, 3, 4, 6, 20, 200])
    num_requests = rng.randint(1, 5)
    prompt = [rng.randrange(vocab) for _ in range(rng.randint(0, 10))]
    history = [[rng.randrange(vocab) for _ in range(rng.randint(0, 30))] for _ in range(rng.randint(0, 3))]
    for store in stores:
        if prompt:
            store.set_prompt("g", prompt)
        store.add_history("g", history)
    for step in range(steps):
        request = f"r{rng.randrange(num_requests)}"
        tokens = [rng.randrange(vocab) for _ in range(rng.randint(1, 4))]
        for store in stores:
            store.append("g", request, tokens)
        query = f"r{rng.randrange(num_requests)}"
        context = None if rng.random() < 0.5 else [rng.randrange(vocab) for _ in range(rng.randint(1, 10))]
        kwargs = {"max_pattern_tokens": rng.randint(1, 8)} if rng.random() < 0.2 else {}
        gamma, top_k = rng.randint(1, 8), rng.randint(1, 4)
        python, native = (s.speculate("g", query, gamma, context_tail=context, top_k=top_k, **kwargs) for s in stores)
        assert native == python, (seed, step)
        assert stores[1].tokens("g", request) == stores[0].tokens("g", request)


def test_same_drafts_as_the_python_index_on_random_groups():
    """200 random groups (alphabets of 2 to 200 tokens, every pattern bound, occurrence cap
    and probability cut, with prompt and history): every draft of 200 steps is equal."""
    for seed in range(200):
        _replay(seed)


@settings(max_examples=100, deadline=None)
@given(seqs=st.lists(st.lists(st.integers(0, 4), max_size=40), min_size=1, max_size=5),
       context=st.lists(st.integers(0, 4), min_size=1, max_size=9),
       order=st.randoms(use_true_random=False))
def test_same_drafts_for_any_interleaving(seqs, context, order):
    """Sequences appended token by token in any interleaving give the same drafts."""
    stores = _pair(min_pattern_tokens=1, max_pattern_tokens=5, min_token_prob=0.0)
    pending = [(i, t) for i, seq in enumerate(seqs) for t in seq]
    cursors = [0] * len(seqs)
    queue = [i for i, seq in enumerate(seqs) for _ in seq]
    order.shuffle(queue)
    for i in queue:
        token = seqs[i][cursors[i]]
        cursors[i] += 1
        for store in stores:
            store.append("g", f"r{i}", [token])
    assert len(pending) == sum(cursors)
    python, native = (s.speculate("g", "x", 4, context_tail=context, top_k=3) for s in stores)
    assert native == python
    python, native = (s.speculate("g", "r0", 4, top_k=2) for s in stores)
    assert native == python


def test_growth_keeps_every_occurrence():
    """Past the first capacities (arena, hash table, sequence slots) nothing is lost: a
    long repetitive group drafts as the Python index does."""
    rng = random.Random(7)
    stores = _pair()
    phrases = [[rng.randrange(50) for _ in range(rng.randint(3, 12))] for _ in range(30)]
    for r in range(12):
        tokens = [t for _ in range(60) for t in rng.choice(phrases)]
        for store in stores:
            store.append("g", f"r{r}", tokens)
        for k in range(0, len(tokens), 97):
            python, native = (s.speculate("g", f"r{r}", 8, context_tail=tokens[:k + 1], top_k=4) for s in stores)
            assert native == python
    assert stores[1].num_tokens("g") == stores[0].num_tokens("g") > 5000


def test_history_support_counts_the_continuations_from_earlier_responses():
    """A draft says how many continuations through its first token came from history."""
    for store in _pair():
        store.add_history("g", [[1, 2, 3], [1, 2, 3], [1, 2, 4]])
        assert store.add_history("g", [[1, 2, 9]]) == 0  # once per group
        store.append("g", "live", [1, 2, 3])
        draft = store.speculate("g", "x", 1, context_tail=[1, 2])
        assert draft.linear == [3]
        assert (draft.num_history_support, draft.num_support) == (2, 3)
        assert store.sequences("g") == {"live": [1, 2, 3]}


def test_native_index_is_refused_without_numba(monkeypatch):
    """Asking for the compiled index where numba is missing names the fix."""
    from seer.dataplane import drafts

    monkeypatch.setattr(drafts, "native_index_available", lambda: False)
    with pytest.raises(ValueError, match="numba"):
        DraftStore(DraftStoreConfig(index="native"))
    assert DraftStore(DraftStoreConfig(index="auto")).index_kind == "python"
