"""benchmarks/agentic_traces.py (the agentic replay's traces, tool texts and metrics) and
rollout_policies.py's reading of an agentic trace."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.benchmark_modules import load_benchmark

SMOLLM = Path.home() / ".cache" / "seer" / "models" / "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("agentic_traces")


@pytest.mark.parametrize("shape", ["swe", "search"])
def test_a_trace_is_deterministic_fits_its_context_and_ends_each_sample_without_a_tool(bench, shape):
    a = bench.generate(shape, 8, 3, seed=4, max_context=4096)
    assert a == bench.generate(shape, 8, 3, seed=4, max_context=4096)
    assert a["trajectories"] != bench.generate(shape, 8, 3, seed=5, max_context=4096)["trajectories"]
    assert len(a["trajectories"]) == 8 and all(len(g) == 3 for g in a["trajectories"])
    for group in a["trajectories"]:
        assert group[0] != group[1]  # siblings share the prompt, not their turns
        for turns in group:
            assert turns[-1]["tool_s"] == 0 and turns[-1]["tool_tokens"] == 0
            assert all(t["tool_tokens"] > 0 for t in turns[:-1])
            assert bench.context_tokens(turns, 100, 11) <= 4096 - bench.MARGIN_TOKENS
            assert all(30 <= t["decode"] <= 200 for t in turns)
            if shape == "search":
                assert 2 <= len(turns) <= 8
                assert all(30 <= t["tool_tokens"] <= 150 and 0.3 <= t["tool_s"] <= 2.0 for t in turns[:-1])
            else:
                assert all(100 <= t["tool_tokens"] <= 800 and t["tool_s"] <= 10.0 for t in turns[:-1])


def test_the_swe_shape_averages_about_eleven_turns(bench):
    trace = bench.generate("swe", 300, 2, seed=0, max_context=4096)
    turns = [len(s) for g in trace["trajectories"] for s in g]
    assert 10 <= sum(turns) / len(turns) <= 12 and max(turns) >= 15


def test_a_small_context_trims_the_turns(bench):
    turns = [{"decode": 100, "tool_s": 1.0, "tool_tokens": 300}] * 5
    kept = bench.fit_context(turns, 1000, 100, 11)
    # 100 + (100 + 300 + 11) x 2 + 100 = 1022 > 1000 - margin: the third turn does not fit
    assert len(kept) == 2 and kept[-1]["tool_tokens"] == 0 and kept[0]["tool_tokens"] == 300
    assert bench.context_tokens(kept, 100, 11) <= 1000


def test_a_trace_file_is_checked(bench, tmp_path):
    path = tmp_path / "t.json"
    path.write_text(json.dumps(bench.generate("search", 2, 2, 0)))
    trace = bench.load_agentic_trace(path)
    assert bench.replay_turns(trace) == [[[t["decode"] for t in s] for s in g] for g in trace["trajectories"]]
    for bad, says in [({"trajectories": [[[{"decode": 0, "tool_s": 0, "tool_tokens": 0}]]]}, "trajectories[0][0][0]"),
                      ({"trajectories": [[[{"decode": 3, "tool_s": 0, "tool_tokens": 0}]], []]}, "non-empty"),
                      ({"trajectories": [[[{"decode": 3, "tool_s": 0, "tool_tokens": 0},
                                           {"decode": 3, "tool_s": 0, "tool_tokens": 0}]]]}, "no tool output")]:
        path.write_text(json.dumps(bad))
        with pytest.raises(ValueError, match=r"\[?" + says.replace("[", r"\[").replace("]", r"\]")):
            bench.load_agentic_trace(path)


def test_re_prefilled_tokens_are_what_a_turn_computes_beyond_what_was_appended(bench):
    """Turn 1 prefilled 40 after 30 appended: 9 re-prefilled (the last sampled token is not);
    a switch of engine between turns counts."""
    def turn(start, end, engines, prefilled, reused, appended):
        return SimpleNamespace(start=start, end=end, engine_ids=engines, prefilled_tokens=prefilled,
                               reused_tokens=reused, appended_tokens=appended, tool_s=0.5)

    sample = SimpleNamespace(sample_index=0, token_ids=[1] * 80, loss_mask=[1] * 20 + [0] * 30 + [1] * 30,
                             finish_reason="stop", turns=[turn(0, 20, [0], 50, 0, 30), turn(50, 80, [1], 40, 60, 0)])
    result = SimpleNamespace(groups=[SimpleNamespace(group_index=0, samples=[sample])])
    trace = {"trajectories": [[[{"decode": 20, "tool_s": 0.5, "tool_tokens": 25}, {"decode": 30, "tool_s": 0,
                                                                                   "tool_tokens": 0}]]]}
    m = bench.run_metrics(result, trace)
    assert (m["sampled_tokens"], m["reprefilled_tokens"], m["prefilled_tokens"], m["reused_tokens"]) == (50, 9, 90, 60)
    assert m["engine_switches"] == 1 and m["off_trace"] == 0 and m["turns"] == 2 and m["daemon_recomputed_tokens"] == 0


def test_the_identity_check_names_the_differing_samples(bench):
    runs = [{"policy": "context", "rep": 0, "digest": "a", "sample_digests": ["x", "y"]},
            {"policy": "sticky", "rep": 0, "digest": "b", "sample_digests": ["x", "z"]}]
    assert bench.identical(runs[:1]) == "yes"
    assert bench.identical(runs) == "NO: samples [1] differ from context#0 in sticky#0"


@pytest.mark.skipif(not (SMOLLM / "tokenizer.json").exists(), reason="SmolLM2 not prepared (seerctl model prepare)")
def test_tool_texts_have_their_token_counts_and_are_the_same_every_time(bench):
    texts = bench.ToolTexts(SMOLLM)
    for n in (30, 150, 800):
        text = texts.text(2, 1, 3, n)
        assert abs(texts.count(text) - n) <= 1 and "<|" not in text
        assert text == texts.text(2, 1, 3, n) != texts.text(2, 1, 4, n)


def test_rollout_policies_reads_an_agentic_trace(tmp_path):
    policies = load_benchmark("rollout_policies")
    path = tmp_path / "t.json"
    path.write_text(json.dumps(load_benchmark("agentic_traces").generate("swe", 2, 2, 0)))
    replay = policies.load_replay(str(path))
    assert replay["agentic"] and len(replay["trajectories"]) == 2
