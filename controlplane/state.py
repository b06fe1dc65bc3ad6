"""Rollout, group and request state owned by the scheduler core.

Plain data with small, named transitions. A request is one sample of one group; it
accumulates generated tokens and logprobs across the chunks that produce it, so a
policy that splits generation into chunks (divided rollout) and one that does not
(the ``group`` baseline) share the same state. Nothing here touches sockets or clocks.
"""

from __future__ import annotations

import enum
import hashlib
from dataclasses import dataclass, field

from seer.protocol import EngineCapabilities, EngineHello, EngineLoad, EngineStatus, SamplingParams, Segment, TurnRecord


class RequestState(enum.Enum):
    WAITING = "waiting"  # in the request buffer, nothing in flight
    RUNNING = "running"  # a chunk is in flight on ``engine_id``
    TOOL_WAIT = "tool_wait"  # a trajectory's turn ended; its environment has not answered yet
    FINISHED = "finished"


@dataclass(eq=False, slots=True)
class Trajectory:
    """A multi-turn sample's own state (``controlplane/turns.py`` moves it): where the
    current turn's sampled tokens start in ``Request.generated_token_ids``, which of those
    tokens were appended rather than sampled, and one record per model turn."""

    max_turns: int
    max_context_tokens: int  # prompt + every token after it
    turn_start: int = 0
    appended: list[tuple[int, int]] = field(default_factory=list)  # [start, end) spans of mask 0
    turns: list[TurnRecord] = field(default_factory=list)  # the last one is the current turn
    waiting_since_s: float = 0.0  # when its current wait for the environment began
    replay: list[int] | None = None  # trace replay: tokens each turn decodes (RolloutRequest.replay_turns)
    agent_return: object = None  # an agent rollout's: what its agent function returned
    # An agent rollout's (the OpenAI endpoint, ``agent_calls.py``): its calls so far, and the
    # conversation they built ((role, content); None content: a turn the model sampled).
    num_calls: int = 0
    conversation: list[tuple[str, str | None]] = field(default_factory=list)
    base_sampling: SamplingParams | None = None  # the rollout's, before a call's own overrides
    pending_end: object = None  # a TurnInput that came while a call's turn ran (applied at its end)
    reward: float | None = None
    segments: list[Segment] = field(default_factory=list)  # an agent's earlier segments (``turns.new_segment``)


@dataclass(eq=False, slots=True)
class Request:
    request_id: str
    group: Group
    sample_index: int
    prompt_token_ids: list[int]
    sampling: SamplingParams  # seed already derived per sample
    state: RequestState = RequestState.WAITING
    generated_token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    engine_id: int | None = None
    task_id: int | None = None
    engine_history: list[int] = field(default_factory=list)
    num_chunks: int = 0
    num_failures: int = 0  # chunks an engine reported as failed
    chunk_max_tokens: int = 0  # budget of the chunk in flight (for KV admission)
    migrated_from: int | None = None  # engine of the previous chunk, if the chunk in flight moved
    kv_key: int = 0  # the request's key in the host KV pool (0: none yet)
    kv_valid_tokens: int = 0  # the pool holds the KV of tokens [0, kv_valid_tokens)
    oracle_length: int | None = None  # true output length: from the trace (simulations) or RolloutRequest.true_lengths
    forced_length: int | None = None  # trace replay: the engines generate exactly this many tokens (EOS ignored)
    first_scheduled_s: float | None = None
    finished_s: float | None = None
    finish_reason: str | None = None
    # ``generated_token_ids`` packed for the wire as far as it was last sent (it only grows),
    # so a chunk packs only the tokens new since its request's previous chunk; dropped at finish.
    packed_generated: bytearray | None = field(default=None, repr=False)
    trajectory: Trajectory | None = None  # a multi-turn sample (RolloutRequest.trajectory)

    @property
    def num_generated_tokens(self) -> int:
        return len(self.generated_token_ids)

    @property
    def remaining_tokens(self) -> int:
        """Tokens it may still sample: of its sample, or of its turn and context budget."""
        t = self.trajectory
        if t is None:
            return self.sampling.max_tokens - len(self.generated_token_ids)
        return min(self.sampling.max_tokens - (len(self.generated_token_ids) - t.turn_start),
                   t.max_context_tokens - self.context_tokens)

    @property
    def context_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.generated_token_ids)


@dataclass(eq=False, slots=True)
class Group:
    group_id: str
    rollout: Rollout
    group_index: int
    prompt_id: str
    requests: list[Request] = field(default_factory=list)
    num_finished: int = 0
    num_generated_tokens: int = 0  # over all its samples (the scheduler adds each chunk's)
    # (prompt list, its wire bytes): the samples of a group share one prompt list, packed once.
    packed_prompt: tuple[list[int], bytes] | None = field(default=None, repr=False)

    @property
    def done(self) -> bool:  # (>=: a delivered rollout's groups are emptied, ``MemoryRelease.dismantle``)
        return self.num_finished >= len(self.requests)


@dataclass(eq=False)
class Rollout:
    rollout_id: str
    policy: str
    accepted_s: float
    groups: list[Group] = field(default_factory=list)
    num_samples_done: int = 0
    num_groups_done: int = 0
    num_output_tokens: int = 0
    num_chunks: int = 0
    preemptions_at_start: dict[int, int] = field(default_factory=dict)
    per_engine_output_tokens: dict[int, int] = field(default_factory=dict)
    num_recomputed_tokens: int = 0  # context computed again (``turns.recomputed_tokens``)
    cancelled: bool = False
    # False: its chunks go out with ``ChunkTask.draft = False`` (RolloutRequest.speculative).
    speculative: bool = True
    agent: bool = False  # its turns are calls to the OpenAI endpoint (RolloutRequest.agent_keys)

    @property
    def num_samples(self) -> int:
        return sum(len(g.requests) for g in self.groups)

    @property
    def done(self) -> bool:  # (>=: see ``Group.done``)
        return self.num_groups_done >= len(self.groups)


class EngineState(enum.Enum):
    """An engine's lifecycle. Transitions (``ENGINE_TRANSITIONS``; only ``Registry`` moves them):

    * ``starting``: spawned here, no hello yet -> ``ready`` (admitted), ``updating`` (its hello
      carried older weights), ``lost`` (silent or exited before its hello), ``stopped``;
    * ``updating``: connected and pinged, loading the last update's checkpoint, given no work
      -> ``ready`` (caught up), ``lost`` (the replay failed, or silent), ``stopped``;
    * ``ready``: takes work -> ``lost`` (silent, exited, unreachable), ``stopped`` (clean
      shutdown), ``ready`` (admitted again: only without work in flight);
    * ``lost``: its work went back to the buffer -> ``ready`` / ``updating`` (it said hello again);
    * ``stopped``: final.

    An engine that joins from outside (``seerctl engine --join``) or in a simulation enters
    at ``ready`` or ``updating`` directly.
    """

    STARTING = "starting"
    UPDATING = "updating"
    READY = "ready"
    LOST = "lost"
    STOPPED = "stopped"


ENGINE_TRANSITIONS: dict[EngineState | None, frozenset[EngineState]] = {
    None: frozenset({EngineState.STARTING, EngineState.READY, EngineState.UPDATING}),  # a new record
    EngineState.STARTING: frozenset({EngineState.READY, EngineState.UPDATING, EngineState.LOST, EngineState.STOPPED}),
    EngineState.UPDATING: frozenset({EngineState.READY, EngineState.LOST, EngineState.STOPPED}),
    EngineState.READY: frozenset({EngineState.READY, EngineState.LOST, EngineState.STOPPED}),
    EngineState.LOST: frozenset({EngineState.READY, EngineState.UPDATING}),
    EngineState.STOPPED: frozenset(),
}


class Inflight(dict):
    """An engine's in-flight chunks (task id -> request) that counts its changes: ``version``
    grows with every mutation, so a reader that keeps per-engine state (the policies' KV
    reservations, ``policies/admission.py``) recomputes only the engines whose version
    moved since it last looked, instead of rescanning every engine every round. The last
    changes are kept as a log (``changes_since``) so such a reader can often apply just
    them; bulk changes (``clear``, ``update``...) reset the log (readers rescan)."""

    __slots__ = ("version", "_log", "_log_start")
    LOG_LIMIT = 256  # changes kept; a reader further behind rescans

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self.version = 0
        self._log: list[tuple[bool | None, Request | None]] = []  # (added, request); None: no change
        self._log_start = 0  # the version before the log's first entry

    def _logged(self, added: bool | None, request: Request | None) -> None:
        self.version += 1
        log = self._log
        log.append((added, request))
        if len(log) > 2 * self.LOG_LIMIT:
            del log[:self.LOG_LIMIT]
            self._log_start += self.LOG_LIMIT

    def _reset(self) -> None:
        self.version += 1
        self._log.clear()
        self._log_start = self.version

    def changes_since(self, version: int) -> list[tuple[bool | None, Request | None]] | None:
        """(added, request) of every change after ``version`` in order, or None if they
        are no longer all kept (rescan)."""
        if version < self._log_start or version > self.version:
            return None
        return self._log[version - self._log_start:]

    # ``dict.get(self, ...)`` rather than ``super().get``: these run for every chunk.
    def __setitem__(self, key: int, value: Request) -> None:
        old = dict.get(self, key)
        if old is not None:
            self._logged(False, old)
        dict.__setitem__(self, key, value)
        self._logged(True, value)

    def __delitem__(self, key: int) -> None:
        value = dict.pop(self, key)
        self._logged(False, value)

    def pop(self, key: int, *default: object) -> object:  # type: ignore[override]
        if key in self:
            value = dict.pop(self, key)
            self._logged(False, value)
            return value
        self._logged(None, None)
        return dict.pop(self, key, *default)

    def popitem(self) -> tuple[int, Request]:
        self._reset()
        return super().popitem()

    def clear(self) -> None:
        self._reset()
        super().clear()

    def update(self, *args: object, **kwargs: object) -> None:  # type: ignore[override]
        self._reset()
        super().update(*args, **kwargs)

    def setdefault(self, key: int, default: Request | None = None) -> Request | None:  # type: ignore[override]
        self._reset()
        return super().setdefault(key, default)


@dataclass(eq=False)
class EngineView:
    """The one record of one engine: its lifecycle state, how to reach it, what it said in
    its hello, its last load and the scheduler's tasks on it. The registry keeps it (and
    alone moves ``state``); the scheduler reads it and owns ``inflight``."""

    engine_id: int
    capabilities: EngineCapabilities | None = None  # from its hello (None while ``starting``)
    load: EngineLoad = field(default_factory=EngineLoad)
    state: EngineState = EngineState.STARTING
    inflight: Inflight = field(default_factory=Inflight)  # task_id -> request; counts its changes
    pid: int = 0
    last_heard_s: float = 0.0
    loaded_weights_version: int = 0  # the weights the engine has loaded (the service's may be newer)
    identity: bytes = b""  # the engine's ZeroMQ identity: where messages to it go
    joined: bool = False  # joined from outside (`seerctl engine --join`), not spawned here
    hello: EngineHello | None = None  # kept while ``updating``: it is admitted with it once current
    # A chunk went past its deadline here: ``ready`` but given no new work until it
    # finishes a chunk (``Registry.mark_unhealthy`` / ``finished_chunk``).
    unhealthy: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.inflight, Inflight):
            self.inflight = Inflight(self.inflight)

    @property
    def num_inflight(self) -> int:
        return len(self.inflight)

    def status(self) -> EngineStatus:
        return EngineStatus(engine_id=self.engine_id, pid=self.pid, state=self.state.value, load=self.load,
                            capabilities=self.capabilities, weights_version=self.loaded_weights_version)


def derive_sample_seed(seed: int | None, group_index: int, sample_index: int) -> int | None:
    """Per-sample seed: G samples of one prompt must not share a seed (they would be
    identical); the same (seed, group, sample) always gives the same value."""
    if seed is None:
        return None
    return _seed_from(f"{seed}:{group_index}:{sample_index}")


def _seed_from(text: str) -> int:
    """A stable non-negative 62-bit seed from a string (vLLM takes any int seed)."""
    digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 62) - 1)
