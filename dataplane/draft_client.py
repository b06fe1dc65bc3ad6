"""The engine side of grouped drafting: a local ``DraftStore`` kept in step with the
host's draft server (dataplane/draft_server.py) over two shared-memory rings.

Owns the engine's copy of its groups' tokens and the traffic with the server. The vLLM
proposer calls ``register_group`` / ``append`` / ``unregister_group`` as requests come and
go, ``sync()`` once per engine step, and drafts from ``store``. Nothing here blocks or
raises on the engine's hot path because of the server:

- ``append`` applies the tokens to the local store at once and queues them; consecutive
  appends of the same sample between two ``sync`` calls become one record.
- ``sync`` writes what fits into the up ring (the rest waits, in order: nothing is lost),
  drains the down ring, and applies other engines' tokens up to ``max_apply_tokens`` per
  call (indexing costs ~13 µs a token; a large backlog is spread over several steps).
- No server (``run_dir`` None, no ``draft-server.json``, or its pid dead): local-only
  drafting from this engine's own samples. Every ``connect_interval_s`` the client looks
  again; on connecting it re-sends its registered groups and its own samples' tokens, so
  a server that starts late or restarts catches up.

Registrations are counted: call ``register_group`` for every request of a group that
joins the engine's batch and ``unregister_group`` when it leaves. The server hears of the
first and the last. A group nobody here has registered is kept locally for ``ttl_s``
(the server's TTL), so a chunk that comes back soon finds its group's tokens, then dropped.
A newer weights version (registered here, or a ``DraftReset`` from the server) drops every
group; appends for a dropped group are ignored until it is registered again, so tokens of
the old policy never enter the new version's store.

Drafts from history (``history``, a ``seer.dataplane.draft_history.DraftHistory``):
when a group leaves this engine for good (dropped after the TTL, retired by a weights
update, or replaced by a later rollout of the same prompt while idle here) its responses
are recorded under its prompt; a new group with that prompt is seeded with them
(``DraftStore.add_history``). ``history_age(group)`` says how many weight updates old
the seed is (-1: none).

Who unlinks: the client creates its two rings and unlinks them at ``close`` (the server
also unlinks them when it notices the client is gone, or at its own stop).
"""

from __future__ import annotations

import os
import time
from array import array
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import structlog

from seer.dataplane.draft_core import GapBuffer, split_append
from seer.dataplane.draft_history import DraftHistory, prompt_key
from seer.dataplane.draft_server import DEFAULT_TTL_S, max_tokens_per_record, read_info, ring_names
from seer.dataplane.drafts import DraftStore, DraftStoreConfig
from seer.dataplane.shmring import RingError, ShmRing
from seer.process import pid_alive
from seer.protocol import DraftAppend, DraftDown, DraftRegister, DraftReset, DraftUnregister

log = structlog.get_logger()


@dataclass
class _LocalGroup:
    weights_version: int
    refs: int = 0
    idle_since: float | None = None
    own: set[str] = field(default_factory=set)  # request ids appended by this engine
    prompt: bytes | None = None  # prompt_key of its prompt (None: not registered with one)
    history_age: int = -1  # weight updates since its history seed was generated (-1: none)


class _OpenAppend:
    """An up-ring append still growing until the next flush."""

    __slots__ = ("group_id", "request_id", "weights_version", "start_pos", "tokens")

    def __init__(self, group_id: str, request_id: str, weights_version: int, start_pos: int) -> None:
        self.group_id = group_id
        self.request_id = request_id
        self.weights_version = weights_version
        self.start_pos = start_pos
        self.tokens = array("i")


class DraftClient:
    def __init__(self, run_dir: str | None, engine_id: int, config: DraftStoreConfig | None = None, *,
                 ttl_s: float | None = None, max_apply_tokens: int = 1024, connect_interval_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic, history: DraftHistory | None = None) -> None:
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.engine_id = engine_id
        self.store = DraftStore(config)
        self.max_apply_tokens = max_apply_tokens
        self.connect_interval_s = connect_interval_s
        self.clock = clock
        self._ttl_s = ttl_s
        self._groups: dict[str, _LocalGroup] = {}
        self.history = history
        self._by_prompt: dict[bytes, set[str]] = {}  # prompt_key -> groups here with that prompt
        # Groups dropped by a weights reset: their requests ran under the old weights, so
        # appends for them are ignored until the group is registered again (new version).
        self._stale: set[str] = set()
        self._gaps: dict[tuple[str, str], GapBuffer] = {}
        self._outbox: list[bytes | msgspec.Struct | _OpenAppend] = []
        self._open: dict[tuple[str, str], _OpenAppend] = {}
        self._inbox: deque[DraftDown] = deque()
        self._up: ShmRing | None = None
        self._down: ShmRing | None = None
        self._server_pid = 0
        self._max_tokens = 1
        self._next_check = 0.0
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(DraftDown)
        self.num_tokens_received = 0
        if self.run_dir is not None:
            self._maintain(clock())

    @property
    def connected(self) -> bool:
        return self._up is not None

    @property
    def ttl_s(self) -> float:
        return self._ttl_s if self._ttl_s is not None else DEFAULT_TTL_S

    # ------------------------------------------------------------------ engine API
    def register_group(self, group_id: str, weights_version: int, prompt_token_ids: Sequence[int]) -> None:
        if weights_version > self.store.weights_version:
            self._reset(weights_version)
        elif weights_version < self.store.weights_version:
            log.warning("draft_register_stale", group_id=group_id, weights_version=weights_version,
                        current_version=self.store.weights_version)
            return
        self._stale.discard(group_id)
        group = self._groups.get(group_id)
        if group is None:
            group = self._groups[group_id] = _LocalGroup(weights_version)
            self.store.set_prompt(group_id, prompt_token_ids)
            if self.history is not None and len(prompt_token_ids):
                self._seed_from_history(group_id, group, prompt_token_ids)
        group.refs += 1
        group.idle_since = None
        if group.refs == 1 and self.connected:
            self._outbox.append(DraftRegister(group_id=group_id, weights_version=weights_version))

    def history_age(self, group_id: str) -> int:
        """Weight updates since the group's history seed was generated; -1: no seed."""
        group = self._groups.get(group_id)
        return -1 if group is None else group.history_age

    def _seed_from_history(self, group_id: str, group: _LocalGroup, prompt_token_ids: Sequence[int]) -> None:
        history = self.history
        assert history is not None
        key = group.prompt = prompt_key(prompt_token_ids)
        # An earlier rollout of this prompt still idle here (within its TTL) is over.
        for other in sorted(self._by_prompt.get(key, ())):
            if self._groups[other].refs == 0:
                self._drop_group(other)
        self._by_prompt.setdefault(key, set()).add(group_id)
        responses, age = history.lookup(prompt_token_ids)
        if responses and self.store.add_history(group_id, responses):
            group.history_age = age

    def _drop_group(self, group_id: str) -> None:
        """Forget a group here, keeping its responses as history of its prompt."""
        group = self._groups.pop(group_id)
        if group.prompt is not None:
            same = self._by_prompt.get(group.prompt)
            if same is not None:
                same.discard(group_id)
                if not same:
                    del self._by_prompt[group.prompt]
            if self.history is not None:
                responses = self.store.sequences(group_id)
                if responses:
                    self.history.record(self.store.tokens(group_id, "\x00prompt"), list(responses.values()),
                                        group.weights_version)
        self.store.drop_group(group_id)
        for key in [k for k in self._gaps if k[0] == group_id]:
            del self._gaps[key]

    def unregister_group(self, group_id: str) -> None:
        group = self._groups.get(group_id)
        if group is None or group.refs == 0:
            return
        group.refs -= 1
        if group.refs == 0:
            group.idle_since = self.clock()
            if self.connected:
                self._outbox.append(DraftUnregister(group_id=group_id))

    def append(self, group_id: str, request_id: str, start_pos: int, tokens: Sequence[int]) -> None:
        """This engine's new tokens of one sample: stored locally now, sent at the next ``sync``."""
        if group_id in self._stale:
            return  # generated under weights that a reset retired
        version = self.store.weights_version
        group = self._groups.get(group_id)
        if group is None:  # appended without a registration: kept for the TTL like an idle group
            group = self._groups[group_id] = _LocalGroup(version, idle_since=self.clock())
        group.own.add(request_id)
        self._apply(group_id, request_id, start_pos, tokens, version)
        if not self.connected or not tokens:
            return
        key = (group_id, request_id)
        pending = self._open.get(key)
        if pending is None or pending.start_pos + len(pending.tokens) != start_pos:
            pending = self._open[key] = _OpenAppend(group_id, request_id, version, start_pos)
            self._outbox.append(pending)
        pending.tokens.extend(tokens)

    def sync(self) -> None:
        """Flush queued records, take the server's, apply up to ``max_apply_tokens``.
        Cheap when idle (a few µs: two counter reads and a clock read)."""
        now = self.clock()
        if now >= self._next_check:
            self._maintain(now)
        if self._up is not None:
            if self._outbox:
                self._flush()
            try:
                records = self._down.drain()  # type: ignore[union-attr]
            except RingError:
                log.exception("draft_ring_corrupt", engine_id=self.engine_id)
                self._disconnect()
                records = []
            for record in records:
                try:
                    self._inbox.append(self._decoder.decode(record))
                except msgspec.DecodeError:
                    log.exception("draft_record_refused", engine_id=self.engine_id, num_bytes=len(record))
        if self._inbox:
            self._apply_inbox()

    def close(self) -> None:
        """Hand what is queued to the ring (one try, no waiting), then unlink the rings:
        the server reads what was written before it drops the connection."""
        if self._up is not None and self._outbox:
            self._flush()
        self._disconnect()

    # ------------------------------------------------------------------ local store
    def _apply(self, group_id: str, request_id: str, start_pos: int, tokens: Sequence[int], version: int) -> None:
        if self.store.append(group_id, request_id, tokens, start_pos=start_pos, weights_version=version):
            gaps = self._gaps.get((group_id, request_id))
            if gaps is not None:
                for start, run in gaps.take_ready(len(self.store.tokens(group_id, request_id))):
                    self.store.append(group_id, request_id, run, start_pos=start, weights_version=version)
                if not gaps.runs:
                    del self._gaps[(group_id, request_id)]
        elif version == self.store.weights_version and start_pos > 0:
            # A later chunk before the earlier one arrived (another engine's tokens are
            # still on their way): keep it until the gap closes.
            self._gaps.setdefault((group_id, request_id), GapBuffer()).hold(start_pos, array("i", tokens))

    def _apply_inbox(self) -> None:
        budget = self.max_apply_tokens
        while self._inbox and budget > 0:
            msg = self._inbox.popleft()
            match msg:
                case DraftAppend():
                    if msg.group_id not in self._groups:
                        continue  # dropped here already; the server will stop sending
                    tokens = array("i")
                    tokens.frombytes(msg.token_ids)
                    if len(tokens) > budget:  # the rest waits for the next sync, first in line
                        self._inbox.appendleft(msgspec.structs.replace(
                            msg, start_pos=msg.start_pos + budget, token_ids=tokens[budget:].tobytes()))
                        tokens = tokens[:budget]
                    self._apply(msg.group_id, msg.request_id, msg.start_pos, tokens, msg.weights_version)
                    self.num_tokens_received += len(tokens)
                    budget -= len(tokens)
                case DraftReset():
                    if msg.weights_version > self.store.weights_version:
                        self._reset(msg.weights_version)

    def _reset(self, weights_version: int) -> None:
        stale = set(self._groups)  # only the version just retired: bounded
        for group_id in list(self._groups):
            self._drop_group(group_id)  # their responses become history (of an older version)
        if self.history is not None:
            self.history.set_weights_version(weights_version)
        self.store.reset(weights_version)
        self._stale = stale
        self._gaps.clear()
        self._inbox.clear()

    def _expire(self, now: float) -> None:
        for group_id in [g for g, s in self._groups.items()
                         if s.idle_since is not None and now - s.idle_since >= self.ttl_s]:
            self._drop_group(group_id)

    # ------------------------------------------------------------------ server link
    def _flush(self) -> None:
        encoded: list[bytes] = []
        for item in self._outbox:
            if isinstance(item, bytes):
                encoded.append(item)
            elif isinstance(item, _OpenAppend):
                msg = DraftAppend(group_id=item.group_id, request_id=item.request_id,
                                  weights_version=item.weights_version, start_pos=item.start_pos,
                                  token_ids=item.tokens.tobytes())
                encoded.extend(self._encoder.encode(p) for p in split_append(msg, self._max_tokens))
            else:
                encoded.append(self._encoder.encode(item))
        self._open.clear()
        written = self._up.try_put_many(encoded)  # type: ignore[union-attr]
        self._outbox = encoded[written:]  # type: ignore[assignment]

    def _maintain(self, now: float) -> None:
        self._next_check = now + self.connect_interval_s
        self._expire(now)
        if self.run_dir is None:
            return
        if self._up is not None:
            if not pid_alive(self._server_pid):
                log.warning("draft_server_lost", engine_id=self.engine_id, server_pid=self._server_pid)
                self._disconnect()
            return
        info = read_info(self.run_dir)
        if info is None or not pid_alive(info.pid):
            return
        if self._ttl_s is None:
            self._ttl_s = info.ttl_s
        up_name, down_name = ring_names(info.pid, self.engine_id, os.getpid())
        try:
            self._down = ShmRing.create(down_name, info.ring_bytes)
            self._up = ShmRing.create(up_name, info.ring_bytes)  # last: the server looks for this one
        except (OSError, RingError):
            log.exception("draft_rings_create_failed", engine_id=self.engine_id)
            self._disconnect()
            return
        self._server_pid = info.pid
        self._max_tokens = max_tokens_per_record(info.ring_bytes)
        self._resync()
        log.info("draft_server_connected", engine_id=self.engine_id, server_pid=info.pid)

    def _resync(self) -> None:
        """Tell a (new) server everything it would have heard from this engine."""
        self._outbox = []
        self._open.clear()
        for group_id, group in self._groups.items():
            if group.refs > 0:
                self._outbox.append(DraftRegister(group_id=group_id, weights_version=group.weights_version))
            for request_id in sorted(group.own):
                tokens = self.store.tokens(group_id, request_id)
                if tokens:
                    item = _OpenAppend(group_id, request_id, group.weights_version, 0)
                    item.tokens.extend(tokens)
                    self._outbox.append(item)

    def _disconnect(self) -> None:
        for ring in (self._up, self._down):
            if ring is not None:
                ring.close()
                ring.unlink()
        self._up = self._down = None
        self._outbox = []
        self._open.clear()
