"""A multi-turn feedback environment on the arithmetic task, rolled out through Seer.

The model answers; the environment grades the answer's last number and, if it is wrong,
says so and asks again (up to ``--max-turns`` turns); a right answer ends the trajectory
with reward 1. Each sample comes back with every token id (the model's and the appended
feedback's, as SmolLM2's chat template renders it), ``loss_mask`` (1 = sampled), the
logprobs and one ``TurnRecord`` per model turn.

    .venv/bin/python examples/agentic_feedback.py --start-daemon     # its own daemon (2 vLLM engines)
    .venv/bin/python examples/agentic_feedback.py --address ipc:///path/to/run/client.sock

Prints one line per trajectory and a summary; ``--out FILE`` writes the samples as JSON.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgspec

sys.path.insert(0, str(Path(__file__).parent))

import arithmetic  # noqa: E402 - the example's task, next to this file

from seer.agentic import EnvReply, Turn  # noqa: E402
from seer.client import SamplingParams, SeerClient  # noqa: E402
from seer.protocol import TrajectorySpec  # noqa: E402

def make_env(answers: list[str]):
    def env(turn: Turn) -> EnvReply:
        return arithmetic.feedback_reply(turn.text, answers[turn.group_index])
    return env


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--address", help="a running daemon's client address (default: the default run dir's)")
    p.add_argument("--start-daemon", action="store_true", help="start a daemon on the default seer.toml, owned "
                   "by this process, and stop it at the end")
    p.add_argument("--problems", type=int, default=8)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--max-turns", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=64, help="per turn")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path)
    a = p.parse_args()
    rows = arithmetic.load(arithmetic.EVAL_FILE)[:a.problems]
    run_dir = None
    if a.start_daemon:
        run_dir = Path(tempfile.mkdtemp(prefix="seer-agentic-")) / "run"
        subprocess.run([sys.executable, "-m", "seer.cli.main", "start", "--run-dir", str(run_dir), "--owner-pid",
                        str(os.getpid())], check=True, timeout=900)
    try:
        with SeerClient(a.address, run_dir=run_dir, timeout_s=300) as client:
            t0 = time.perf_counter()
            result = client.rollout([{"id": r["id"], "messages": r["messages"]} for r in rows], a.group_size,
                                    SamplingParams(max_tokens=a.max_tokens, temperature=1.0, seed=a.seed),
                                    env=make_env([r["answer"] for r in rows]),
                                    trajectory=TrajectorySpec(max_turns=a.max_turns))
            wall = time.perf_counter() - t0
    finally:
        if run_dir is not None:
            subprocess.run([sys.executable, "-m", "seer.cli.main", "stop", "--run-dir", str(run_dir)], timeout=300)
    samples = [(g, s) for g in result.groups for s in g.samples]
    for g, s in samples:
        turns = " | ".join(f"t{k}: {t.end - t.start} sampled, {t.reused_tokens} reused, {t.outcome}"
                           for k, t in enumerate(s.turns))
        print(f"{g.prompt_id:>10} #{s.sample_index}  reward {s.reward}  {s.finish_reason:<9} {turns}")
    solved = sum(1 for _, s in samples if s.reward == 1.0)
    by_turn = [sum(1 for _, s in samples if s.reward == 1.0 and len(s.turns) == k + 1) for k in range(a.max_turns)]
    sampled = sum(sum(s.loss_mask) for _, s in samples)
    appended = sum(len(s.loss_mask) - sum(s.loss_mask) for _, s in samples)
    print(f"\n{len(samples)} trajectories in {wall:.1f} s: {solved} solved ({', '.join(f'{n} at turn {k + 1}' for k, n in enumerate(by_turn))}); "
          f"{sampled} sampled tokens ({sampled / wall:.0f}/s), {appended} appended feedback tokens")
    if a.out:
        a.out.write_bytes(msgspec.json.encode([{"prompt_id": g.prompt_id, **msgspec.to_builtins(s)}
                                               for g, s in samples]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
