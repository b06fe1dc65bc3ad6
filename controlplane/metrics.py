"""Prometheus metrics of one control plane: the counters and histograms of what happened.

Owns the daemon's ``CollectorRegistry`` (its own, never prometheus_client's global one, so
two control planes in one process never share numbers) and every metric that counts an
event: chunks dispatched / finished / failed / migrated, samples and tokens by policy,
KV pool loads, saves, hits and misses, transfers between hosts, engines lost, weight
updates, and the histograms of chunk duration, time to first chunk and rollout wall and
tail time. Gauges that describe the current state (engines, rollouts in progress, the
pool's occupancy) are read from the control plane's tables at scrape time by
``metrics_state.py``; the HTTP endpoint is ``metrics_http.py``.

``Metrics`` is an observer: the server and the client sessions call it at their edge,
after the pure parts decided, with what they already hold; it never changes state it is
shown, does no I/O and reads the injected clock only. Names follow vLLM's
(``vllm:num_requests_running``): a ``seer:`` prefix, the unit as suffix, ``_total`` on
counters. docs/operations.md ("Metrics") lists every metric and what it means.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram

from seer.controlplane.scheduler import Completion, Dispatch
from seer.controlplane.state import Rollout
from seer.controlplane.stats import tail_start_rank
from seer.protocol import ChunkFinished, PullDone, RolloutStats

# Seconds; from a decode chunk of a few tokens on a GPU to a 2048-token chunk on a loaded CPU.
DURATION_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0, 500.0,
                      1000.0, 2500.0)
# A weights update: a reload of a small checkpoint to a restart-sized load of a large one.
UPDATE_BUCKETS_S = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0, 500.0, 1000.0)

class Metrics:
    """The event counters of one control plane (see the module docstring)."""

    def __init__(self, clock: Callable[[], float], *, min_load_tokens: int = 32) -> None:
        self.clock = clock
        # A continued chunk that computed at least this many context tokens again missed the
        # KV (kv_pool.min_load_tokens: fewer are not worth a pool load either).
        self.min_load_tokens = min_load_tokens
        self.registry = CollectorRegistry()
        # rollout_id -> when its tail started (its ``tail_start_rank``-th sample finished).
        self.tail_started_s: dict[str, float] = {}
        # rollout_id -> the sample rank where its tail starts, computed once per rollout:
        # Rollout.num_samples walks every group; walking it per finished sample made a
        # 100,000-sample rollout quadratic (tests/integration/test_responsive.py: over 10
        # minutes of control-plane CPU).
        self._tail_rank: dict[str, int] = {}
        self._update_started_s: float | None = None
        r = self.registry
        self.chunks_dispatched = Counter("seer:chunks_dispatched", "Chunks sent to an engine.",
                                         ["engine_id"], registry=r)
        self.chunks_finished = Counter("seer:chunks_finished", "Chunks an engine finished and the scheduler "
                                       "applied (late results of aborted chunks are not counted).",
                                       ["engine_id"], registry=r)
        self.chunks_failed = Counter("seer:chunks_failed", "Chunks that went back to the buffer: failed on "
                                     "the engine, past their deadline, or in flight on a lost engine.",
                                     ["reason"], registry=r)
        self.chunks_migrated = Counter("seer:chunks_migrated", "Chunks that ran on another engine than their "
                                       "request's previous chunk, by how their context got there.",
                                       ["mode"], registry=r)
        self.generation_tokens = Counter("seer:generation_tokens", "Output tokens generated.",
                                         ["policy"], registry=r)
        self.prompt_tokens = Counter("seer:prompt_tokens", "Context tokens of finished chunks (prompt plus the "
                                     "request's earlier output).", ["policy"], registry=r)
        self.prompt_tokens_cached = Counter("seer:prompt_tokens_cached", "Context tokens the engine did not "
                                            "compute: its prefix cache or the KV pool held them.",
                                            ["policy"], registry=r)
        self.recomputed_tokens = Counter("seer:recomputed_tokens", "Context tokens computed again that an engine "
                                         "had computed before (KV neither in its cache nor loaded from the pool; "
                                         "``turns.recomputed_tokens``).", ["policy"], registry=r)
        self.samples = Counter("seer:samples", "Samples (requests) finished.", ["policy", "finished_reason"],
                               registry=r)
        self.rollouts_completed = Counter("seer:rollouts_completed", "Rollouts delivered complete.",
                                          ["policy"], registry=r)
        self.rollouts_aborted = Counter("seer:rollouts_aborted", "Rollouts cancelled or failed, by reason.",
                                        ["reason"], registry=r)
        self.kv_pool_loads = Counter("seer:kv_pool_loads", "Chunks that loaded context KV from the host pool.",
                                     registry=r)
        self.kv_pool_loaded_tokens = Counter("seer:kv_pool_loaded_tokens", "Context tokens whose KV was loaded "
                                             "from the host pool.", registry=r)
        self.kv_pool_load_failed_tokens = Counter("seer:kv_pool_load_failed_tokens", "Pool loads that failed "
                                                  "their check and were recomputed, in tokens.", registry=r)
        self.kv_pool_saves = Counter("seer:kv_pool_saves", "Chunks whose KV was saved into the host pool.",
                                     registry=r)
        self.kv_pool_hits = Counter("seer:kv_pool_hits", "Continued chunks whose earlier context came from "
                                    "the host pool.", registry=r)
        self.kv_pool_misses = Counter("seer:kv_pool_misses", "Continued chunks that computed their earlier "
                                      "context again (neither the engine's cache nor the pool had it).",
                                      registry=r)
        self.kv_transfers = Counter("seer:kv_transfers", "KV pulls between hosts' pools answered by their "
                                    "agent, by outcome.", ["outcome"], registry=r)
        self.kv_transfer_bytes = Counter("seer:kv_transfer_bytes", "KV bytes pulled between hosts' pools.",
                                         registry=r)
        self.engines_lost = Counter("seer:engines_lost", "Engines lost (exited, silent or unreachable).",
                                    registry=r)
        self.weight_updates = Counter("seer:weight_updates", "Weight updates, by outcome.", ["outcome"],
                                      registry=r)
        self.weight_update_duration = Histogram("seer:weight_update_duration_seconds", "From the start of a "
                                                "weights update to its last engine's answer.",
                                                buckets=UPDATE_BUCKETS_S, registry=r)
        self.chunk_duration = Histogram("seer:chunk_duration_seconds", "Time an engine took for one chunk "
                                        "(reported by the engine).", buckets=DURATION_BUCKETS_S, registry=r)
        self.time_to_first_chunk = Histogram("seer:time_to_first_chunk_seconds", "From a rollout's acceptance "
                                             "to the end of a sample's first chunk (its first tokens back).",
                                             buckets=DURATION_BUCKETS_S, registry=r)
        self.rollout_wall_time = Histogram("seer:rollout_wall_time_seconds", "Completed rollouts: acceptance "
                                           "to last sample.", buckets=DURATION_BUCKETS_S, registry=r)
        self.rollout_tail_time = Histogram("seer:rollout_tail_time_seconds", "Completed rollouts: from 90 % of "
                                           "samples finished to the last.", buckets=DURATION_BUCKETS_S, registry=r)

    # ------------------------------------------------------------------ chunks
    def chunk_dispatched(self, dispatch: Dispatch) -> None:
        self.chunks_dispatched.labels(str(dispatch.engine_id)).inc()

    def chunk_finished(self, msg: ChunkFinished, done: Completion, *, migrated: bool) -> None:
        """A chunk the scheduler applied (``done``); ``migrated``: it ran on another engine
        than its request's previous chunk."""
        request = done.request
        rollout = request.group.rollout
        policy = rollout.policy
        self.chunks_finished.labels(str(msg.engine_id)).inc()
        self.chunk_duration.observe(msg.elapsed_ms / 1000.0)
        self.generation_tokens.labels(policy).inc(done.num_tokens)
        self.prompt_tokens.labels(policy).inc(msg.num_prompt_tokens)
        self.prompt_tokens_cached.labels(policy).inc(msg.num_cached_tokens)
        self.recomputed_tokens.labels(policy).inc(done.recomputed_tokens)
        if msg.kv_loaded_tokens:
            self.kv_pool_loads.inc()
            self.kv_pool_loaded_tokens.inc(msg.kv_loaded_tokens)
        if msg.kv_load_failed_tokens:
            self.kv_pool_load_failed_tokens.inc(msg.kv_load_failed_tokens)
        if msg.kv_saved_tokens:
            self.kv_pool_saves.inc()
        if migrated:
            self.chunks_migrated.labels("pool" if msg.kv_loaded_tokens else "reprefill").inc()
        earlier_output = request.num_generated_tokens - done.num_tokens
        if earlier_output > 0:  # a continued chunk: its context holds its own earlier output
            if msg.kv_loaded_tokens:
                self.kv_pool_hits.inc()
            elif msg.num_prompt_tokens - msg.num_cached_tokens >= self.min_load_tokens:
                self.kv_pool_misses.inc()
        elif done.num_tokens or done.sample_finished:  # the sample's first chunk is back
            self.time_to_first_chunk.observe(max(0.0, self.clock() - rollout.accepted_s))
        if done.sample_finished:
            self.samples.labels(policy, request.finish_reason or "length").inc()
            rank = self._tail_rank.get(rollout.rollout_id)
            if rank is None:
                rank = self._tail_rank[rollout.rollout_id] = tail_start_rank(rollout.num_samples)
            if rollout.num_samples_done == rank:
                self.tail_started_s[rollout.rollout_id] = request.finished_s or self.clock()

    def chunk_failed(self, reason: str, num_chunks: int = 1) -> None:
        """``reason``: "failed" (the engine said so), "timed_out", "engine_lost"."""
        if num_chunks:
            self.chunks_failed.labels(reason).inc(num_chunks)

    # ------------------------------------------------------------------ rollouts
    def rollout_completed(self, rollout: Rollout, stats: RolloutStats) -> None:
        self.rollouts_completed.labels(rollout.policy).inc()
        self.rollout_wall_time.observe(stats.wall_time_s)
        self.rollout_tail_time.observe(stats.tail_time_s)
        self.tail_started_s.pop(rollout.rollout_id, None)
        self._tail_rank.pop(rollout.rollout_id, None)

    def rollout_aborted(self, rollout_id: str, reason: str) -> None:
        self.rollouts_aborted.labels(reason).inc()
        self.tail_started_s.pop(rollout_id, None)
        self._tail_rank.pop(rollout_id, None)

    # ------------------------------------------------------------------ engines, pools, weights
    def engine_lost(self, engine_id: int | None = None) -> None:
        """An engine was lost: counted, and its own series (chunks dispatched and finished
        there) dropped. Every engine that joins has a new id, so series kept for lost ones
        grew with every restart for the daemon's life (a week of engines killed every few
        seconds: tens of thousands of label sets in memory and in every scrape). One that
        comes back under its id starts again from 0, which ``rate()`` reads as a reset."""
        self.engines_lost.inc()
        if engine_id is not None:
            for counter in (self.chunks_dispatched, self.chunks_finished):
                try:
                    counter.remove(str(engine_id))
                except KeyError:
                    pass  # never sent a chunk

    def pull_done(self, done: PullDone) -> None:
        """An agent answered a pull the control plane was waiting for."""
        self.kv_transfers.labels("ok" if done.ok else "failed").inc()
        if done.ok:
            self.kv_transfer_bytes.inc(done.num_bytes)

    def weights_update_started(self) -> None:
        self._update_started_s = self.clock()

    def weights_update_finished(self, ok: bool) -> None:
        self.weight_updates.labels("ok" if ok else "failed").inc()
        if self._update_started_s is not None:
            self.weight_update_duration.observe(max(0.0, self.clock() - self._update_started_s))
            self._update_started_s = None
