"""The grouped draft store: per-group token indexes that propose speculative drafts.

Owns, for every active group (one GRPO prompt), the prompt and the tokens of every
sample of that group, fed incrementally as engines generate them, and answers
"what will request r of group g say next?" from all of them — Seer's grouped suffix
drafting. It owns no sockets, clocks, threads, vLLM or torch: the draft server and the
engine-side proposer (docs/notes/speculative-decoding.md §12) wrap it.

How a draft is made (all counts are over the group's sequences):

1. Pattern: the longest suffix of the request's context, between ``min_pattern_tokens``
   and ``max_pattern_tokens`` long, that occurs somewhere in the group *with at least
   one token after it*. The index maps every n-gram (n in that range) to the places it
   ends, so this is one dict lookup per length.
2. Continuations: the up-to-``max_spec_tokens`` tokens after each occurrence (the most
   recent ``max_occurrences`` only) form a small trie with counts. A node's estimated
   probability is its parent's times its share of the parent's continuing occurrences;
   nodes below ``min_token_prob`` are cut.
3. Paths: with one-hot drafts, the expected number of accepted tokens of a set of paths
   is the sum of the probabilities of the trie nodes they cover (a token is accepted iff
   its node lies on the true continuation). The linear draft is the path with the largest
   sum; each further path (``top_k`` > 1) is the one adding the most uncovered probability
   — a greedy maximisation of expected accepted tokens, so path 0 of a multi-path draft is
   always the linear draft. Ties go to the most recently appended continuation.

Invariants: a request's tokens are stored once, in order (``start_pos`` makes re-sent
chunks idempotent); trees never outlive a weight update — ``reset(weights_version)``
drops every group and appends tagged with another version are refused.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Literal

import msgspec
import structlog

log = structlog.get_logger()

# Occurrences are packed into one int: end position in the high bits, sequence slot in
# the low ones (one small int per index entry instead of a tuple).
_SLOT_BITS = 16
_SLOT_MASK = (1 << _SLOT_BITS) - 1
_PROMPT = "\x00prompt"  # slot key of the group's prompt; request ids are never this
_HISTORY = "\x00history/"  # slot keys of an earlier rollout's responses (+ a number)


class Draft(msgspec.Struct, frozen=True):
    """Draft token paths for one request. ``paths[0]`` is the linear draft; ``probs[k][j]``
    is the estimated probability that ``paths[k][:j+1]`` is accepted."""

    paths: list[list[int]]
    probs: list[list[float]]
    match_tokens: int  # length of the matched pattern (0: no draft)
    # Continuations that start with path 0's first token, and how many of them come from
    # an earlier rollout's responses (``DraftStore.add_history``).
    num_support: int = 0
    num_history_support: int = 0

    @property
    def linear(self) -> list[int]:
        return self.paths[0] if self.paths else []


def _no_draft() -> Draft:
    return Draft(paths=[], probs=[], match_tokens=0)  # fresh lists: callers may mutate them


class DraftStoreConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    min_pattern_tokens: int = 1
    max_pattern_tokens: int = 8
    max_occurrences: int = 256  # most recent occurrences read per draft (bounds its cost)
    min_token_prob: float = 0.1
    max_sequences_per_group: int = _SLOT_MASK
    # "native": the compiled index (seer.dataplane.draft_index, needs numba, same drafts);
    # "python": the reference index; "auto": native where numba imports.
    index: Literal["auto", "native", "python"] = "auto"

    def __post_init__(self) -> None:
        if not 1 <= self.min_pattern_tokens <= self.max_pattern_tokens:
            raise ValueError(f"need 1 <= min_pattern_tokens <= max_pattern_tokens, got "
                             f"{self.min_pattern_tokens} and {self.max_pattern_tokens}")
        if self.max_occurrences < 1:
            raise ValueError(f"max_occurrences must be >= 1, got {self.max_occurrences}")
        if not 0.0 <= self.min_token_prob <= 1.0:
            raise ValueError(f"min_token_prob must be in [0, 1], got {self.min_token_prob}")
        if not 1 <= self.max_sequences_per_group <= _SLOT_MASK:
            raise ValueError(f"max_sequences_per_group must be in [1, {_SLOT_MASK}]")


class _GroupIndex:
    """One group's sequences (prompt + each sample's tokens) and its n-gram index, in
    Python objects: the reference implementation (``index = "python"``). The compiled
    index (``seer.dataplane.draft_index.NativeGroupIndex``) has the same methods and
    returns the same drafts."""

    __slots__ = ("lo", "hi", "seqs", "slot_of", "history", "index", "num_tokens")

    def __init__(self, lo: int, hi: int) -> None:
        self.lo, self.hi = lo, hi
        self.seqs: list[list[int]] = []
        self.slot_of: dict[str, int] = {}
        self.history: list[bool] = []  # per slot: a response of an earlier rollout
        self.index: dict[tuple[int, ...], list[int]] = {}
        self.num_tokens = 0

    def slot(self, key: str, limit: int, history: bool = False) -> int:
        slot = self.slot_of.get(key)
        if slot is None:
            if len(self.seqs) >= limit:
                raise ValueError(f"group already holds {limit} sequences")
            slot = self.slot_of[key] = len(self.seqs)
            self.seqs.append([])
            self.history.append(history)
        return slot

    def length(self, slot: int) -> int:
        return len(self.seqs[slot])

    def tail(self, slot: int, count: int) -> list[int]:
        return self.seqs[slot][-count:] if count > 0 else []

    def sequence(self, slot: int) -> list[int]:
        return list(self.seqs[slot])

    def extend(self, slot: int, tokens: Iterable[int]) -> None:
        seq = self.seqs[slot]
        index = self.index
        lo, hi = self.lo, self.hi
        for token in tokens:
            seq.append(int(token))
            end = len(seq)
            packed = (end << _SLOT_BITS) | slot
            for n in range(lo, min(hi, end) + 1):
                key = tuple(seq[end - n:end])
                hits = index.get(key)
                if hits is None:
                    index[key] = [packed]
                else:
                    hits.append(packed)
            self.num_tokens += 1

    def draft(self, context: Sequence[int] | None, lo: int, max_spec: int, top_k: int, min_prob: float,
              max_occ: int, hi: int, own: str | None = None) -> tuple[list[list[int]], list[list[float]], int,
                                                                         tuple[int, int]]:
        """(paths, probs, matched length, (history continuations, all continuations)
        through path 0's first token); no draft: ([], [], 0, (0, 0)). The context is
        ``context`` (its last ``hi`` tokens) or, when it is None, ``own_context(own, hi)``."""
        if context is None:
            context = self.own_context(own, hi)
        elif len(context) > hi:
            context = context[-hi:]
        if not isinstance(context, list):
            context = [int(t) for t in context]
        for n in range(min(hi, len(context)), lo - 1, -1):
            continuations, history = self._continuations(tuple(context[-n:]), max_spec, max_occ)
            if continuations:
                paths, probs, support = _best_paths(continuations, history, top_k, min_prob)
                return (paths, probs, n, support) if paths else ([], [], 0, (0, 0))
        return [], [], 0, (0, 0)

    def own_context(self, own: str | None, need: int) -> list[int]:
        """The last ``need`` tokens of sequence ``own``, after the prompt's end if fewer."""
        slot = self.slot_of.get(own) if own is not None else None
        tokens = self.tail(slot, need) if slot is not None else []
        prompt = self.slot_of.get(_PROMPT)
        if len(tokens) < need and prompt is not None:
            tokens = self.tail(prompt, need - len(tokens)) + tokens
        return tokens

    def _continuations(self, key: tuple[int, ...], max_spec: int, max_occ: int) -> tuple[list[list[int]], list[bool]]:
        hits = self.index.get(key)
        if not hits:
            return [], []
        out, history = [], []
        # Newest first: recent continuations win ties and survive the occurrence cap.
        for packed in reversed(hits[-max_occ:]):
            slot = packed & _SLOT_MASK
            seq = self.seqs[slot]
            end = packed >> _SLOT_BITS
            if end < len(seq):
                out.append(seq[end:end + max_spec])
                history.append(self.history[slot])
        return out, history


def _new_index(kind: str, lo: int, hi: int, scratch: object) -> _GroupIndex:
    if kind == "python":
        return _GroupIndex(lo, hi)
    from seer.dataplane.draft_index import NativeGroupIndex

    return NativeGroupIndex(lo, hi, scratch)  # type: ignore[arg-type, return-value]


def native_index_available() -> bool:
    """Can this environment compile the draft index (numba importable)?"""
    try:
        import seer.dataplane.draft_index  # noqa: F401
    except ImportError:
        return False
    return True


class DraftStore:
    """Per-group draft indexes for one weights version."""

    def __init__(self, config: DraftStoreConfig | None = None, weights_version: int = 0) -> None:
        self.config = config or DraftStoreConfig()
        self.weights_version = weights_version
        self._groups: dict[str, _GroupIndex] = {}
        kind = self.config.index
        if kind == "auto":
            kind = "native" if native_index_available() else "python"
        elif kind == "native" and not native_index_available():
            raise ValueError("DraftStoreConfig.index = 'native' needs numba (pip install -e '.[engine]'); "
                             "use 'auto' or 'python'")
        self.index_kind = kind
        self._scratch: object = None
        if kind == "native":
            from seer.dataplane.draft_index import DraftScratch

            self._scratch = DraftScratch(self.config.max_pattern_tokens)

    # ---- membership -------------------------------------------------------------

    def group_ids(self) -> list[str]:
        return list(self._groups)

    def num_tokens(self, group_id: str) -> int:
        group = self._groups.get(group_id)
        return 0 if group is None else group.num_tokens

    def tokens(self, group_id: str, request_id: str) -> list[int]:
        """The stored response tokens of one request (a copy)."""
        group = self._groups.get(group_id)
        slot = None if group is None else group.slot_of.get(request_id)
        return [] if slot is None else group.sequence(slot)  # type: ignore[union-attr]

    def set_prompt(self, group_id: str, prompt_token_ids: Sequence[int]) -> None:
        """Index the group's prompt (once; later calls are ignored — a group has one prompt)."""
        group = self._group(group_id)
        slot = group.slot(_PROMPT, self.config.max_sequences_per_group)
        if not group.length(slot):
            group.extend(slot, prompt_token_ids)

    def add_history(self, group_id: str, responses: Sequence[Sequence[int]]) -> int:
        """Seed a group with responses of an earlier rollout of its prompt (drafts from
        history, ``seer.dataplane.draft_history``). They are indexed like complete
        siblings but marked, so a draft says how much of it came from them
        (``Draft.num_history_support``). Only once per group; returns the sequences added."""
        group = self._group(group_id)
        if any(key.startswith(_HISTORY) for key in group.slot_of):
            return 0
        added = 0
        for i, tokens in enumerate(responses):
            if len(group.slot_of) >= self.config.max_sequences_per_group:
                break
            if len(tokens):
                group.extend(group.slot(f"{_HISTORY}{i}", self.config.max_sequences_per_group, history=True), tokens)
                added += 1
        return added

    def append(self, group_id: str, request_id: str, new_tokens: Sequence[int], *, start_pos: int | None = None,
               weights_version: int | None = None) -> bool:
        """Add a request's next tokens (``update_cst``). ``start_pos`` is where
        ``new_tokens`` begin in the response: tokens already stored are skipped, so a
        re-sent chunk is harmless. Returns False (nothing stored) for a gap after the
        stored tokens or for tokens generated under another weights version."""
        if weights_version is not None and weights_version != self.weights_version:
            return False
        group = self._groups.get(group_id) or self._group(group_id)
        slot = group.slot_of.get(request_id)
        if slot is None:
            slot = group.slot(request_id, self.config.max_sequences_per_group)
        if start_pos is not None:
            if start_pos < 0:
                raise ValueError(f"start_pos must be >= 0, got {start_pos}")
            have = group.length(slot)
            if start_pos > have:
                return False
            new_tokens = new_tokens[have - start_pos:]
        group.extend(slot, new_tokens)
        return True

    def drop_group(self, group_id: str) -> None:
        group = self._groups.pop(group_id, None)
        if group is not None:
            log.debug("draft_group_dropped", group_id=group_id, num_tokens=group.num_tokens)

    def reset(self, weights_version: int) -> None:
        """New weights: forget every group; only appends for this version are taken."""
        num_groups = len(self._groups)
        self._groups.clear()
        self.weights_version = weights_version
        log.info("draft_store_reset", weights_version=weights_version, num_groups_dropped=num_groups)

    def sequences(self, group_id: str) -> dict[str, list[int]]:
        """Every response stored for a group (request id -> tokens), history and prompt
        left out: what a later rollout of the same prompt can draft from."""
        group = self._groups.get(group_id)
        if group is None:
            return {}
        return {key: group.sequence(slot) for key, slot in group.slot_of.items()
                if key != _PROMPT and not key.startswith(_HISTORY)}

    def _group(self, group_id: str) -> _GroupIndex:
        group = self._groups.get(group_id)
        if group is None:
            cfg = self.config
            group = self._groups[group_id] = _new_index(self.index_kind, cfg.min_pattern_tokens,
                                                        cfg.max_pattern_tokens, self._scratch)
        return group

    # ---- drafting ---------------------------------------------------------------

    def speculate(self, group_id: str, request_id: str, max_spec_tokens: int, *,
                  context_tail: Sequence[int] | None = None, top_k: int = 1,
                  min_pattern_tokens: int | None = None, max_pattern_tokens: int | None = None,
                  min_token_prob: float | None = None) -> Draft:
        """Draft up to ``max_spec_tokens`` tokens (``top_k`` paths) for a request.

        ``context_tail`` is the end of the request's context (prompt + response so far);
        by default it is the request's stored tokens, preceded by the prompt when they
        are shorter than the longest pattern. Pattern bounds can only narrow the
        configured ones (the index holds nothing outside them)."""
        cfg = self.config
        group = self._groups.get(group_id)
        if group is None or max_spec_tokens < 1 or top_k < 1:
            return _no_draft()
        lo = max(cfg.min_pattern_tokens, min_pattern_tokens or 0)
        hi = min(cfg.max_pattern_tokens, max_pattern_tokens or cfg.max_pattern_tokens)
        paths, probs, n, (history, support) = group.draft(
            context_tail, lo, max_spec_tokens, top_k, cfg.min_token_prob if min_token_prob is None else min_token_prob,
            cfg.max_occurrences, hi, request_id)
        if not paths:
            return _no_draft()
        return Draft(paths=paths, probs=probs, match_tokens=n, num_support=support, num_history_support=history)


def _best_paths(continuations: list[list[int]], history: list[bool], top_k: int,
                min_token_prob: float) -> tuple[list[list[int]], list[list[float]], tuple[int, int]]:
    """Greedy max-coverage of expected accepted tokens over the continuation trie; also
    (history continuations, all continuations) through path 0's first token."""
    # Trie as parallel lists; node 0 is the root. children keep insertion order
    # (newest continuation first), which is the tie-break.
    token = [-1]
    count = [0]
    from_history = [0]
    children: list[dict[int, int]] = [{}]
    for cont, hist in zip(continuations, history, strict=True):
        node = 0
        for tok in cont:
            child = children[node].get(tok)
            if child is None:
                child = children[node][tok] = len(token)
                token.append(tok)
                count.append(0)
                from_history.append(0)
                children.append({})
            count[child] += 1
            from_history[child] += hist
            node = child
    prob = [1.0] * len(token)
    order = [0]  # parents before children
    for node in order:
        total = sum(count[c] for c in children[node].values())
        for c in children[node].values():
            prob[c] = prob[node] * count[c] / total
            if prob[c] >= min_token_prob:
                order.append(c)
            else:
                prob[c] = 0.0  # cut: never drafted
    covered = [False] * len(token)
    paths: list[list[int]] = []
    probs: list[list[float]] = []
    support = (0, 0)
    for _ in range(top_k):
        best = [0.0] * len(token)
        for node in reversed(order[1:]):
            gain = 0.0 if covered[node] else prob[node]
            below = max((best[c] for c in children[node].values() if prob[c] > 0.0), default=0.0)
            best[node] = gain + below
        path, path_probs, node = [], [], 0
        while True:
            nxt, nxt_best = -1, 0.0
            for c in children[node].values():
                if prob[c] > 0.0 and best[c] > nxt_best:
                    nxt, nxt_best = c, best[c]
            if nxt < 0:
                break
            if not paths and not path:
                support = (from_history[nxt], count[nxt])
            path.append(token[nxt])
            path_probs.append(prob[nxt])
            covered[nxt] = True
            node = nxt
        if not path:  # nothing uncovered is left to draft
            break
        paths.append(path)
        probs.append(path_probs)
    return paths, probs, support
