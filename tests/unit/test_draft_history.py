"""Drafts from history (dataplane/draft_history.py): a prompt's earlier responses, bounded
in memory, keyed by the prompt's tokens, retired by measured acceptance; and the draft
client seeding a returning prompt's group with them."""

from __future__ import annotations

import random

import pytest

from seer.dataplane.draft_client import DraftClient
from seer.dataplane.draft_history import DraftHistory


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_prompt_is_known_by_its_tokens_and_keeps_its_longest_responses():
    """Lookup by the same token ids finds the latest rollout's longest responses."""
    history = DraftHistory(max_responses=2)
    history.record([1, 2, 3], [[5], [5, 6, 7], [], [5, 6]], weights_version=0)
    responses, age = history.lookup([1, 2, 3])
    assert [list(r) for r in responses] == [[5, 6, 7], [5, 6]] and age == 0
    assert history.lookup([1, 2, 4]) == ([], -1)
    history.record([1, 2, 3], [[9, 9]], weights_version=0)  # a later rollout replaces it
    assert [list(r) for r in history.lookup([1, 2, 3])[0]] == [[9, 9]]
    assert history.num_tokens == 2


def test_memory_is_bounded_and_the_least_recently_used_prompt_goes_first():
    """Past max_tokens the prompt used longest ago is dropped."""
    history = DraftHistory(max_tokens=10)
    history.record([1], [[0] * 4], 0)
    history.record([2], [[0] * 4], 0)
    history.lookup([1])  # used: [2] is now the oldest
    history.record([3], [[0] * 4], 0)
    assert history.num_tokens == 8 and len(history) == 2
    assert history.lookup([2]) == ([], -1)
    assert history.lookup([1])[0] and history.lookup([3])[0]


def test_age_counts_weight_updates_and_an_older_rollout_never_replaces_a_newer_one():
    history = DraftHistory()
    history.record([1], [[7]], weights_version=2)
    history.set_weights_version(5)
    assert history.lookup([1])[1] == 3
    history.record([1], [[8]], weights_version=1)
    assert [list(r) for r in history.lookup([1])[0]] == [[7]]


def test_history_whose_drafts_fail_is_retired_with_everything_older():
    """Drafts from history one update old are rejected while live drafts are accepted:
    once that is credible, age-1 history is no longer handed out (nor older), and its
    entries are dropped; age-0 history stays."""
    rng = random.Random(0)
    history = DraftHistory()
    history.record([1], [[5, 6]], weights_version=0)
    history.set_weights_version(1)
    history.record([2], [[5, 6]], weights_version=1)
    for _ in range(200):
        history.observe(None, 4, 3 if rng.random() < 0.8 else 1)
    for _ in range(40):
        history.observe(1, 4, 0)
        if history.retired_age is not None:
            break
    assert history.retired_age == 1
    assert history.lookup([1]) == ([], -1)
    assert history.lookup([2])[1] == 0
    assert len(history) == 1


def test_history_as_good_as_live_drafts_stays():
    """Drafts from history accepted as often as live ones never retire it."""
    rng = random.Random(1)
    history = DraftHistory()
    for _ in range(2000):
        history.observe(None, 4, 2 if rng.random() < 0.5 else 1)
        history.observe(0, 4, 2 if rng.random() < 0.5 else 1)
    assert history.retired_age is None and history.useful(0)


def test_the_client_seeds_a_returning_prompts_group_from_its_earlier_rollout():
    """Epoch 1's group goes idle; epoch 2's group with the same prompt registers: the idle
    one is recorded as history at once (no need to wait for its TTL) and seeds the new one."""
    clock = Clock()
    client = DraftClient(None, 0, clock=clock, history=DraftHistory())
    client.register_group("e1/g", 0, [1, 2, 3])
    client.append("e1/g", "e1/g/0", 0, [10, 11, 12, 13])
    client.unregister_group("e1/g")
    client.register_group("e2/g", 0, [1, 2, 3])
    assert client.history_age("e2/g") == 0
    assert client.store.group_ids() == ["e2/g"]
    draft = client.store.speculate("e2/g", "e2/g/0", 3, context_tail=[10])
    assert draft.linear == [11, 12, 13] and draft.num_history_support == 1
    assert client.history_age("other") == -1


def test_groups_expired_or_retired_by_new_weights_become_history():
    """A group dropped after its TTL, or by a weights reset, leaves its responses as history."""
    clock = Clock()
    client = DraftClient(None, 0, clock=clock, ttl_s=5.0, history=DraftHistory())
    client.register_group("a", 0, [1])
    client.append("a", "a/0", 0, [7, 8])
    client.unregister_group("a")
    clock.now = 10.0
    client.sync()
    assert client.store.group_ids() == [] and client.history.lookup([1])[1] == 0
    client.register_group("b", 0, [2])
    client.append("b", "b/0", 0, [9, 9])
    client.register_group("c", 1, [3])  # new weights: "b" is retired, its text kept as history
    assert client.history.lookup([2])[1] == 1
    assert client.store.group_ids() == ["c"]


def test_bad_bounds_are_refused():
    with pytest.raises(ValueError):
        DraftHistory(max_tokens=-1)
    with pytest.raises(ValueError):
        DraftHistory(max_responses=0)
