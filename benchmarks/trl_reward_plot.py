"""The reward curve of ``examples/trl_grpo.py --log`` runs, as a PNG.

    .venv/bin/python benchmarks/trl_reward_plot.py runs/seer.jsonl [runs/trl.jsonl ...] --out docs/trl_grpo_reward.png

One line per log: each step's mean reward (dots) and its 5-step moving mean (line); the
legend gives the run's held-out greedy accuracy before and after training.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

WINDOW = 5


def read_log(path: Path) -> tuple[list[dict], dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return rows[:-1], rows[-1]


def moving_mean(values: list[float], window: int = WINDOW) -> list[float]:
    return [sum(values[max(0, i - window + 1):i + 1]) / len(values[max(0, i - window + 1):i + 1])
            for i in range(len(values))]


def plot(logs: list[Path], out: Path, title: str) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for index, path in enumerate(logs):
        steps, final = read_log(path)
        x = [s["step"] for s in steps]
        y = [s["reward_mean"] for s in steps]
        colour = f"C{index}"
        label = (f"{final.get('rollout', path.stem)}: held-out greedy accuracy "
                 f"{final['eval_before']:.0%} -> {final['eval_after']:.0%}")
        ax.plot(x, y, "o", color=colour, alpha=0.35, markersize=3)
        ax.plot(x, moving_mean(y), "-", color=colour, label=label)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(f"mean reward of the step's samples (line: {WINDOW}-step mean)")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", fontsize=8)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("logs", nargs="+", type=Path)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--title", default="GRPO on SmolLM2-135M-Instruct, additions of 1..12 (examples/trl_grpo.py)")
    a = p.parse_args()
    plot(a.logs, a.out, a.title)
    print(a.out)


if __name__ == "__main__":
    main()
