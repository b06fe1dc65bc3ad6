"""Seer against TRL's own generation in the same GRPO training, interleaved step by step.

    .venv/bin/python benchmarks/trl_rollout_share.py --steps 10 --out runs/trl-share

Starts ``examples/trl_grpo.py --rollout seer --start-daemon`` and ``examples/trl_grpo.py
--rollout trl`` (``use_vllm=False``, ``model.generate``) at once with the same settings
(model, prompts, G, lengths, learning rate, seed). They share a ``--turns`` folder: the two
take turns step by step (and for their evaluations), so each Seer step runs next to a TRL
step under the same machine load and neither runs while the other does. Prints one table:
per step and run, the step's wall time, its rollout ("rollout": TRL's ``_generate``; for
Seer the rollout call incl. tokenizing and slicing), the rollout's share of the step and
the weight sync (Seer: write the segment + ``update_weights``), then medians and means.
Each run's ``--log`` JSONL is kept in ``--out``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from statistics import mean, median

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "trl_grpo.py"


def read_log(path: Path) -> tuple[list[dict], dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return rows[:-1], rows[-1]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--out", default=None, help="folder for the two JSONL logs (default: a temp folder)")
    p.add_argument("--skip-first", type=int, default=1, help="steps left out of the medians and means (warm-up)")
    p.add_argument("example_args", nargs=argparse.REMAINDER, help="after --: more examples/trl_grpo.py arguments")
    a = p.parse_args()
    out = Path(a.out or tempfile.mkdtemp(prefix="trl-share-"))
    out.mkdir(parents=True, exist_ok=True)
    turns = Path(tempfile.mkdtemp(prefix="trl-share-turns-"))
    extra = [x for x in a.example_args if x != "--"]
    procs = {}
    for rollout in ("seer", "trl"):
        cmd = [sys.executable, str(EXAMPLE), "--rollout", rollout, "--steps", str(a.steps), "--turns", str(turns),
               "--log", str(out / f"{rollout}.jsonl"), *extra]
        if rollout == "seer":
            cmd.append("--start-daemon")
        print("$", " ".join(cmd), flush=True)
        procs[rollout] = subprocess.Popen(cmd, stdout=open(out / f"{rollout}.out", "w"), stderr=subprocess.STDOUT)
    codes = {name: proc.wait() for name, proc in procs.items()}
    if any(codes.values()):
        print(f"a run failed: {codes}; see {out}/*.out", file=sys.stderr)
        return 1
    logs = {name: read_log(out / f"{name}.jsonl") for name in procs}

    print(f"\n{'step':>4} | {'seer step s':>11} {'rollout s':>9} {'share':>6} {'sync s':>6} | "
          f"{'trl step s':>10} {'rollout s':>9} {'share':>6}")
    for s, t in zip(logs["seer"][0], logs["trl"][0], strict=True):
        print(f"{s['step']:>4} | {s['step_s']:>11.2f} {s['rollout_s']:>9.2f} {s['rollout_s'] / s['step_s']:>6.1%} "
              f"{s['weight_sync_s']:>6.3f} | {t['step_s']:>10.2f} {t['rollout_s']:>9.2f} "
              f"{t['rollout_s'] / t['step_s']:>6.1%}")
    print(f"\nsteps {a.skip_first + 1}-{a.steps} (step 1 left out: warm-up)" if a.skip_first == 1 else "")
    print(f"{'':<22} {'seer':>9} {'trl':>9} {'seer/trl':>9}")
    for label, key, agg in [("median step s", "step_s", median), ("mean step s", "step_s", mean),
                            ("median rollout s", "rollout_s", median)]:
        seer = agg(r[key] for r in logs["seer"][0][a.skip_first:])
        trl = agg(r[key] for r in logs["trl"][0][a.skip_first:])
        print(f"{label:<22} {seer:>9.2f} {trl:>9.2f} {seer / trl:>9.2f}")
    for name in ("seer", "trl"):
        rows = logs[name][0][a.skip_first:]
        print(f"{name}: rollout share of the step {mean(r['rollout_s'] / r['step_s'] for r in rows):.1%} (mean); "
              f"weight sync median {median(r['weight_sync_s'] for r in rows):.3f} s, "
              f"max {max(r['weight_sync_s'] for r in rows):.3f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
