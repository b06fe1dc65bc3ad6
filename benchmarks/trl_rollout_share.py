"""The rollout's share of each TRL GRPO training step: Seer generating (weights pushed every
step) against TRL generating itself (``use_vllm=False``, ``model.generate``), same machine,
same model, prompts, G, lengths and seed, measured in one run (baseline second).

    .venv/bin/python benchmarks/trl_rollout_share.py --steps 5 --group-size 4 --prompts-per-step 1 \
        --max-completion-length 48

Runs ``examples/trl_grpo.py`` twice in subprocesses (``--rollout seer --start-daemon``,
then ``--rollout trl``) and prints per-step times and the mean shares with ratios against
the baseline. "generate" is TRL's ``_generate`` (for Seer: the rollout call, incl.
tokenizing, gather and slicing); "sync" is the weight push (write safetensors + update_weights).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from statistics import mean

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "trl_grpo.py"


def run(rollout: str, a: argparse.Namespace, out: Path) -> dict:
    cmd = [sys.executable, str(EXAMPLE), "--rollout", rollout, "--steps", str(a.steps), "--group-size",
           str(a.group_size), "--prompts-per-step", str(a.prompts_per_step), "--max-completion-length",
           str(a.max_completion_length), "--seed", str(a.seed), "--json", str(out)]
    if rollout == "seer":
        cmd += ["--start-daemon", "--engines", str(a.engines)]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, timeout=7200)
    return json.loads(out.read_text())


def summary(result: dict) -> dict:
    steps = result["steps"]
    sync = [s["sync_write_s"] + s["sync_update_s"] for s in steps]
    return {"step_s": mean(s["step_s"] for s in steps), "generate_s": mean(s["generate_s"] for s in steps),
            "sync_s": mean(sync), "share": mean(s["generate_s"] / s["step_s"] for s in steps),
            "share_with_sync": mean((s["generate_s"] + y) / s["step_s"] for s, y in zip(steps, sync, strict=True)),
            "write_s": mean(s["sync_write_s"] for s in steps), "update_s": mean(s["sync_update_s"] for s in steps)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--prompts-per-step", type=int, default=1)
    p.add_argument("--max-completion-length", type=int, default=48)
    p.add_argument("--engines", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="trl-share-"))
    results = {name: run(name, a, folder / f"{name}.json") for name in ("seer", "trl")}

    print(f"\nper step ({a.steps} steps, G={a.group_size}, {a.prompts_per_step} prompt(s)/step, "
          f"max_completion_length={a.max_completion_length})")
    print(f"{'rollout':<8} {'step':>4} {'step s':>8} {'generate s':>10} {'share':>6} {'sync s':>7}")
    for name, result in results.items():
        for s in result["steps"]:
            print(f"{name:<8} {s['step']:>4} {s['step_s']:>8.2f} {s['generate_s']:>10.2f} "
                  f"{s['generate_s'] / s['step_s']:>6.1%} {s['sync_write_s'] + s['sync_update_s']:>7.2f}")
    base = summary(results["trl"])
    print(f"\nmeans (ratio = Seer / TRL baseline)")
    print(f"{'':<26} {'seer':>9} {'trl':>9} {'ratio':>7}")
    seer = summary(results["seer"])
    for key, label in [("step_s", "step s"), ("generate_s", "generate s"), ("sync_s", "weight sync s"),
                       ("write_s", "  write safetensors s"), ("update_s", "  update_weights s"),
                       ("share", "generate share of step"), ("share_with_sync", "generate+sync share")]:
        ratio = f"{seer[key] / base[key]:>7.2f}" if base[key] else f"{'-':>7}"
        print(f"{label:<26} {seer[key]:>9.3f} {base[key]:>9.3f} {ratio}")
    tokens = [r["num_output_tokens"] for r in results["seer"]["rollouts"]]
    print(f"seer rollouts: output tokens per step {tokens}; weights versions "
          f"{[s['weights_version'] for s in results['seer']['steps']]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
