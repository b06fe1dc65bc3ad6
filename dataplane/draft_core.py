"""The draft server's state and decisions, without processes, rings or clocks.

Owns, for every group some engine of this host works on, the response tokens of each of
its samples, which engines (connections) have the group registered, and the rules of
what to send whom. ``DraftServerCore.handle`` takes one decoded up-ring message and
returns the down-ring messages it causes; time comes in as ``now``. The process shell
(``dataplane/draft_server.py``) moves the bytes.

Rules:

- A sample's tokens are one contiguous log. An append that starts past its end (a later
  chunk of a migrated request whose earlier chunk is still in another engine's up-ring)
  is held in a ``GapBuffer`` and merged when the gap closes; re-sent tokens are skipped.
- Tokens that newly become contiguous go to every *other* engine registered for the
  group; the sender also gets the part it did not send (held tokens of others merged
  behind its append). Registering a group sends the engine the group's backlog: every
  sample's tokens so far (the engine skips what it already has).
- A group nobody has registered for ``ttl_s`` seconds is dropped: finished, or between
  two chunks for longer than the TTL (divided rollout unregisters a group briefly while
  a chunk moves).
- Weights versions only move forward: a message with a newer version drops every group
  and tells every engine (``DraftReset``); messages of an older version are refused, so
  drafts never mix policies.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field

import structlog

from seer.protocol import DraftAppend, DraftDown, DraftRegister, DraftReset, DraftUnregister, DraftUp

log = structlog.get_logger()

Outgoing = list[tuple[int, DraftDown]]


class GapBuffer:
    """Token runs that start past the end of a sample's log, kept until it reaches them.

    Bounded: beyond ``max_runs`` the run starting farthest ahead is dropped (it can only
    matter after every run before it), and counted."""

    __slots__ = ("runs", "max_runs", "num_dropped")

    def __init__(self, max_runs: int = 64) -> None:
        self.runs: dict[int, array] = {}
        self.max_runs = max_runs
        self.num_dropped = 0

    def __len__(self) -> int:
        return len(self.runs)

    def hold(self, start_pos: int, tokens: array) -> None:
        old = self.runs.get(start_pos)
        if old is None or len(old) < len(tokens):
            self.runs[start_pos] = tokens
        if len(self.runs) > self.max_runs:
            del self.runs[max(self.runs)]
            self.num_dropped += 1

    def take_ready(self, have: int) -> list[tuple[int, array]]:
        """Runs that now start at or before ``have`` tokens, in order (removed)."""
        ready = sorted(s for s in self.runs if s <= have)
        return [(s, self.runs.pop(s)) for s in ready]


class SampleLog:
    """One sample's response tokens (int32) plus runs waiting for a gap to close."""

    __slots__ = ("tokens", "gaps")

    def __init__(self) -> None:
        self.tokens = array("i")
        self.gaps = GapBuffer()

    def add(self, start_pos: int, tokens: array) -> int:
        """Store a run; returns the log's length before (new tokens are ``tokens[before:]``)."""
        before = len(self.tokens)
        if start_pos > before:
            self.gaps.hold(start_pos, tokens)
            return before
        self._extend(start_pos, tokens)
        while self.gaps.runs:
            ready = self.gaps.take_ready(len(self.tokens))
            if not ready:
                break
            for start, run in ready:
                self._extend(start, run)
        return before

    def _extend(self, start_pos: int, tokens: array) -> None:
        have = len(self.tokens)
        if start_pos + len(tokens) > have:
            self.tokens.extend(tokens[have - start_pos:])


@dataclass
class _Group:
    samples: dict[str, SampleLog] = field(default_factory=dict)
    engines: set[int] = field(default_factory=set)
    idle_since: float | None = None  # when the last engine unregistered (None: registered)


class DraftServerCore:
    """Per-group sample logs and subscriptions for one host. Engines are opaque ints
    (the shell's connection ids), ``connect``-ed before their first message."""

    def __init__(self, ttl_s: float) -> None:
        if ttl_s < 0:
            raise ValueError(f"ttl_s must be >= 0, got {ttl_s}")
        self.ttl_s = ttl_s
        self.weights_version: int | None = None  # set by the first message
        self.groups: dict[str, _Group] = {}
        self.engines: set[int] = set()
        self.num_stale_refused = 0
        self.num_tokens_in = 0
        self.num_tokens_out = 0

    # ---- engines --------------------------------------------------------------

    def connect(self, engine: int) -> None:
        self.engines.add(engine)

    def disconnect(self, engine: int, now: float) -> None:
        """An engine's rings went away: it holds no group any more."""
        self.engines.discard(engine)
        for group in self.groups.values():
            if engine in group.engines:
                group.engines.discard(engine)
                if not group.engines:
                    group.idle_since = now

    # ---- messages -------------------------------------------------------------

    def handle(self, engine: int, msg: DraftUp, now: float) -> Outgoing:
        match msg:
            case DraftAppend():
                return self._append(engine, msg, now)
            case DraftRegister():
                return self._register(engine, msg, now)
            case DraftUnregister():
                group = self.groups.get(msg.group_id)
                if group is not None and engine in group.engines:
                    group.engines.discard(engine)
                    if not group.engines:
                        group.idle_since = now
                return []
            case _:
                raise TypeError(f"not an up-ring message: {type(msg).__name__}")

    def _check_version(self, version: int) -> tuple[bool, Outgoing]:
        """(accept?, resets to send)."""
        current = self.weights_version
        if current is None or version == current:
            self.weights_version = version
            return True, []
        if version < current:
            self.num_stale_refused += 1
            return False, []
        num_groups = len(self.groups)
        self.groups.clear()
        self.weights_version = version
        log.info("draft_server_reset", weights_version=version, num_groups_dropped=num_groups)
        return True, [(e, DraftReset(weights_version=version)) for e in sorted(self.engines)]

    def _register(self, engine: int, msg: DraftRegister, now: float) -> Outgoing:
        accept, out = self._check_version(msg.weights_version)
        if not accept:
            return out
        group = self.groups.get(msg.group_id)
        if group is None:
            group = self.groups[msg.group_id] = _Group()
        group.engines.add(engine)
        group.idle_since = None
        for request_id, sample in group.samples.items():
            if sample.tokens:
                out.append((engine, DraftAppend(group_id=msg.group_id, request_id=request_id,
                                                weights_version=msg.weights_version, start_pos=0,
                                                token_ids=sample.tokens.tobytes())))
                self.num_tokens_out += len(sample.tokens)
        return out

    def _append(self, engine: int, msg: DraftAppend, now: float) -> Outgoing:
        if msg.start_pos < 0:
            raise ValueError(f"start_pos must be >= 0, got {msg.start_pos}")
        accept, out = self._check_version(msg.weights_version)
        if not accept:
            return out
        group = self.groups.get(msg.group_id)
        if group is None:
            # Tokens of a group nobody registered (yet): kept, and dropped after the TTL
            # unless an engine registers it.
            group = self.groups[msg.group_id] = _Group(idle_since=now)
        sample = group.samples.get(msg.request_id)
        if sample is None:
            sample = group.samples[msg.request_id] = SampleLog()
        tokens = array("i")
        tokens.frombytes(msg.token_ids)
        self.num_tokens_in += len(tokens)
        before = sample.add(msg.start_pos, tokens)
        after = len(sample.tokens)
        if after == before:
            return out
        sent_end = msg.start_pos + len(tokens)  # the sender has everything before this
        for other in sorted(group.engines):
            lo = before if other != engine else max(before, sent_end)
            if lo >= after:
                continue
            out.append((other, DraftAppend(group_id=msg.group_id, request_id=msg.request_id,
                                           weights_version=msg.weights_version, start_pos=lo,
                                           token_ids=sample.tokens[lo:after].tobytes())))
            self.num_tokens_out += after - lo
        return out

    # ---- time -----------------------------------------------------------------

    def expire(self, now: float) -> list[str]:
        """Drop groups no engine has had registered for ``ttl_s``; their ids."""
        dropped = [gid for gid, g in self.groups.items()
                   if g.idle_since is not None and now - g.idle_since >= self.ttl_s]
        for gid in dropped:
            group = self.groups.pop(gid)
            log.debug("draft_group_expired", group_id=gid,
                      num_tokens=sum(len(s.tokens) for s in group.samples.values()))
        return dropped

    def num_tokens(self, group_id: str) -> int:
        group = self.groups.get(group_id)
        return 0 if group is None else sum(len(s.tokens) for s in group.samples.values())


def split_append(msg: DraftAppend, max_tokens: int) -> list[DraftAppend]:
    """The same tokens as appends of at most ``max_tokens`` each, so that no record
    outgrows a ring (a long sample's backlog can be larger than the ring)."""
    n = len(msg.token_ids) // 4
    if n <= max_tokens:
        return [msg]
    return [DraftAppend(group_id=msg.group_id, request_id=msg.request_id, weights_version=msg.weights_version,
                        start_pos=msg.start_pos + lo, token_ids=msg.token_ids[4 * lo:4 * min(n, lo + max_tokens)])
            for lo in range(0, n, max_tokens)]
