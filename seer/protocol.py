"""The one schema module: every message that crosses a process boundary.

One piece on purpose (over 500 lines): the whole wire contract, every tagged union and
``PROTOCOL_VERSION``, in one file that changes and is reviewed as one unit.

Owns the wire contract between the trainer client, the control plane and the engine
processes. Messages are msgspec Structs without behaviour, grouped into tagged unions
per direction; each socket builds one encoder and one typed decoder (see ``seer.wire``).
Nothing here imports torch, vLLM or ZeroMQ.

Token ids and logprobs travel to and from engines as packed little-endian arrays
(int32 / float32 ``bytes``): far cheaper to encode than ``list[int]`` at chunk sizes
(one buffer copy instead of one msgpack integer per token). Results handed to trainers use plain lists, once per sample.
float32 packing of logprobs is lossless: vLLM computes them in float32.
"""

from __future__ import annotations

from array import array
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct


PROTOCOL_VERSION = 1

# A trajectory (``RolloutRequest.trajectory``) also ends by its own limits: ``max_turns``,
# ``context_budget`` (``TrajectorySpec.max_total_tokens`` or the model's length),
# ``tool_timeout`` and ``tool_error`` (its environment did not answer in time, or raised),
# ``bad_tool_output`` (what the environment answered cannot be appended).
FinishReason = Literal["stop", "length", "abort", "max_turns", "context_budget", "tool_timeout", "tool_error",
                       "bad_tool_output"]

# ---------------------------------------------------------------------------
# The shape of one KV pool block. Engines report it on hello; the control plane sizes the
# pool with it; a pool and an engine whose fingerprints differ never exchange blocks.

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


class PoolGeometry(msgspec.Struct, frozen=True, kw_only=True):
    """What one pool block holds: ``block_size`` tokens x ``num_layers`` layers of
    ``num_kv_heads`` heads of K and V, each ``head_size`` elements of ``dtype``."""

    num_layers: int
    num_kv_heads: int
    head_size: int
    block_size: int
    dtype: str
    layout: str = "paged-v1"  # the engine's page format; part of the fingerprint

    @property
    def layer_bytes(self) -> int:
        return self.num_kv_heads * self.block_size * 2 * self.head_size * _DTYPE_BYTES[self.dtype]

    @property
    def bytes_per_block(self) -> int:
        return self.num_layers * self.layer_bytes

    @property
    def bytes_per_token(self) -> int:
        return self.bytes_per_block // self.block_size

    @property
    def fingerprint(self) -> str:
        return (f"{self.layout}:L{self.num_layers}:H{self.num_kv_heads}:D{self.head_size}:"
                f"B{self.block_size}:{self.dtype}")


# ---------------------------------------------------------------------------
# Values shared by several messages


class SamplingParams(Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    """What a trainer may ask of the sampler. Unknown fields are refused at decode.

    Only options whose meaning Seer can keep exactly are offered. Presence/frequency/
    repetition penalties are deliberately absent (see docs/client.md).
    """

    max_tokens: Annotated[int, Meta(ge=1)] = 256
    # Finite: inf (and NaN, which no bound admits) are refused at decode; far below the
    # bound the distribution is already uniform in practice.
    temperature: Annotated[float, Meta(ge=0.0, le=1e6)] = 1.0
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Meta(ge=-1)] = -1
    min_tokens: Annotated[int, Meta(ge=0)] = 0
    seed: int | None = None
    stop: list[str] = []
    stop_token_ids: list[Annotated[int, Meta(ge=0)]] = []
    ignore_eos: bool = False


class ChatMessage(Struct, forbid_unknown_fields=True, frozen=True):
    role: str
    content: str


class Prompt(Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    """One prompt: exactly one of ``prompt``, ``messages``, ``prompt_token_ids``."""

    id: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    prompt_token_ids: list[int] | None = None


class SampleResult(Struct, kw_only=True):
    sample_index: int
    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: FinishReason
    num_prompt_tokens: int
    first_scheduled_s: float  # seconds since the rollout was accepted
    finished_s: float
    engine_ids: list[int]  # every engine that generated part of this sample, in order
    # One int per ``token_ids`` entry: 1 = sampled by the model (its logprob is real),
    # 0 = appended by a trajectory's environment or its chat template (logprob 0.0).
    loss_mask: list[int] = []
    turns: list[TurnRecord] = []  # one per model turn; empty for a single-turn rollout
    reward: float | None = None  # what a trajectory's environment said when it ended it
    agent_return: Any = None  # an agent rollout's: what its agent function returned
    # An agent rollout's prompt as the daemon rendered it from the (last segment's) first
    # call; empty for other rollouts (their prompt is the trainer's own).
    prompt_token_ids: list[int] = []
    # An agent rollout whose agent rewrote earlier messages: the segments before the last,
    # in order (each a prompt and what followed it); ``prompt_token_ids``, ``token_ids``,
    # ``logprobs`` and ``loss_mask`` above are the last segment's. Empty when every call
    # only appended (the usual case).
    segments: list[Segment] = []


class Segment(Struct, kw_only=True):
    """One stretch of an agent trajectory whose calls only appended: the prompt its first
    call rendered and every token after it, as ``SampleResult`` holds its last segment."""

    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    loss_mask: list[int]


class TurnRecord(Struct, kw_only=True):
    """One model turn of a trajectory: the span of its segment's ``token_ids`` it sampled
    (``[start, end)``; ``SampleResult.token_ids`` unless the agent rewrote history), where
    it ran, what it computed, and what its environment did."""

    start: int
    end: int
    engine_ids: list[int]  # every engine that generated part of this turn, in order
    prefilled_tokens: int = 0  # context tokens computed this turn (over its chunks)
    reused_tokens: int = 0  # context tokens whose KV was reused (an engine's prefix cache or the pool)
    # Context tokens computed again that were computed before (a turn's earlier context not
    # in its engine's cache nor loaded from the pool); 0 when the KV was kept.
    recomputed_tokens: int = 0
    num_chunks: int = 0
    finish_reason: str = ""  # how the model's generation ended: "stop" (EOS, a stop string) or "length"
    appended_tokens: int = 0  # tool / template tokens appended after it (loss mask 0)
    tool_name: str = ""  # the environment's name for what it ran ("" if none)
    tool_s: float = 0.0  # seconds the environment took to answer
    # "continue" (its answer was appended), "done", "tool_timeout", "tool_error",
    # "bad_tool_output", "max_turns", "context_budget"; "" while it runs.
    outcome: str = ""
    error: str = ""  # a raising environment's message, or why its answer was refused
    # Which segment it sampled in (``SampleResult.segments``, the last one being the
    # sample's own tokens): 0 unless an agent rewrote earlier messages.
    segment: int = 0


class GroupResult(Struct, kw_only=True):
    group_index: int
    prompt_id: str
    samples: list[SampleResult]


class RolloutStats(Struct, kw_only=True):
    policy: str
    num_groups: int
    num_samples: int
    num_output_tokens: int
    wall_time_s: float
    throughput_tokens_per_s: float
    tail_time_s: float  # from 90 % of samples finished to the last
    num_preemptions: int
    num_chunks: int
    per_engine_output_tokens: dict[str, int]
    # Context tokens the engines computed again that had been computed before (a chunk's or
    # a turn's earlier context neither in its engine's cache nor loaded from the KV pool).
    num_recomputed_tokens: int = 0


class EngineLoad(Struct, kw_only=True):
    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0  # fraction of the engine's KV cache in use, 0..1
    num_preemptions: int = 0  # cumulative since the engine started
    # Speculative decoding, cumulative since the engine started (vLLM's counts; 0 without SD):
    # drafting steps (one sequence, one step), draft tokens proposed, draft tokens accepted.
    num_spec_drafts: int = 0
    num_spec_draft_tokens: int = 0
    num_spec_accepted_tokens: int = 0


class EngineCapabilities(Struct, kw_only=True):
    backend: str  # "vllm" | "sim"
    model: str
    dtype: str
    max_model_len: int
    vocab_size: int
    kv_capacity_tokens: int
    block_size: int
    # Shape of one KV block in this engine's paged layout; None: this engine cannot use
    # the host KV pool (simulated, or the pool is off).
    kv_geometry: PoolGeometry | None = None


class EngineStatus(Struct, kw_only=True):
    engine_id: int
    pid: int
    state: str  # "starting" | "ready" | "lost" | "stopped"
    load: EngineLoad
    capabilities: EngineCapabilities | None
    weights_version: int
    # Where a Ray-launched engine runs (``[cluster] launcher = "ray"``); empty otherwise.
    node_ip: str = ""
    ray_actor_id: str = ""


class RolloutProgress(Struct, kw_only=True):
    rollout_id: str
    policy: str
    num_groups: int
    num_groups_done: int
    num_samples: int
    num_samples_done: int
    num_output_tokens: int
    elapsed_s: float
    num_recomputed_tokens: int = 0  # context computed again (RolloutStats.num_recomputed_tokens)
    num_waiting_for_env: int = 0  # trajectories waiting for their environment's answer


class SchedulingStatus(Struct, kw_only=True):
    """What the scheduler's cost-aware decisions rest on now (docs/architecture.md,
    "Cost-aware decisions"): the engines' step cost as fitted from their step records,
    ``a + b·B + c·S + p·P`` seconds per step, and what the configured policy chose from it."""

    step_fixed_s: float  # a
    step_per_seq_s: float  # b
    step_per_kv_token_s: float  # c
    step_per_prefill_token_s: float  # p
    num_step_records: int  # accepted into the fit, ever
    num_step_records_refused: int  # outside physical bounds, ever
    policy: str
    chunk_size_tokens: int
    # The configured policy's KV admission (``context``): the margin in standard deviations of
    # an engine's total use (negative: admits beyond the expected use) and the overflow odds
    # it accepts. None: the policy does not reserve by expected use.
    admission_margin_sd: float | None = None
    overflow_odds: float | None = None
    placement: str = ""  # "drain" (predicted drain time), "in-flight" (chunk counts) or "engine" (its own)
    whole_samples: bool = False  # the latest rollout goes as whole samples (the KV holds its expected work)


class ServiceStatus(Struct, kw_only=True):
    pid: int
    policy: str
    weights_version: int
    engines: list[EngineStatus]
    rollouts: list[RolloutProgress]
    run_dir: str
    client_address: str
    scheduling: SchedulingStatus | None = None
    openai_url: str = ""  # the OpenAI-compatible endpoint's base URL ("" when [openai] is off)


# ---------------------------------------------------------------------------
# Trainer client -> control plane. ``call_id`` pairs every reply with its call.


class TrajectorySpec(Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    """``RolloutRequest.trajectory``: every sample is a multi-turn trajectory. A turn ends
    when the model stops (EOS, a stop string such as a tool parser's ``</tool_call>``) or
    reaches ``sampling.max_tokens`` (per turn); the client's environment answers each turn
    end (``TurnEnded`` -> ``TurnInput``)."""

    max_turns: Annotated[int, Meta(ge=1, le=1000)] = 8
    # Prompt + every token after it (sampled and appended); None: the model's max_model_len.
    max_total_tokens: Annotated[int, Meta(ge=2)] | None = None
    # How long the client waits for its environment per turn (it enforces it and reports
    # ``tool_timeout``); the daemon keeps a waiting trajectory's client alive meanwhile.
    tool_timeout_s: Annotated[float, Meta(gt=0.0, le=86400.0)] = 30.0


class RolloutRequest(Struct, tag="rollout", forbid_unknown_fields=True, kw_only=True):
    call_id: str
    rollout_id: str
    prompts: list[Prompt]
    group_size: int
    sampling: SamplingParams = SamplingParams()
    policy: str | None = None  # None: the daemon's configured policy
    # The oracle policies' input on a daemon: every sample's true output length
    # (``true_lengths[prompt][sample]``), recorded from an earlier run of the same prompts
    # with the same ``sampling.seed``. Seeded sampling is schedule-invariant, so those
    # lengths are what this run will generate. Only the oracle policies use it
    # (``ORACLE_POLICIES`` in controlplane/intake.py).
    true_lengths: list[list[int]] | None = None
    # Trace replay (benchmarks): every sample decodes exactly ``replay_lengths[prompt][sample]``
    # tokens, EOS ignored, so real engines generate a trace's lengths with real text. The
    # policies are not told them (the oracle policies take them as their true lengths).
    replay_lengths: list[list[int]] | None = None
    # False: never draft for this rollout's samples. Engines with speculative.method =
    # "grouped" then run them exactly as without speculative decoding, position-keyed
    # seeds included (schedule-invariant samples). A daemon whose engines use vLLM's own
    # drafters ("ngram", "suffix") refuses it: those draft for every request. With "off"
    # it changes nothing.
    speculative: bool = True
    trajectory: TrajectorySpec | None = None  # None: single-turn samples
    # Agentic trace replay (benchmarks): turn k of sample j of prompt i decodes exactly
    # ``replay_turns[i][j][k]`` tokens, EOS ignored, then ends as at a stop; needs a
    # trajectory (whose turns stop there). The policies are not told them.
    replay_turns: list[list[list[int]]] | None = None
    # Agent rollouts (the OpenAI-compatible endpoint): one bearer key per sample
    # (``[prompt][sample]``), minted by the client; each call made with a key is the next
    # turn of that sample's trajectory. Needs a trajectory and the daemon's ``[openai]``.
    agent_keys: list[list[str]] | None = None


class TurnInput(Struct, tag="turn_input", forbid_unknown_fields=True, kw_only=True):
    """A trajectory's environment answered a turn end: ``messages`` (tool outputs, user
    feedback) are rendered by the model's chat template after the model's turn and
    appended as token ids, and the trajectory goes on; or it ends (``outcome`` "done",
    "tool_timeout", "tool_error", or "continue" with no messages)."""

    call_id: str
    rollout_id: str
    group_index: int
    sample_index: int
    turn: int  # the turn answered (TurnEnded.turn); -1: whichever turn (an agent function returned)
    outcome: Literal["continue", "done", "tool_timeout", "tool_error"] = "continue"
    messages: list[ChatMessage] = []
    tool_name: str = ""
    tool_s: float = 0.0
    error: str = ""
    reward: float | None = None
    agent_return: Any = None  # what an agent function returned (JSON-able): SampleResult.agent_return


class CancelRollout(Struct, tag="cancel", forbid_unknown_fields=True, kw_only=True):
    call_id: str
    rollout_id: str


class ClientHeartbeat(Struct, tag="heartbeat", forbid_unknown_fields=True, kw_only=True):
    """Sent while a client waits; a rollout whose client falls silent is aborted."""

    call_id: str
    rollout_ids: list[str]


class StatusRequest(Struct, tag="status", forbid_unknown_fields=True, kw_only=True):
    call_id: str


class UpdateWeightsRequest(Struct, tag="update_weights", forbid_unknown_fields=True, kw_only=True):
    call_id: str
    # A weights source: a safetensors checkpoint path on the daemon's host, or a trainer's
    # shared-memory segment ``shm://<segment>?generation=<n>`` (seer/weights_segment.py).
    path: str


class ShutdownRequest(Struct, tag="shutdown", forbid_unknown_fields=True, kw_only=True):
    call_id: str


ClientMessage = (
    RolloutRequest
    | TurnInput
    | CancelRollout
    | ClientHeartbeat
    | StatusRequest
    | UpdateWeightsRequest
    | ShutdownRequest
)

# ---------------------------------------------------------------------------
# Control plane -> trainer client


class RolloutAccepted(Struct, tag="rollout_accepted", kw_only=True):
    call_id: str
    rollout_id: str
    num_groups: int
    policy: str
    weights_version: int
    openai_url: str = ""  # an agent rollout's: the daemon's OpenAI-compatible endpoint (``[openai]``)
    openai_model: str = ""  # and the model id it serves


class GroupCompleted(Struct, tag="group_completed", kw_only=True):
    call_id: str
    rollout_id: str
    group: GroupResult


class TurnEnded(Struct, tag="turn_ended", kw_only=True):
    """A trajectory's model turn ended: its client runs the environment and answers with
    ``TurnInput``. ``final``: a limit ends the trajectory whatever the answer (its
    environment may still give a reward)."""

    call_id: str
    rollout_id: str
    group_index: int
    sample_index: int
    turn: int  # 0 for the first
    token_ids: list[int]  # what this turn sampled
    text: str
    finish_reason: str  # "stop" or "length"
    num_context_tokens: int  # prompt + every token so far
    final: bool = False
    logprobs: list[float] = []  # of ``token_ids``


class RolloutCompleted(Struct, tag="rollout_completed", kw_only=True):
    call_id: str
    rollout_id: str
    stats: RolloutStats
    weights_version: int


class StatusReply(Struct, tag="status_reply", kw_only=True):
    call_id: str
    status: ServiceStatus


class WeightsUpdated(Struct, tag="weights_updated", kw_only=True):
    call_id: str
    weights_version: int


class Ack(Struct, tag="ack", kw_only=True):
    call_id: str


class ErrorReply(Struct, tag="error", kw_only=True):
    """A refused or failed call. ``code`` is stable; ``message`` names problem and fix."""

    call_id: str
    code: str
    message: str


ServerMessage = (
    RolloutAccepted
    | GroupCompleted
    | TurnEnded
    | RolloutCompleted
    | StatusReply
    | WeightsUpdated
    | Ack
    | ErrorReply
)

# ---------------------------------------------------------------------------
# Engine process -> control plane


# An engine that joins a running control plane (`seerctl engine --join`) says hello with
# this id; the control plane assigns a fresh one in HelloAccepted.
JOIN_ENGINE_ID = -1


class EngineHello(Struct, tag="hello", kw_only=True):
    engine_id: int  # JOIN_ENGINE_ID: assign me one
    protocol_version: int
    pid: int
    capabilities: EngineCapabilities
    weights_version: int
    # The engine's host (hostname + network namespace); engines map to their host's KV
    # pool. Empty: the control plane's own host (an engine that predates the field).
    host_id: str = ""
    # The proof that this hello comes from the process that registered ``engine_id``: a
    # spawned engine's per-spawn secret (handed over by the supervisor through an inherited
    # pipe, never on the command line), or the one a joining engine chose at its start. A
    # hello for an id whose engine registered with a secret is refused without it: a second
    # connection cannot take a live engine's id, and a reconnecting engine (declared lost,
    # or rejoining) takes its id back with it. Never logged. Empty: an engine without one.
    secret: str = ""
    # A joining engine that registers again (``engine_id`` = JOIN_ENGINE_ID) with the
    # control plane that gave it an id: that id and the control plane's instance
    # (``HelloAccepted.control_plane``); with its ``secret`` it gets the same id back. Another
    # control plane (a restarted daemon) gives it a fresh id.
    previous_engine_id: int = JOIN_ENGINE_ID
    previous_control_plane: str = ""


class EngineHeartbeat(Struct, tag="engine_heartbeat", kw_only=True):
    engine_id: int
    load: EngineLoad
    # The engine steps since the last heartbeat (``pack_steps``), for the scheduler's fit of
    # the step cost (seer/stepcost.py); empty from an engine that records none.
    steps: bytes = b""


class ChunkFinished(Struct, tag="chunk_finished", kw_only=True):
    engine_id: int
    task_id: int
    token_ids: bytes  # int32 little-endian
    logprobs: bytes  # float32 little-endian, one per token
    finish_reason: FinishReason
    num_prompt_tokens: int
    num_cached_tokens: int  # prompt tokens not computed: local prefix cache + loaded from the pool
    elapsed_ms: float
    kv_loaded_tokens: int = 0  # prompt tokens whose KV came from the host pool
    kv_load_failed_tokens: int = 0  # pool loads that failed their check and were recomputed
    kv_load_ms: float = 0.0
    kv_saved_tokens: int = 0  # the pool now holds this request's KV for tokens [0, kv_saved_tokens)


class ChunkFailed(Struct, tag="chunk_failed", kw_only=True):
    engine_id: int
    task_id: int
    error: str


class WeightsLoaded(Struct, tag="weights_loaded", kw_only=True):
    engine_id: int
    weights_version: int
    error: str | None = None


EngineMessage = EngineHello | EngineHeartbeat | ChunkFinished | ChunkFailed | WeightsLoaded

# ---------------------------------------------------------------------------
# Control plane -> engine process


class EngineSampling(Struct, kw_only=True):
    """Sampling for one chunk, already resolved by the control plane."""

    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    min_tokens: int
    seed: int | None
    stop: list[str]
    stop_token_ids: list[int]
    ignore_eos: bool


class HelloAccepted(Struct, tag="hello_accepted", kw_only=True):
    engine_id: int
    # This control plane's instance (random at its start): a joining engine names it with
    # its id when it registers again (``EngineHello.previous_control_plane``).
    control_plane: str = ""


class HelloRejected(Struct, tag="hello_rejected", kw_only=True):
    reason: str
    # True: not a refusal of the engine but of its session -- the control plane does not know
    # it (it restarted) or no longer counts it (declared lost while it lived on): the engine
    # drops its work and says hello again. An engine still waiting for its answer takes such
    # a rejection for one addressed to its previous session and keeps waiting.
    say_hello_again: bool = False


class KVDescriptor(Struct, kw_only=True):
    """Where a request's KV lives in the host pool. Only these few bytes cross ZeroMQ;
    the KV itself stays in shared memory."""

    pool_name: str  # the /dev/shm segment
    key: int  # the logical request's pool key (written into every block's tag)
    weights_version: int  # blocks saved under other weights are never loaded
    pool_blocks: bytes  # int32 little-endian: pool block of the request's tokens [i*bs, (i+1)*bs)
    valid_tokens: int  # tokens [0, valid_tokens) are in the pool
    save: bool  # save this chunk's KV at its end (it will be continued)
    # Save as it goes, every step, not only in the step that reaches the chunk's budget: a
    # trajectory's turn that stops early (EOS, a tool call's stop string) is continued too.
    save_each_step: bool = False
    min_load_tokens: int  # load from the pool only if the engine's cache lacks at least this many


class ChunkTask(Struct, tag="chunk_task", kw_only=True):
    task_id: int
    request_id: str
    group_id: str
    prompt_token_ids: bytes  # int32 little-endian: prompt + tokens generated so far
    sampling: EngineSampling
    kv: KVDescriptor | None = None
    # For grouped speculative drafting (engines/proposer.py): how many of the last
    # prompt_token_ids are this request's own earlier output (-1: not said; the engine
    # infers it from the group's prompt), and whether the request is its group's probe
    # (drafts for it weigh lam times more).
    num_generated_tokens: int = -1
    probe: bool = False
    # False: the engine must not draft for this chunk (its rollout asked for no speculative
    # decoding); it then samples position-keyed, as an engine without SD does.
    draft: bool = True


class AbortTasks(Struct, tag="abort", kw_only=True):
    task_ids: list[int]


class LoadWeights(Struct, tag="load_weights", kw_only=True):
    path: str  # a weights source, as in UpdateWeightsRequest
    weights_version: int


class Ping(Struct, tag="ping", kw_only=True):
    """Control-plane liveness, sent to engines and host agents every tick. An engine that
    hears none for ``engines.heartbeat_timeout_s`` says hello again (joined) or exits; a
    host agent says its hello again until a control plane answers."""


class Shutdown(Struct, tag="shutdown", kw_only=True):
    pass


ControlMessage = HelloAccepted | HelloRejected | ChunkTask | AbortTasks | LoadWeights | Ping | Shutdown


# ---------------------------------------------------------------------------
# Host agent <-> control plane: moving KV blocks between hosts' pools. One agent per
# host serves its pool's blocks to other hosts and pulls blocks into it when told to.
# Agents connect to the engine address (same socket, same CURVE keys as engines).


class AgentHello(Struct, tag="agent_hello", kw_only=True):
    """An agent registers its host's pool; a later hello for the same host replaces it."""

    host_id: str  # stable per host and per network namespace
    protocol_version: int
    pid: int
    pool_name: str  # the host's /dev/shm segment
    geometry: PoolGeometry  # of the segment's blocks (fingerprint, block size)
    num_blocks: int
    transport: str  # how other hosts pull from it: "ucx" | "tcp"
    address: str  # its block server, opaque to the control plane


class PullDone(Struct, tag="pull_done", kw_only=True):
    transfer_id: int
    ok: bool
    # Never negative: a negative count would raise in the transfer-bytes counter halfway
    # through handling the answer. Refused at decode, the pull times out and re-prefills.
    num_bytes: Annotated[int, Meta(ge=0)] = 0
    seconds: Annotated[float, Meta(ge=0.0)] = 0.0
    error: str = ""


AgentMessage = AgentHello | PullDone


class PullBlocks(Struct, tag="pull_blocks", kw_only=True):
    """Copy blocks of another host's pool (served at ``address``) into this host's pool:
    source tags are checked (key, index, weights version, checksum) and the destination
    blocks sealed as a local save would."""

    transfer_id: int
    transport: str
    address: str
    src_blocks: bytes  # int32 little-endian
    dst_blocks: bytes  # int32 little-endian, same length
    key: int
    weights_version: int
    verify: bool = True


AgentCommand = PullBlocks | HelloRejected | Ping | Shutdown


# ---------------------------------------------------------------------------
# Packing helpers for the array fields (pure functions, no behaviour on messages).


def pack_token_ids(token_ids: list[int]) -> bytes:
    return array("i", token_ids).tobytes()


def unpack_token_ids(data: bytes) -> list[int]:
    out = array("i")
    out.frombytes(data)
    return out.tolist()


STEP_FIELDS = 4  # a step record: (seconds, batch, KV tokens, prefilled tokens)


def pack_steps(records: list[tuple[float, float, float, float]]) -> bytes:
    """Step records as float32 little-endian, ``STEP_FIELDS`` per record."""
    return array("f", [v for record in records for v in record]).tobytes()


def unpack_steps(data: bytes) -> list[tuple[float, ...]]:
    """The records of ``pack_steps``; ValueError if ``data`` is not whole records."""
    if len(data) % (4 * STEP_FIELDS):
        raise ValueError(f"step records: {len(data)} bytes is not a whole number of {4 * STEP_FIELDS}-byte records")
    values = array("f")
    values.frombytes(data)
    flat = values.tolist()
    return [tuple(flat[i:i + STEP_FIELDS]) for i in range(0, len(flat), STEP_FIELDS)]


def pack_logprobs(logprobs: list[float]) -> bytes:
    return array("f", logprobs).tobytes()


def unpack_logprobs(data: bytes) -> list[float]:
    out = array("f")
    out.frombytes(data)
    return out.tolist()


# ---------------------------------------------------------------------------
# Draft rings: engine <-> the host's draft server, over shared-memory rings
# (dataplane/draft_server.py), never over the control channel. One record = one message,
# msgpack, array-like (a few bytes of header per record). Token ids are packed int32.


class DraftRegister(Struct, tag="draft_register", array_like=True):
    """Engine -> server: this engine runs samples of the group; send its backlog and then
    every other engine's tokens for it. (The prompt stays on the engine: each engine
    that registers a group has it.)"""

    group_id: str
    weights_version: int


class DraftUnregister(Struct, tag="draft_unregister", array_like=True):
    """Engine -> server: no sample of the group runs here any more."""

    group_id: str


class DraftAppend(Struct, tag="draft_append", array_like=True):
    """Both directions: tokens ``[start_pos, start_pos + n)`` of one sample's response
    (``update_cst``). Up: an engine's own tokens; down: another engine's, or the backlog."""

    group_id: str
    request_id: str
    weights_version: int
    start_pos: int
    token_ids: bytes  # int32, pack_token_ids


class DraftReset(Struct, tag="draft_reset", array_like=True):
    """Server -> engine: a newer weights version appeared; drop every group of older ones."""

    weights_version: int


DraftUp = DraftRegister | DraftUnregister | DraftAppend
DraftDown = DraftAppend | DraftReset
