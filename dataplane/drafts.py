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

import msgspec
import structlog

log = structlog.get_logger()

# Occurrences are packed into one int: end position in the high bits, sequence slot in
# the low ones (one small int per index entry instead of a tuple).
_SLOT_BITS = 16
_SLOT_MASK = (1 << _SLOT_BITS) - 1
_PROMPT = "\x00prompt"  # slot key of the group's prompt; request ids are never this


class Draft(msgspec.Struct, frozen=True):
    """Draft token paths for one request. ``paths[0]`` is the linear draft; ``probs[k][j]``
    is the estimated probability that ``paths[k][:j+1]`` is accepted."""

    paths: list[list[int]]
    probs: list[list[float]]
    match_tokens: int  # length of the matched pattern (0: no draft)

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
    """One group's sequences (prompt + each sample's tokens) and its n-gram index."""

    __slots__ = ("seqs", "slot_of", "index", "num_tokens")

    def __init__(self) -> None:
        self.seqs: list[list[int]] = []
        self.slot_of: dict[str, int] = {}
        self.index: dict[tuple[int, ...], list[int]] = {}
        self.num_tokens = 0

    def slot(self, key: str, limit: int) -> int:
        slot = self.slot_of.get(key)
        if slot is None:
            if len(self.seqs) >= limit:
                raise ValueError(f"group already holds {limit} sequences")
            slot = self.slot_of[key] = len(self.seqs)
            self.seqs.append([])
        return slot

    def extend(self, slot: int, tokens: Iterable[int], lo: int, hi: int) -> None:
        seq = self.seqs[slot]
        index = self.index
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


class DraftStore:
    """Per-group draft indexes for one weights version."""

    def __init__(self, config: DraftStoreConfig | None = None, weights_version: int = 0) -> None:
        self.config = config or DraftStoreConfig()
        self.weights_version = weights_version
        self._groups: dict[str, _GroupIndex] = {}

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
        return [] if slot is None else list(group.seqs[slot])  # type: ignore[union-attr]

    def set_prompt(self, group_id: str, prompt_token_ids: Sequence[int]) -> None:
        """Index the group's prompt (once; later calls are ignored — a group has one prompt)."""
        group = self._group(group_id)
        slot = group.slot(_PROMPT, self.config.max_sequences_per_group)
        if not group.seqs[slot]:
            group.extend(slot, prompt_token_ids, self.config.min_pattern_tokens, self.config.max_pattern_tokens)

    def append(self, group_id: str, request_id: str, new_tokens: Sequence[int], *, start_pos: int | None = None,
               weights_version: int | None = None) -> bool:
        """Add a request's next tokens (``update_cst``). ``start_pos`` is where
        ``new_tokens`` begin in the response: tokens already stored are skipped, so a
        re-sent chunk is harmless. Returns False (nothing stored) for a gap after the
        stored tokens or for tokens generated under another weights version."""
        if weights_version is not None and weights_version != self.weights_version:
            return False
        group = self._group(group_id)
        slot = group.slot(request_id, self.config.max_sequences_per_group)
        if start_pos is not None:
            if start_pos < 0:
                raise ValueError(f"start_pos must be >= 0, got {start_pos}")
            have = len(group.seqs[slot])
            if start_pos > have:
                return False
            new_tokens = new_tokens[have - start_pos:]
        group.extend(slot, new_tokens, self.config.min_pattern_tokens, self.config.max_pattern_tokens)
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

    def _group(self, group_id: str) -> _GroupIndex:
        group = self._groups.get(group_id)
        if group is None:
            group = self._groups[group_id] = _GroupIndex()
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
        context = list(context_tail) if context_tail is not None else self._own_context(group, request_id, hi)
        for n in range(min(hi, len(context)), lo - 1, -1):
            continuations = self._continuations(group, tuple(context[-n:]), max_spec_tokens)
            if continuations:
                paths, probs = _best_paths(continuations, top_k,
                                           cfg.min_token_prob if min_token_prob is None else min_token_prob)
                return Draft(paths=paths, probs=probs, match_tokens=n) if paths else _no_draft()
        return _no_draft()

    def _own_context(self, group: _GroupIndex, request_id: str, need: int) -> list[int]:
        slot = group.slot_of.get(request_id)
        own = group.seqs[slot][-need:] if slot is not None else []
        if len(own) < need and _PROMPT in group.slot_of:
            own = group.seqs[group.slot_of[_PROMPT]][-(need - len(own)):] + own
        return own

    def _continuations(self, group: _GroupIndex, key: tuple[int, ...], max_spec_tokens: int) -> list[list[int]]:
        hits = group.index.get(key)
        if not hits:
            return []
        out = []
        # Newest first: recent continuations win ties and survive the occurrence cap.
        for packed in reversed(hits[-self.config.max_occurrences:]):
            seq = group.seqs[packed & _SLOT_MASK]
            end = packed >> _SLOT_BITS
            if end < len(seq):
                out.append(seq[end:end + max_spec_tokens])
        return out


def _best_paths(continuations: list[list[int]], top_k: int, min_token_prob: float) -> tuple[list[list[int]], list[list[float]]]:
    """Greedy max-coverage of expected accepted tokens over the continuation trie."""
    # Trie as parallel lists; node 0 is the root. children keep insertion order
    # (newest continuation first), which is the tie-break.
    token = [-1]
    count = [0]
    children: list[dict[int, int]] = [{}]
    for cont in continuations:
        node = 0
        for tok in cont:
            child = children[node].get(tok)
            if child is None:
                child = children[node][tok] = len(token)
                token.append(tok)
                count.append(0)
                children.append({})
            count[child] += 1
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
            path.append(token[nxt])
            path_probs.append(prob[nxt])
            covered[nxt] = True
            node = nxt
        if not path:  # nothing uncovered is left to draft
            break
        paths.append(path)
        probs.append(path_probs)
    return paths, probs
