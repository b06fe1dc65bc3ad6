"""The example's verifiable task: small-number arithmetic, graded on the last number of
the answer. Owns the problems (training and held-out evaluation, kept apart), the prompt
wording and the reward.

    .venv/bin/python examples/arithmetic.py      # (re)writes the two JSONL files, deterministically

Why this task: SmolLM2-135M-Instruct (the 4-bit-degraded bundled copy) knows most of these
sums but often wraps them in explanations that do not fit a short completion or end on
another number, so its sampled reward starts low but not at zero -- a policy gradient has
something to push on. Which operand pairs are evaluated is fixed here and never trained on.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

HERE = Path(__file__).parent
TRAIN_FILE = HERE / "arithmetic_train.jsonl"
EVAL_FILE = HERE / "arithmetic_eval.jsonl"
NUMBER = re.compile(r"-?\d+")
QUESTION = "What is {a} + {b}?"
OPERANDS = range(1, 13)  # a and b
NUM_EVAL = 48  # about: a pair and its mirror go together
SPLIT_SEED = 37


def problems() -> tuple[list[dict], list[dict]]:
    """(training, evaluation) problems: every ordered pair of operands, the evaluation
    pairs drawn once with a fixed seed; a pair and its mirror (3+5, 5+3) stay on one side."""
    pairs = sorted({(min(a, b), max(a, b)) for a in OPERANDS for b in OPERANDS})
    random.Random(SPLIT_SEED).shuffle(pairs)
    held_out = set(pairs[:NUM_EVAL // 2])

    def rows(keep: bool) -> list[dict]:
        out = []
        for a in OPERANDS:
            for b in OPERANDS:
                if ((min(a, b), max(a, b)) in held_out) == keep:
                    out.append({"id": f"add-{a}-{b}", "messages": [{"role": "user", "content": QUESTION.format(a=a, b=b)}],
                                "answer": str(a + b)})
        return out

    evaluation = rows(True)
    training = rows(False)
    random.Random(SPLIT_SEED + 1).shuffle(training)
    return training, evaluation


def last_number(text: str) -> str | None:
    """The last integer in ``text`` (thousands separators removed), or None."""
    found = NUMBER.findall(text.replace(",", ""))
    return found[-1] if found else None


def completion_text(completion) -> str:
    return completion[-1]["content"] if isinstance(completion, list) else completion


def correct(text: str, answer: str) -> bool:
    return last_number(text) == answer


def reward(completions: list, answer: list[str], **kwargs) -> list[float]:
    """TRL reward function: 1.0 when the completion's last number is the sum, else 0.0."""
    return [1.0 if correct(completion_text(c), a) else 0.0 for c, a in zip(completions, answer, strict=True)]


QUESTION_RE = re.compile(r"What is (\d+) \+ (\d+)\?")
FEEDBACK = "That is not right. Work it out again and end with the number."


def answer_of(text: str) -> str | None:
    """The sum a question in ``text`` asks for (the last one), or None."""
    found = QUESTION_RE.findall(text)
    return str(int(found[-1][0]) + int(found[-1][1])) if found else None


def feedback_reply(turn_text: str, answer: str | None):
    """The multi-turn feedback environment's answer (``seer.agentic``): a right answer ends
    the trajectory with reward 1; a wrong one gets the feedback message (reward 0 so far)."""
    from seer.agentic import EnvReply
    from seer.protocol import ChatMessage

    if answer is not None and correct(turn_text, answer):
        return EnvReply(done=True, reward=1.0)
    return EnvReply(messages=[ChatMessage(role="user", content=FEEDBACK)], reward=0.0, tool_name="grader")


def env_reward(completions: list, env_reward: list, **kwargs) -> list[float]:
    """TRL reward function for a run with the feedback environment: the environment's reward."""
    return [float(r) if r is not None else 0.0 for r in env_reward]


def load(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def main() -> None:
    training, evaluation = problems()
    for path, rows in ((TRAIN_FILE, training), (EVAL_FILE, evaluation)):
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        print(f"{path.name}: {len(rows)} problems")


if __name__ == "__main__":
    main()
