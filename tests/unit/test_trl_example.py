"""The GRPO example's pure parts: the arithmetic task (examples/arithmetic.py), the turns
two runs take (examples/trl_grpo.py) and the reward plot (benchmarks/trl_reward_plot.py)."""

from __future__ import annotations

import importlib.util
import json
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.benchmark_modules import load_benchmark

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def load_example(name: str):
    sys.path.insert(0, str(EXAMPLES))
    try:
        spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(EXAMPLES))


@pytest.fixture(scope="module")
def arithmetic():
    return load_example("arithmetic")


def test_shipped_problem_files_are_what_the_generator_writes(arithmetic):
    """The JSONL files in examples/ are exactly problems(): regenerating them changes nothing."""
    training, evaluation = arithmetic.problems()
    assert arithmetic.load(arithmetic.TRAIN_FILE) == training
    assert arithmetic.load(arithmetic.EVAL_FILE) == evaluation


def test_held_out_problems_never_appear_in_training_even_mirrored(arithmetic):
    """No evaluation pair, in either order, is a training problem; together they cover every pair."""
    training, evaluation = arithmetic.problems()

    def pair(row):
        _, a, b = row["id"].split("-")
        return frozenset((int(a), int(b)))

    assert {pair(r) for r in training}.isdisjoint({pair(r) for r in evaluation})
    assert len(training) + len(evaluation) == len(arithmetic.OPERANDS) ** 2
    assert all(r["answer"] == str(sum(int(x) for x in r["id"].split("-")[1:])) for r in training + evaluation)


@pytest.mark.parametrize(("text", "answer", "reward"), [
    ("7 + 5 = 12", "12", 1.0),
    ("The answer is 12.", "12", 1.0),
    ("12, then 13", "12", 0.0),  # graded on the last number
    ("To add 7 and 5, you", "12", 0.0),  # cut off before any answer
    ("1,200", "1200", 1.0),
    ("-3", "-3", 1.0),
])
def test_reward_is_one_exactly_when_the_last_number_is_the_sum(arithmetic, text, answer, reward):
    """Plain and chat-format completions are graded on their last integer."""
    assert arithmetic.reward([text], [answer]) == [reward]
    assert arithmetic.reward([[{"role": "assistant", "content": text}]], [answer]) == [reward]


def test_two_runs_take_turns_step_by_step(tmp_path):
    """Two runs sharing a turns folder never hold a turn at once, alternate, and the one left
    alone after the other finished is not held up."""
    trl_grpo = load_example("trl_grpo")
    order, inside = [], []

    def run(me, other, steps):
        turns = trl_grpo.Turns(str(tmp_path), me, other)
        for _ in range(steps):
            with turns.hold():
                inside.append(me)
                assert len(inside) == 1
                order.append(me)
                time.sleep(0.01)
                inside.pop()
        turns.finish()

    threads = [threading.Thread(target=run, args=("seer", "trl", 4)), threading.Thread(target=run, args=("trl", "seer", 6))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(order) == ["seer"] * 4 + ["trl"] * 6
    assert all(a != b for a, b in zip(order[:8], order[1:8]))  # strict alternation while both run


def test_reward_plot_draws_every_log(tmp_path):
    """The plot script reads --log JSONL files (steps, then the final object) and writes a PNG."""
    pytest.importorskip("matplotlib")
    plot = load_benchmark("trl_reward_plot")
    logs = []
    for name in ("seer", "trl"):
        path = tmp_path / f"{name}.jsonl"
        rows = [{"step": s, "reward_mean": s / 10} for s in range(1, 8)]
        rows.append({"rollout": name, "eval_before": 0.2, "eval_after": 0.4})
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        logs.append(path)
    out = tmp_path / "reward.png"
    plot.plot(logs, out, "test")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert plot.moving_mean([1, 2, 3, 4, 5, 6], 3) == [1, 1.5, 2, 3, 4, 5]
