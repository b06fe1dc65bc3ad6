"""Agentic (multi-turn) traces for replay on the real engines, and what a replay needs.

Generates a trace of tool-using trajectories, one list per group, one list of turns per
sample, each turn ``{"decode": n, "tool_s": t, "tool_tokens": k}``: the model decodes
``n`` tokens, then its tool answers after ``t`` seconds with ``k`` tokens of output
(the last turn of a sample has ``tool_s`` 0 and ``tool_tokens`` 0: the trajectory ends
there). ``benchmarks/rollout_policies.py --replay FILE`` replays it on a real daemon.

    .venv/bin/python benchmarks/agentic_traces.py --shape swe --groups 6 --group-size 2 \
        --seed 0 --max-context 4096 --out /tmp/swe.json

Two shapes, from public figures, scaled to this machine (contexts of at most
``--max-context`` tokens, prompt included, where the real agents run 32k-128k):

* ``swe``: software-engineering agents (SWE-bench-style tasks: edit, run tests, read the
  output): many turns, ~11 on average and heavy-tailed; 30-200 tokens decoded per turn;
  tool outputs of 100-800 tokens, heavy-tailed (file views, test logs); sandbox latency
  lognormal, median ~1 s, a few calls up to ~10 s (real sandboxes: seconds to minutes,
  scaled down so a run takes minutes).
* ``search``: search agents (Search-R1-style question answering): 2-8 turns, short tool
  outputs of 30-150 tokens (retrieved snippets), tool latency 0.3-2 s.

Siblings of a group share their prompt but not their turns: each sample's number of
turns and its per-turn lengths draw a group-level factor (an intra-group correlation of
~0.5 on the log scale, as real groups have) plus their own noise. A trajectory whose
turns would not fit ``--max-context`` (``--prompt-tokens`` + every decode + every tool
output + ``--template-tokens`` of chat template per tool answer, with a small margin) ends
at its last turn that fits, as an agent that reaches its context limit does. Deterministic
given ``--seed``.

For the replay (``rollout_policies.py``): ``load_agentic_trace`` checks a file,
``ToolTexts`` makes each tool answer real text of exactly its token count under the
model's tokenizer (slices of the repo's docs), ``replay_env`` is the environment, and
``run_metrics`` / ``print_agentic_table`` report each run.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import math
import random
import statistics
import sys
from pathlib import Path

SHAPES = ("swe", "search")
ICC = 0.5  # share of a sample's log-scale variance that its group shares
MARGIN_TOKENS = 16  # left free below --max-context: a tool text may re-tokenize a token longer in the template


def _corr(rng: random.Random, group_z: float) -> float:
    """A standard normal draw sharing ``ICC`` of its variance with the group's ``group_z``."""
    return math.sqrt(ICC) * group_z + math.sqrt(1 - ICC) * rng.gauss(0.0, 1.0)


def _lognormal(median: float, sigma: float, z: float) -> float:
    return median * math.exp(sigma * z)


def _clip(x: float, lo: float, hi: float) -> float:
    return min(hi, max(lo, x))


def _sample(shape: str, rng: random.Random, groups_z: tuple[float, float]) -> list[dict]:
    """One sample's turns (before the context budget trims them)."""
    gz_turns, gz_len = groups_z
    z_turns, z_len = _corr(rng, gz_turns), _corr(rng, gz_len)
    turns: list[dict] = []
    if shape == "swe":
        n = round(_clip(_lognormal(11.5, 0.5, z_turns), 2, 40))
        for _ in range(n):
            decode = round(_clip(30 + _lognormal(40.0, 0.6, 0.5 * z_len + rng.gauss(0, 0.8)), 30, 200))
            tool = round(_clip(100 + _lognormal(50.0, 1.0, rng.gauss(0, 1)), 100, 800))
            tool_s = _clip(_lognormal(1.0, 0.8, rng.gauss(0, 1)), 0.1, 10.0)
            turns.append({"decode": decode, "tool_s": round(tool_s, 3), "tool_tokens": tool})
    else:
        n = round(_clip(_lognormal(3.8, 0.4, z_turns), 2, 8))
        for _ in range(n):
            decode = round(_clip(30 + _lognormal(50.0, 0.5, 0.5 * z_len + rng.gauss(0, 0.8)), 30, 200))
            tool = round(_clip(_lognormal(70.0, 0.45, rng.gauss(0, 1)), 30, 150))
            tool_s = _clip(_lognormal(0.8, 0.5, rng.gauss(0, 1)), 0.3, 2.0)
            turns.append({"decode": decode, "tool_s": round(tool_s, 3), "tool_tokens": tool})
    return turns


def fit_context(turns: list[dict], max_context: int, prompt_tokens: int, template_tokens: int) -> list[dict]:
    """The turns that fit ``max_context`` (the last one's tool answer dropped: it ends there)."""
    budget = max_context - prompt_tokens - MARGIN_TOKENS
    kept: list[dict] = []
    used = 0
    for turn in turns:
        if used + turn["decode"] > budget:
            break
        kept.append(dict(turn))
        used += turn["decode"] + turn["tool_tokens"] + template_tokens
    if not kept:  # not even one turn: the first, shortened to the budget
        kept = [{"decode": max(1, min(turns[0]["decode"], budget)), "tool_s": 0.0, "tool_tokens": 0}]
    kept[-1]["tool_s"], kept[-1]["tool_tokens"] = 0.0, 0
    return kept


def context_tokens(turns: list[dict], prompt_tokens: int, template_tokens: int) -> int:
    """A trajectory's whole context: prompt, every decode, every tool answer and its template."""
    return prompt_tokens + sum(t["decode"] + (t["tool_tokens"] + template_tokens if t["tool_tokens"] else 0)
                               for t in turns)


def generate(shape: str, groups: int, group_size: int, seed: int, max_context: int = 4096,
             prompt_tokens: int = 100, template_tokens: int = 11) -> dict:
    """A trace: ``{"trajectories": [group][sample][turn], "source": ..., ...}``."""
    if shape not in SHAPES:
        raise ValueError(f"shape {shape!r}: one of {', '.join(SHAPES)}")
    if groups < 1 or group_size < 1:
        raise ValueError("groups and group size must be >= 1")
    if max_context - prompt_tokens - MARGIN_TOKENS < 30:
        raise ValueError(f"max_context {max_context} leaves no room for a turn after a {prompt_tokens}-token prompt")
    rng = random.Random(f"{shape}/{seed}")
    trajectories = []
    for _ in range(groups):
        groups_z = (rng.gauss(0.0, 1.0), rng.gauss(0.0, 1.0))
        trajectories.append([fit_context(_sample(shape, rng, groups_z), max_context, prompt_tokens, template_tokens)
                             for _ in range(group_size)])
    return {"trajectories": trajectories,
            "source": (f"benchmarks/agentic_traces.py --shape {shape} --groups {groups} --group-size {group_size} "
                       f"--seed {seed} --max-context {max_context}"),
            "shape": shape, "seed": seed, "max_context": max_context, "prompt_tokens": prompt_tokens,
            "template_tokens": template_tokens}


def summary(trace: dict) -> str:
    """Turns, tokens and tool seconds of a trace, a few lines."""
    samples = [s for g in trace["trajectories"] for s in g]
    turns = [len(s) for s in samples]
    decode = [t["decode"] for s in samples for t in s]
    tools = [t for s in samples for t in s[:-1]]
    tool_tokens = [t["tool_tokens"] for t in tools]
    tool_s = [t["tool_s"] for t in tools]
    prompt, template = trace.get("prompt_tokens", 100), trace.get("template_tokens", 11)
    contexts = [context_tokens(s, prompt, template) for s in samples]

    def dist(xs: list[float], fmt: str = "{:.0f}") -> str:
        if not xs:
            return "-"
        q = statistics.quantiles(xs, n=10) if len(xs) > 1 else [xs[0]] * 9
        return (f"mean {fmt.format(statistics.fmean(xs))}, median {fmt.format(statistics.median(xs))}, "
                f"p90 {fmt.format(q[8])}, max {fmt.format(max(xs))}")

    return "\n".join([
        f"{trace['source']}",
        f"{len(trace['trajectories'])} groups x {len(trace['trajectories'][0])} = {len(samples)} trajectories, "
        f"{sum(turns)} turns, {sum(decode)} decoded tokens, {sum(tool_tokens)} tool tokens, "
        f"{sum(tool_s):.1f} tool seconds",
        f"turns per trajectory: {dist(turns, '{:.1f}')}, min {min(turns)}",
        f"decode per turn: {dist(decode)}, min {min(decode)}",
        f"tool output tokens: {dist(tool_tokens)}" + (f", min {min(tool_tokens)}" if tool_tokens else ""),
        f"tool seconds: {dist(tool_s, '{:.2f}')}" + (f", min {min(tool_s):.2f}" if tool_s else ""),
        f"context per trajectory (prompt ~{prompt} + decode + tool + {template} template tokens per answer): "
        f"{dist(contexts)}; all together {sum(contexts)} tokens",
    ])


def load_agentic_trace(path: Path) -> dict:
    """A trace file's ``trajectories``, checked. ValueError (one line) for anything else."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"--replay {path}: not a readable JSON file ({exc})") from None
    groups = data.get("trajectories") if isinstance(data, dict) else None
    if not isinstance(groups, list) or not groups or not all(isinstance(g, list) and g for g in groups):
        raise ValueError(f"--replay {path}: \"trajectories\" must be a non-empty list of groups, each a non-empty "
                         "list of samples")
    if len({len(g) for g in groups}) != 1:
        raise ValueError(f"--replay {path}: every group needs the same number of samples (the group size); found "
                         f"{sorted({len(g) for g in groups})}")
    for i, group in enumerate(groups):
        for j, turns in enumerate(group):
            if not isinstance(turns, list) or not turns:
                raise ValueError(f"--replay {path}: trajectories[{i}][{j}] must be a non-empty list of turns")
            for k, t in enumerate(turns):
                ok = (isinstance(t, dict) and isinstance(t.get("decode"), int) and t["decode"] >= 1
                      and isinstance(t.get("tool_tokens"), int) and t["tool_tokens"] >= 0
                      and isinstance(t.get("tool_s"), (int, float)) and 0 <= t["tool_s"] <= 600)
                if not ok:
                    raise ValueError(f"--replay {path}: trajectories[{i}][{j}][{k}] is {t!r}, not "
                                     "{\"decode\": int >= 1, \"tool_s\": 0..600, \"tool_tokens\": int >= 0}")
                if k < len(turns) - 1 and t["tool_tokens"] < 1:
                    raise ValueError(f"--replay {path}: trajectories[{i}][{j}][{k}] is not the last turn and has no "
                                     "tool output (tool_tokens 0)")
    return {"trajectories": groups, "source": data.get("source", str(path)), "file": str(path),
            "prompt_tokens": data.get("prompt_tokens", 100), "template_tokens": data.get("template_tokens", 11)}


def replay_turns(trace: dict) -> list[list[list[int]]]:
    return [[[t["decode"] for t in s] for s in g] for g in trace["trajectories"]]


class ToolTexts:
    """Every tool answer of a trace as real text of exactly ``tool_tokens`` tokens under the
    model's tokenizer: slices of a fixed text (the repo's docs/*.md, concatenated in name
    order), tokenized once; each (group, sample, turn) takes its slice at an offset drawn
    from its own indices, so the answers are the same in every run of one invocation. The
    docs change between commits, and with them the texts (not their token counts):
    ``digest`` names the text used; runs of different invocations generate the same tokens
    only where it is the same."""

    def __init__(self, model_dir: Path, corpus: str | None = None) -> None:
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(str(model_dir))
        if corpus is None:
            docs = Path(__file__).resolve().parents[1] / "docs"
            corpus = "\n\n".join(p.read_text() for p in sorted(docs.glob("*.md")))
        corpus = corpus.replace("<|", "< |")  # no chat-template marker in a tool's output
        self.digest = hashlib.blake2b(corpus.encode(), digest_size=6).hexdigest()
        special = set(self.tok.all_special_ids)
        self.ids = [i for i in self.tok.encode(corpus, add_special_tokens=False) if i not in special]

    def count(self, text: str) -> int:
        return len(self.tok.encode(text, add_special_tokens=False))

    def text(self, group: int, sample: int, turn: int, n: int) -> str:
        if n < 1:
            return ""
        if n > len(self.ids) // 2:
            raise ValueError(f"a tool output of {n} tokens is longer than half the text it is cut from")
        rng = random.Random(f"tool/{group}/{sample}/{turn}")
        start = rng.randrange(0, len(self.ids) - 2 * n)
        length = n
        text = self.tok.decode(self.ids[start:start + length])
        for _ in range(8):  # a slice may re-tokenize a token longer or shorter at its edges
            got = self.count(text)
            if got == n:
                break
            length = max(1, length + n - got)
            text = self.tok.decode(self.ids[start:start + length])
        return text

    def for_trace(self, trace: dict) -> dict[tuple[int, int, int], str]:
        return {(g, s, k): self.text(g, s, k, t["tool_tokens"])
                for g, group in enumerate(trace["trajectories"]) for s, turns in enumerate(group)
                for k, t in enumerate(turns) if t["tool_tokens"] > 0}


def replay_env(trace: dict, texts: dict[tuple[int, int, int], str]):  # noqa: ANN201 - an async Environment
    """The environment of a replay: after turn k it sleeps the trace's ``tool_s`` and answers
    with the turn's text; after a sample's last turn it says done."""
    from seer.agentic import EnvReply, Turn, tool_message

    async def env(turn: Turn) -> EnvReply:
        turns = trace["trajectories"][turn.group_index][turn.sample_index]
        if turn.turn >= len(turns) - 1:
            return EnvReply(done=True)
        spec = turns[turn.turn]
        await asyncio.sleep(spec["tool_s"])
        return EnvReply(messages=[tool_message(texts[(turn.group_index, turn.sample_index, turn.turn)])],
                        tool_name="replay")

    return env


REPREFILL_DEFINITION = ("re-prefilled: over every turn after a trajectory's first, max(0, prefilled_tokens - "
                        "(previous turn's appended_tokens + 1)): context tokens computed again although an engine "
                        "had computed them before (the +1 is the previous turn's last sampled token, whose KV no "
                        "step computed; a partly filled prefix-cache block counts as re-prefilled)")


def replay_setup(parser: argparse.ArgumentParser, args: argparse.Namespace, config, replay: dict,  # noqa: ANN001
                 prompts: list, policies: list[str], oracles: tuple[str, ...]) -> dict:
    """The fixed parts of ``rollout_policies.py --replay`` with a trajectory trace (exits
    through ``parser.error`` on what cannot run): the turns to replay, the trajectory spec,
    every tool answer's text and the environment. Sets ``args.group_size`` and ``args.max_tokens`` from the trace."""
    from seer.config import default_cache_dir
    from seer.engines.model_store import model_dir
    from seer.protocol import TrajectorySpec

    groups = replay["trajectories"]
    if len(groups) > len(prompts):
        parser.error(f"--replay has {len(groups)} groups and --prompts {args.prompts} gives {len(prompts)} prompts "
                     f"(--limit {args.limit}); use a prompt file with at least {len(groups)} prompts or a smaller trace")
    if any(p in oracles for p in policies):
        parser.error("an agentic replay runs no oracle (a trajectory has no single true length); drop "
                     + ", ".join(p for p in policies if p in oracles))
    if args.max_context > config.model.max_model_len:
        parser.error(f"--max-context {args.max_context} exceeds model.max_model_len {config.model.max_model_len}: "
                     "raise it in --config (benchmarks/agentic.toml has 4096) or lower --max-context")
    turns = replay_turns(replay)
    args.group_size, args.max_tokens = len(groups[0]), max(n for g in turns for s in g for n in s)
    tokenizer_dir = Path(config.model.path) if config.model.path else model_dir(default_cache_dir())
    tool_texts = ToolTexts(tokenizer_dir)
    texts = tool_texts.for_trace(replay)
    replay["tool_text_digest"] = tool_texts.digest  # kept in --out: which text the tool answers were cut from
    spec = TrajectorySpec(max_turns=max(len(s) for g in turns for s in g), max_total_tokens=args.max_context,
                          tool_timeout_s=120.0)
    return {"trace": replay, "turns": turns, "spec": spec, "env": replay_env(replay, texts)}


def run_metrics(result, trace: dict) -> dict:  # noqa: ANN001 - a RolloutResult
    """What a run of an agentic replay computed, and a digest of what it generated."""
    h = hashlib.blake2b(digest_size=8)
    sampled = reprefilled = prefilled = reused = switches = off_trace = tool_s = turns = daemon = 0
    finish: dict[str, int] = {}
    per_sample = []
    for g in sorted(result.groups, key=lambda g: g.group_index):
        for s in sorted(g.samples, key=lambda s: s.sample_index):
            key = repr((g.group_index, s.sample_index, s.token_ids, s.loss_mask)).encode()
            h.update(key)
            per_sample.append(hashlib.blake2b(key, digest_size=6).hexdigest())
            sampled += sum(s.loss_mask)
            finish[s.finish_reason] = finish.get(s.finish_reason, 0) + 1
            want = [t["decode"] for t in trace["trajectories"][g.group_index][s.sample_index]]
            off_trace += [t.end - t.start for t in s.turns] != want
            turns += len(s.turns)
            for k, t in enumerate(s.turns):
                prefilled += t.prefilled_tokens
                daemon += getattr(t, "recomputed_tokens", 0)
                reused += t.reused_tokens
                tool_s += t.tool_s
                switches += max(0, len(t.engine_ids) - 1)
                if k:
                    prev = s.turns[k - 1]
                    reprefilled += max(0, t.prefilled_tokens - (prev.appended_tokens + 1))
                    if prev.engine_ids and t.engine_ids and prev.engine_ids[-1] != t.engine_ids[0]:
                        switches += 1
    return {"sampled_tokens": sampled, "reprefilled_tokens": reprefilled, "daemon_recomputed_tokens": daemon,
            "prefilled_tokens": prefilled,
            "reused_tokens": reused, "engine_switches": switches, "turns": turns, "off_trace": off_trace,
            "tool_s": tool_s, "finish_reasons": finish, "digest": h.hexdigest(), "sample_digests": per_sample}


def spread(values: list[float], fmt: str = "{:.1f}") -> str:
    """Median (min-max) of ``values``, or the one value (``rollout_policies.py``'s tables use it too)."""
    if len(values) == 1:
        return fmt.format(values[0])
    return f"{fmt.format(statistics.median(values))} ({fmt.format(min(values))}–{fmt.format(max(values))})"


def paired_ratios(runs: list[dict], policy: str, baseline: str, key: str) -> list[float]:
    """``policy``'s ``key`` over ``baseline``'s, repetition by repetition."""
    by = {(r["policy"], r["rep"]): r[key] for r in runs}
    return [by[(policy, k)] / by[(baseline, k)] for k in sorted({r["rep"] for r in runs})
            if (policy, k) in by and (baseline, k) in by and by[(baseline, k)] > 0]


AGENTIC_BASELINES = ("sticky", "request")


def identical(runs: list[dict]) -> str:
    """Whether every run generated token-identical trajectories (token ids and loss mask per
    sample): "yes", or which samples differ and in which runs."""
    if len({r["digest"] for r in runs}) <= 1:
        return "yes"
    first = runs[0]["sample_digests"]
    bad = sorted({i for r in runs for i, d in enumerate(r["sample_digests"]) if d != first[i]})
    who = sorted({f"{r['policy']}#{r['rep']}" for r in runs if r["digest"] != runs[0]["digest"]})
    return f"NO: samples {bad[:10]} differ from {runs[0]['policy']}#{runs[0]['rep']} in {', '.join(who)}"


def print_agentic_table(runs: list[dict], policies: list[str]) -> None:
    baselines = [b for b in AGENTIC_BASELINES if b in policies]
    head = ["policy", "wall s", "sampled tok/s", *[f"x {b}" for b in baselines], "re-prefilled",
            "recomputed (daemon)", "prefilled", "reused", "preemptions", "engine switches", "samples"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    digests = {r["digest"] for r in runs}
    for policy in policies:
        mine = [r for r in runs if r["policy"] == policy]
        cells = [policy, spread([r["client_wall_s"] for r in mine]),
                 spread([r["sampled_tok_per_wall_s"] for r in mine])]
        for b in baselines:
            ratios = paired_ratios(runs, policy, b, "sampled_tok_per_wall_s")
            cells.append(spread(ratios, "{:.2f}") if ratios else "-")
        for key in ("reprefilled_tokens", "daemon_recomputed_tokens", "prefilled_tokens", "reused_tokens"):
            values = [r[key] for r in mine if key in r]
            cells.append(spread(values, "{:.0f}") if values else "-")
        cells += [str(sum(r["num_preemptions"] for r in mine)), spread([r["engine_switches"] for r in mine], "{:.0f}"),
                  "same" if len(digests) == 1 else ",".join(sorted({r["digest"][:6] for r in mine}))]
        print("| " + " | ".join(cells) + " |")
    print(f"\n{REPREFILL_DEFINITION}. recomputed (daemon): the daemon's own count, TurnRecord.recomputed_tokens "
          "summed (per chunk: a turn cut into chunks also counts each later chunk's prefill beyond its first token).")
    print("sampled tok/s: sum of every sample's loss_mask over the run's wall time (tool waits included); "
          "x sticky / x request: paired by repetition, median (min-max); engine switches: a turn that starts on "
          "another engine than the one its previous turn ended on, plus moves within a turn")
    print(f"token-identical trajectories (token_ids and loss_mask of every sample) across every run: {identical(runs)}")
    off = sum(r["off_trace"] for r in runs)
    if off:
        print(f"WARNING: {off} trajectories (over all runs) did not run the trace's turns; finish reasons: "
              f"{[r['finish_reasons'] for r in runs]}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=SHAPES, required=True)
    parser.add_argument("--groups", type=int, default=6)
    parser.add_argument("--group-size", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-context", type=int, default=4096,
                        help="tokens per trajectory, prompt included (the replay's TrajectorySpec.max_total_tokens)")
    parser.add_argument("--prompt-tokens", type=int, default=100, help="the prompt's tokens, as the budget counts them")
    parser.add_argument("--template-tokens", type=int, default=11,
                        help="chat-template tokens around each tool answer (SmolLM2's: 11)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    try:
        trace = generate(args.shape, args.groups, args.group_size, args.seed, args.max_context, args.prompt_tokens,
                         args.template_tokens)
    except ValueError as exc:
        parser.error(str(exc))
    print(summary(trace))
    if args.out:
        args.out.write_text(json.dumps(trace))
        print(f"trace: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
