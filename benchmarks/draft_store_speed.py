"""Benchmark: cost of Seer's draft store (dataplane/drafts.py) per appended token and per
draft, for each index (``native``: compiled, ``python``: the reference), next to
arctic-inference's C++ ``SuffixTree`` when it is importable, on the real samples saved by
``benchmarks/draft_acceptance.py generate``.

For each group: append the prompt and every sample token by token in round-robin order
(as concurrent engines would), drafting for the appended request after every token.
Times are this process's CPU time (``time.process_time``), so other work on the shared
machine does not inflate them. The implementations run interleaved, ``--repeat`` rounds
(the median is reported). Every draft of every implementation but arctic is compared
with the ``python`` index's: the table says whether they were all identical.

    .venv/bin/python benchmarks/draft_store_speed.py --samples runs/draft-study/samples.json
    # with arctic-inference built as in docs/speculative-decoding.md, e.g. unpacked in /tmp/arctic/site:
    PYTHONPATH=/tmp/arctic/site .venv/bin/python benchmarks/draft_store_speed.py
    # an older checkout's store (no ``index`` setting: its one Python index), same samples:
    /path/to/old/.venv/bin/python benchmarks/draft_store_speed.py --impls python
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from pathlib import Path

import numpy as np
import structlog


def _interleaved(samples: list[list[int]]):
    """(sample index, position) in round-robin order."""
    for pos in range(max(len(s) for s in samples)):
        for idx, s in enumerate(samples):
            if pos < len(s):
                yield idx, pos


def bench_seer(groups: list[dict], gamma: int, top_k: int, max_pattern: int, index: str) -> dict:
    from seer.dataplane.drafts import DraftStore, DraftStoreConfig

    if "index" in DraftStoreConfig.__struct_fields__:
        store = DraftStore(DraftStoreConfig(max_pattern_tokens=max_pattern, index=index))
    else:  # a checkout from before the compiled index: its store is the Python one
        store = DraftStore(DraftStoreConfig(max_pattern_tokens=max_pattern))
    append_s = speculate_s = 0.0
    n_tokens = n_drafts = 0
    drafts = []
    for gi, group in enumerate(groups):
        gid = f"g{gi}"
        store.set_prompt(gid, group["prompt"])
        for idx, pos in _interleaved(group["samples"]):
            t0 = time.process_time()
            store.append(gid, f"r{idx}", group["samples"][idx][pos:pos + 1])
            t1 = time.process_time()
            draft = store.speculate(gid, f"r{idx}", gamma, top_k=top_k)
            t2 = time.process_time()
            append_s += t1 - t0
            speculate_s += t2 - t1
            n_tokens += 1
            n_drafts += 1
            drafts.append((draft.paths, draft.probs, draft.match_tokens))
        store.drop_group(gid)
    return {"append_us": 1e6 * append_s / n_tokens, "speculate_us": 1e6 * speculate_s / n_drafts,
            "drafts": drafts}


def bench_arctic(groups: list[dict], gamma: int, top_k: int, depth: int) -> dict:
    from arctic_inference.suffix_decoding._C import SuffixTree

    append_s = speculate_s = 0.0
    n = 0
    for group in groups:
        tree = SuffixTree(depth)
        tree.extend(0, group["prompt"])
        contexts = [list(group["prompt"]) for _ in group["samples"]]
        for idx, pos in _interleaved(group["samples"]):
            tok = group["samples"][idx][pos]
            contexts[idx].append(tok)
            ctx = np.asarray(contexts[idx][-depth:], dtype=np.int32)
            t0 = time.process_time()
            tree.extend(idx + 1, [tok])
            t1 = time.process_time()
            # vLLM's defaults: max_spec_factor 1.0, min_token_prob 0.1.
            tree.speculate_ndarray(ctx, gamma, 1.0, 0.0, 0.1, top_k > 1)
            t2 = time.process_time()
            append_s += t1 - t0
            speculate_s += t2 - t1
            n += 1
    return {"append_us": 1e6 * append_s / n, "speculate_us": 1e6 * speculate_s / n}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", default="runs/draft-study/samples.json")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--gamma", type=int, default=8)
    parser.add_argument("--impls", default="python,native", help="Seer indexes to time, in this order")
    parser.add_argument("--repeat", type=int, default=3, help="interleaved rounds; the median is reported")
    args = parser.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.INFO))
    data = json.loads(Path(args.samples).read_text())
    run = next(r for r in data["runs"] if r["temperature"] == args.temperature)
    groups = run["groups"][: args.groups]
    n_tokens = sum(len(s) for g in groups for s in g["samples"])
    print(f"{len(groups)} groups x {run['group_size']} samples, {n_tokens} tokens, temperature {args.temperature}, "
          f"gamma {args.gamma}; CPU microseconds per call (one draft after every appended token)")
    print(f"{'implementation':<40}{'append us/token':>16}{'draft us':>10}{'same drafts':>13}")
    impls = args.impls.split(",")
    for top_k in (1, 4):
        times: dict[str, list[tuple[float, float]]] = {i: [] for i in impls}
        reference = None
        same = {i: True for i in impls}
        for _ in range(args.repeat):
            for index in impls:
                r = bench_seer(groups, args.gamma, top_k, 8, index)
                times[index].append((r["append_us"], r["speculate_us"]))
                if index == "python" and reference is None:
                    reference = r["drafts"]
                same[index] = same[index] and (reference is None or r["drafts"] == reference)
        for index in impls:
            append_us = statistics.median(t[0] for t in times[index])
            draft_us = statistics.median(t[1] for t in times[index])
            check = "reference" if index == "python" else ("yes" if same[index] and reference else
                                                           ("-" if reference is None else "NO"))
            print(f"{f'seer {index}, top_k={top_k}':<40}{append_us:>16.2f}{draft_us:>10.2f}{check:>13}")
    try:
        import arctic_inference.suffix_decoding._C  # noqa: F401
    except ImportError:
        print("arctic-inference not importable: skipped")
        return
    for tree_spec in (False, True):
        r = bench_arctic(groups, args.gamma, 4 if tree_spec else 1, depth=24)
        name = f"arctic SuffixTree(24), tree_spec={tree_spec}"
        print(f"{name:<40}{r['append_us']:>16.1f}{r['speculate_us']:>10.1f}")


if __name__ == "__main__":
    main()
