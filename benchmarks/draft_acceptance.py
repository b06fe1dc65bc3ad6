"""Benchmark: how many draft tokens grouped suffix drafting would get accepted on our
model's real outputs (the paper's Table 2, on SmolLM2-135M and the example prompts).

Two steps, so the slow one runs once:

1. ``generate`` samples G responses for N prompts of ``examples/math_prompts.jsonl``
   with real vLLM (offline ``vllm.LLM``, float32, eager, the converted model of
   ``seer.engines.model_store``) at each temperature (0 = greedy, one sample per prompt
   since greedy siblings are identical) and saves prompt and response token ids.
2. ``replay`` walks every sampled response as speculative decoding would: at position
   i the draft store (``seer.dataplane.drafts``) proposes up to gamma tokens from the
   context, the accepted count is the longest draft prefix equal to the actual
   continuation (longest over paths for multi-path drafts), and decoding advances by
   accepted + 1 (the bonus / recovered token). Mean tokens per step is the number the
   paper reports. Why this equals lossless SD's acceptance: docs/speculative-decoding.md.

    .venv/bin/python benchmarks/draft_acceptance.py generate --prompts 16 --group-size 8 \\
        --max-tokens 512 --temperatures 1.0,0.6,0 --out runs/draft-study/samples.json
    .venv/bin/python benchmarks/draft_acceptance.py replay --samples runs/draft-study/samples.json
    .venv/bin/python benchmarks/draft_acceptance.py history --samples runs/draft-study/samples.json

3. ``history`` replays each group with and without an earlier rollout of its prompt in
   the draft store (drafts from history, ``seer.dataplane.draft_history``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def generate(args: argparse.Namespace) -> None:
    # Set before vLLM starts its engine processes: without it one instance takes
    # most of this machine's memory for KV.
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(args.kv_gib))  # whole GiB: vLLM parses an int
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from seer.engines import model_store

    model = args.model or str(model_store.model_dir(Path.home() / ".cache" / "seer"))
    tok = AutoTokenizer.from_pretrained(model)
    rows = [json.loads(line) for line in (REPO / "examples" / "math_prompts.jsonl").read_text().splitlines() if line]
    rows = rows[args.first_prompt: args.first_prompt + args.prompts]
    prompts = [tok.apply_chat_template(r["messages"], add_generation_prompt=True, tokenize=True, return_dict=False)
               for r in rows]
    llm = LLM(model=model, dtype="float32", enforce_eager=True, max_model_len=args.max_tokens + 512, seed=args.seed,
              enable_prefix_caching=True)
    runs = []
    for temperature in [float(t) for t in args.temperatures.split(",")]:
        n = 1 if temperature == 0 else args.group_size
        params = SamplingParams(n=n, temperature=temperature, top_p=1.0, max_tokens=args.max_tokens)
        t0 = time.monotonic()
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        wall_s = time.monotonic() - t0
        groups = [{"id": r["id"], "prompt": p, "samples": [list(c.token_ids) for c in o.outputs]}
                  for r, p, o in zip(rows, prompts, outs, strict=True)]
        num_tokens = sum(len(s) for g in groups for s in g["samples"])
        print(f"temperature {temperature}: {len(groups)} groups x {n}, {num_tokens} tokens in {wall_s:.0f} s",
              file=sys.stderr)
        runs.append({"temperature": temperature, "group_size": n, "max_tokens": args.max_tokens, "groups": groups})
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"model": model, "seed": args.seed, "runs": runs}))
    print(f"saved {out}", file=sys.stderr)


# ---- replay ---------------------------------------------------------------------

GAMMAS = (4, 8)
MULTI_PATHS = 4


def _accepted(paths: list[list[int]], actual: list[int]) -> int:
    """Longest draft prefix equal to the actual continuation, over all paths."""
    best = 0
    for path in paths:
        n = 0
        for d, a in zip(path, actual):
            if d != a:
                break
            n += 1
        best = max(best, n)
    return best


def _siblings(group_size: int, target: int, k: int) -> list[int]:
    """The k samples after ``target`` in the group, cyclically (deterministic choice)."""
    return [(target + j) % group_size for j in range(1, k + 1)]


class _ArcticStore:
    """The same interface over arctic-inference's C++ SuffixTree (one tree per group,
    one sequence id per sample), drafting with vLLM's suffix defaults (tree depth 24,
    max_spec_factor 1.0, min_token_prob 0.1). Its multi-path draft is its token tree
    (``use_tree_spec``), verified as every root-to-leaf path."""

    def __init__(self) -> None:
        from arctic_inference.suffix_decoding._C import SuffixTree

        self.depth = 24
        self.tree = SuffixTree(self.depth)
        self.ids: dict[str, int] = {}
        self.own_context: list[int] = []

    def set_prompt(self, group_id: str, prompt: list[int]) -> None:
        self.tree.extend(0, list(prompt))
        self.own_context = list(prompt)

    def append(self, group_id: str, request_id: str, tokens: list[int]) -> None:
        seq_id = self.ids.setdefault(request_id, len(self.ids) + 1)
        self.tree.extend(seq_id, list(tokens))
        if request_id == "own":
            self.own_context.extend(tokens)

    def speculate(self, group_id: str, request_id: str, gamma: int, top_k: int = 1):
        from seer.dataplane.drafts import Draft

        context = self.own_context[-self.depth:]
        linear = self.tree.speculate(context, gamma, 1.0, 0.0, 0.1, False)
        paths = [list(linear.token_ids)]
        if top_k > 1:
            tree = self.tree.speculate(context, gamma, 1.0, 0.0, 0.1, True)
            ids, parents = list(tree.token_ids), list(tree.parents)
            leaves = set(range(len(ids))) - set(parents)
            for leaf in sorted(leaves):
                path, node = [], leaf
                while node >= 0:
                    path.append(ids[node])
                    node = parents[node]
                paths.append(path[::-1])
        return Draft(paths=paths, probs=[], match_tokens=linear.match_len)


def _acceptance_per_position(store_config, prompt: list[int], samples: list[list[int]], target: int,
                             siblings: list[int], progress: str, arctic: bool = False,
                             history: list[list[int]] | None = None) -> dict[tuple[int, int], list[int]]:
    """For every position i of the target response: tokens a draft made there would get
    accepted, per (gamma, paths). The store's content at i depends only on i (own tokens
    before i; siblings' tokens before i, or all of them; ``history``: an earlier
    rollout's responses, complete), so this is computed once per position and shared by
    every replay that stops there."""
    from seer.dataplane.drafts import DraftStore

    own = samples[target]
    store = _ArcticStore() if arctic else DraftStore(store_config)
    store.set_prompt("g", prompt)
    if history:
        store.add_history("g", history)
    if progress == "all":
        for s in siblings:
            store.append("g", f"s{s}", samples[s])
    out: dict[tuple[int, int], list[int]] = {(g, p): [] for g in GAMMAS for p in (1, MULTI_PATHS)}
    for i in range(len(own)):
        if i:
            store.append("g", "own", own[i - 1:i])
            if progress == "same":
                for s in siblings:
                    store.append("g", f"s{s}", samples[s][i - 1:i])
        actual = own[i:]
        for gamma in GAMMAS:
            draft = store.speculate("g", "own", gamma, top_k=MULTI_PATHS)
            out[(gamma, 1)].append(_accepted(draft.paths[:1], actual))
            out[(gamma, MULTI_PATHS)].append(_accepted(draft.paths, actual))
    return out


def _walk(accepted_at: list[int]) -> tuple[int, int]:
    """Replay decoding along one response: (tokens, steps). Each step emits the accepted
    drafts (never past the response's last token) plus one sampled token."""
    length, i, steps = len(accepted_at), 0, 0
    while i < length:
        i += min(accepted_at[i], length - i - 1) + 1
        steps += 1
    return length, steps


def replay(args: argparse.Namespace) -> None:
    from seer.dataplane.drafts import DraftStoreConfig

    data = json.loads(Path(args.samples).read_text())
    store_config = DraftStoreConfig(min_pattern_tokens=args.min_pattern, max_pattern_tokens=args.max_pattern,
                                    min_token_prob=args.min_token_prob)
    results = []
    for run in data["runs"]:
        group_size = run["group_size"]
        sibling_counts = sorted({k for k in (0, 1, 3, group_size - 1) if k < group_size})
        totals: dict[tuple, list[int]] = {}
        t0 = time.monotonic()
        for group in run["groups"]:
            samples = group["samples"]
            for target in range(group_size):
                for k in sibling_counts:
                    for progress in (["same", "all"] if k else ["same"]):
                        for impl in (["seer", "arctic"] if args.arctic else ["seer"]):
                            per_pos = _acceptance_per_position(store_config, group["prompt"], samples, target,
                                                               _siblings(group_size, target, k), progress,
                                                               arctic=impl == "arctic")
                            for (gamma, paths), accepted_at in per_pos.items():
                                tokens, steps = _walk(accepted_at)
                                acc = totals.setdefault((impl, k, progress, gamma, paths), [0, 0])
                                acc[0] += tokens
                                acc[1] += steps
        print(f"temperature {run['temperature']}: replayed in {time.monotonic() - t0:.0f} s", file=sys.stderr)
        results.append({"temperature": run["temperature"], "group_size": group_size, "groups": len(run["groups"]),
                        "max_tokens": run["max_tokens"],
                        "rows": [{"impl": impl, "siblings": k, "progress": pr, "gamma": g, "paths": p, "tokens": t,
                                  "steps": n, "tokens_per_step": t / n}
                                 for (impl, k, pr, g, p), (t, n) in sorted(totals.items())]})
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    _print_table(results, data["model"], store_config)


def replay_history(args: argparse.Namespace) -> None:
    """Drafts from history: each group's responses replayed with and without an earlier
    rollout of the same prompt in the store. The earlier rollout is the same group of
    ``--history-from`` (another ``generate`` run of the same prompts) or, without it, the
    first half of the group's own samples (independent samples of the same prompt and
    weights: what a second epoch sees when the weights did not move), the second half
    then being the rollout replayed."""
    from seer.dataplane.drafts import DraftStoreConfig

    data = json.loads(Path(args.samples).read_text())
    earlier = json.loads(Path(args.history_from).read_text()) if args.history_from else None
    store_config = DraftStoreConfig(min_pattern_tokens=args.min_pattern, max_pattern_tokens=args.max_pattern,
                                    min_token_prob=args.min_token_prob)
    print("Mean tokens per decoding step (accepted drafts + 1), linear drafts, siblings at the same position; "
          f"history: {'the same prompts in ' + args.history_from if earlier else 'first half of each group'}")
    print(f"{'temperature':>11}{'replayed':>10}{'drafts from':>24}{'history':>9}{'g=4':>7}{'g=8':>7}")
    results = []
    for run in data["runs"]:
        if run["group_size"] < 2:
            continue
        old_run = None if earlier is None else next(
            (r for r in earlier["runs"] if r["temperature"] == run["temperature"]), None)
        if earlier is not None and old_run is None:
            continue
        totals: dict[tuple[str, bool, int], list[int]] = {}
        num_samples = 0
        for gi, group in enumerate(run["groups"]):
            if old_run is not None:
                history, live = old_run["groups"][gi]["samples"], group["samples"]
                assert old_run["groups"][gi]["prompt"] == group["prompt"], "--history-from holds other prompts"
            else:
                half = len(group["samples"]) // 2
                history, live = group["samples"][:half], group["samples"][half:]
            num_samples += len(live)
            for target in range(len(live)):
                others = [j for j in range(len(live)) if j != target]
                for who, siblings in (("self only", []), ("+siblings (same)", others)):
                    for with_history in (False, True):
                        per_pos = _acceptance_per_position(store_config, group["prompt"], live, target, siblings,
                                                           "same", history=history if with_history else None)
                        for gamma in GAMMAS:
                            tokens, steps = _walk(per_pos[(gamma, 1)])
                            acc = totals.setdefault((who, with_history, gamma), [0, 0])
                            acc[0] += tokens
                            acc[1] += steps
        for who in ("self only", "+siblings (same)"):
            for with_history in (False, True):
                cells = [totals[(who, with_history, g)][0] / totals[(who, with_history, g)][1] for g in GAMMAS]
                print(f"{run['temperature']:>11}{num_samples:>10}{who:>24}{'yes' if with_history else 'no':>9}"
                      + "".join(f"{c:>7.2f}" for c in cells))
                results.append({"temperature": run["temperature"], "drafts_from": who, "history": with_history,
                                **{f"gamma_{g}": c for g, c in zip(GAMMAS, cells)}})
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


def _print_table(results: list[dict], model: str, cfg) -> None:
    print(f"Mean tokens per decoding step (accepted drafts + 1), replayed on {Path(model).name} samples;")
    print(f"patterns {cfg.min_pattern_tokens}-{cfg.max_pattern_tokens} tokens, min_token_prob {cfg.min_token_prob}. "
          "'same': siblings' tokens up to the same position; 'all': siblings complete.")
    for res in results:
        rows = {(r["impl"], r["siblings"], r["progress"], r["gamma"], r["paths"]): r for r in res["rows"]}
        temp = "greedy" if res["temperature"] == 0 else f"temperature {res['temperature']}"
        tokens = rows[("seer", 0, "same", GAMMAS[0], 1)]["tokens"]
        print(f"\n{temp}: {res['groups']} groups x {res['group_size']} samples, {tokens} tokens "
              f"(max {res['max_tokens']} per sample)")
        header = f"{'drafts from':<27}{'paths':>6}"
        for g in GAMMAS:
            header += f"{f'g={g} same':>12}{f'g={g} all':>11}"
        print(header)
        for impl in sorted({key[0] for key in rows}, reverse=True):
            for k in sorted({key[1] for key in rows}):
                name = "self only" if k == 0 else f"+{k} sibling" + ("s" if k > 1 else "")
                if k and k == res["group_size"] - 1:
                    name += " (all)"
                if impl != "seer":
                    name = f"[{impl}] {name}"
                for paths in (1, MULTI_PATHS):
                    line = f"{name:<27}{paths if impl == 'seer' or paths == 1 else 'tree':>6}"
                    for g in GAMMAS:
                        same = rows[(impl, k, "same", g, paths)]["tokens_per_step"]
                        full = rows[(impl, k, "all", g, paths)]["tokens_per_step"] if k else same
                        line += f"{same:>12.2f}{full:>11.2f}"
                    print(line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    gen = sub.add_parser("generate", help="sample responses with real vLLM and save their token ids")
    gen.add_argument("--prompts", type=int, default=16)
    gen.add_argument("--first-prompt", type=int, default=0, help="skip this many prompts of the file (held-out sets)")
    gen.add_argument("--group-size", type=int, default=8)
    gen.add_argument("--max-tokens", type=int, default=512)
    gen.add_argument("--temperatures", default="1.0,0.6,0")
    gen.add_argument("--kv-gib", type=int, default=1)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--model", default=None, help="HF folder (default: the converted SmolLM2 in ~/.cache/seer)")
    gen.add_argument("--out", default="runs/draft-study/samples.json")
    rep = sub.add_parser("replay", help="replay speculative decoding offline along the saved samples")
    rep.add_argument("--samples", default="runs/draft-study/samples.json")
    rep.add_argument("--min-pattern", type=int, default=1)
    rep.add_argument("--max-pattern", type=int, default=8)
    rep.add_argument("--min-token-prob", type=float, default=0.1)
    rep.add_argument("--json", default=None, help="also write the numbers to this file")
    rep.add_argument("--arctic", action="store_true",
                     help="also replay with arctic-inference's SuffixTree (must be importable)")
    hist = sub.add_parser("history", help="replay with and without an earlier rollout's responses as drafts")
    hist.add_argument("--samples", default="runs/draft-study/samples.json")
    hist.add_argument("--history-from", default=None,
                      help="another generate run of the same prompts (the earlier epoch)")
    hist.add_argument("--min-pattern", type=int, default=1)
    hist.add_argument("--max-pattern", type=int, default=8)
    hist.add_argument("--min-token-prob", type=float, default=0.1)
    hist.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.cmd == "generate":
        generate(args)
    elif args.cmd == "history":
        replay_history(args)
    else:
        replay(args)


if __name__ == "__main__":
    main()
