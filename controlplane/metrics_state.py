"""Prometheus gauges of the control plane's current state, read at scrape time.

Owns ``StateCollector``: a prometheus_client collector that, when scraped, reads the
tables the control plane already keeps -- the registry's engines (state, the load of
their last heartbeat: running, waiting, KV usage, vLLM's cumulative preemptions and
speculative-decoding counts), the scheduler's open rollouts and requests, the host KV
pools' allocators and the service's weights version -- and turns them into metric
families. Nothing is copied or kept up to date on the hot path; a scrape runs on the
event loop (``metrics_http.py``), so it never sees a table mid-change. It changes nothing
it reads; it only forgets ``Metrics.tail_started_s`` marks of rollouts that are gone.

Engine-side counters (preemptions, drafts) are cumulative per engine process and exported
as counters per ``engine_id``: a restarted engine starts again from 0, which Prometheus'
``rate()``/``increase()`` treat as a counter reset.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from seer.controlplane.kvpool.table import LOCAL_HOST
from seer.controlplane.metrics import Metrics
from seer.controlplane.registry import Registry
from seer.controlplane.scheduler import Scheduler
from seer.controlplane.state import EngineState
from seer.controlplane.weights import Weights


class StateCollector(Collector):
    def __init__(self, metrics: Metrics, registry: Registry, scheduler: Scheduler, weights: Weights,
                 spec_method: str, clock: Callable[[], float]) -> None:
        self.metrics = metrics
        self.engines = registry
        self.scheduler = scheduler
        self.weights = weights
        self.spec_method = spec_method  # daemon-wide (``speculative.method``): the label of the SD counters
        self.clock = clock

    def collect(self) -> Iterator[Metric]:
        yield from self._requests()
        yield from self._rollouts()
        yield from self._engines()
        yield from self._pools()
        yield from self._scheduling()
        version = GaugeMetricFamily("seer:weights_version", "The service's weights version (0: as started).")
        version.add_metric([], self.weights.service_version)
        yield version

    def _scheduling(self) -> Iterator[Metric]:
        """The fitted step cost and the configured policy's cost-aware choices."""
        status = self.scheduler.scheduling_status()
        cost = GaugeMetricFamily("seer:step_cost_seconds", "The engines' step cost as fitted from their step records: "
                                 "a (per step), b (per running sequence), c (per KV token), p (per prefilled token).",
                                 labels=["term"])
        for term, value in (("a", status.step_fixed_s), ("b", status.step_per_seq_s), ("c", status.step_per_kv_token_s),
                            ("p", status.step_per_prefill_token_s)):
            cost.add_metric([term], value)
        yield cost
        records = CounterMetricFamily("seer:step_records", "Engine step records the fit took (accepted) or refused "
                                      "(outside physical bounds).", labels=["outcome"])
        records.add_metric(["accepted"], status.num_step_records)
        records.add_metric(["refused"], status.num_step_records_refused)
        yield records
        if status.admission_margin_sd is not None:
            margin = GaugeMetricFamily("seer:admission_margin_sd", "KV admission margin of the configured policy, in "
                                       "standard deviations of an engine's total use (negative: overcommit).",
                                       labels=["policy"])
            margin.add_metric([status.policy], status.admission_margin_sd)
            yield margin
            odds = GaugeMetricFamily("seer:admission_overflow_odds", "The chance of overflowing an engine's KV that "
                                     "admission accepts, from the step cost (0..1).", labels=["policy"])
            odds.add_metric([status.policy], status.overflow_odds or 0.0)
            yield odds

    def _requests(self) -> Iterator[Metric]:
        open_rollouts = [r for r in self.scheduler.rollouts.values() if not r.done]
        running = sum(v.num_inflight for v in self.engines.engines.values())
        unfinished = sum(r.num_samples - r.num_samples_done for r in open_rollouts)
        for name, doc, value in (
                ("seer:num_requests_running", "Requests (samples) with a chunk on an engine.", running),
                ("seer:num_requests_waiting", "Unfinished requests of open rollouts with no chunk on an engine "
                 "(in the control plane's buffer).", max(0, unfinished - running)),
                ("seer:num_rollouts_running", "Rollouts accepted and not yet finished.", len(open_rollouts))):
            family = GaugeMetricFamily(name, doc)
            family.add_metric([], value)
            yield family

    def _rollouts(self) -> Iterator[Metric]:
        now = self.clock()
        labels = ["rollout_id", "policy"]
        samples = GaugeMetricFamily("seer:current_rollout_samples", "Samples of a running rollout.", labels=labels)
        done = GaugeMetricFamily("seer:current_rollout_samples_done", "Finished samples of a running rollout.",
                                 labels=labels)
        tokens = GaugeMetricFamily("seer:current_rollout_generation_tokens", "Output tokens of a running rollout "
                                   "so far.", labels=labels)
        progress = GaugeMetricFamily("seer:current_rollout_progress_ratio", "Finished samples / samples of a "
                                     "running rollout (0..1).", labels=labels)
        elapsed = GaugeMetricFamily("seer:current_rollout_elapsed_seconds", "Since a running rollout was "
                                    "accepted.", labels=labels)
        tail = GaugeMetricFamily("seer:current_rollout_tail_seconds", "A running rollout's tail time so far: "
                                 "since 90 % of its samples finished (0 before).", labels=labels)
        live = set()
        for rollout in self.scheduler.rollouts.values():
            if rollout.done:
                continue
            live.add(rollout.rollout_id)
            key = [rollout.rollout_id, rollout.policy]
            num_samples = rollout.num_samples
            samples.add_metric(key, num_samples)
            done.add_metric(key, rollout.num_samples_done)
            tokens.add_metric(key, rollout.num_output_tokens)
            progress.add_metric(key, rollout.num_samples_done / num_samples if num_samples else 1.0)
            elapsed.add_metric(key, max(0.0, now - rollout.accepted_s))
            started = self.metrics.tail_started_s.get(rollout.rollout_id)
            tail.add_metric(key, max(0.0, now - started) if started is not None else 0.0)
        for gone in set(self.metrics.tail_started_s) - live:  # cancelled or failed meanwhile
            del self.metrics.tail_started_s[gone]
        yield from (samples, done, tokens, progress, elapsed, tail)

    def _engines(self) -> Iterator[Metric]:
        label = ["engine_id"]
        up = GaugeMetricFamily("seer:engine_up", "1 while an engine is ready (takes work), else 0.", labels=label)
        by_state = GaugeMetricFamily("seer:num_engines", "Engines known to the control plane, by state.",
                                     labels=["state"])
        running = GaugeMetricFamily("seer:engine_num_requests_running", "Requests running in the engine "
                                    "(its last heartbeat).", labels=label)
        waiting = GaugeMetricFamily("seer:engine_num_requests_waiting", "Requests waiting in the engine's own "
                                    "queue (its last heartbeat).", labels=label)
        kv = GaugeMetricFamily("seer:engine_kv_cache_usage_perc", "Fraction of the engine's KV cache in use, "
                               "0..1 (its last heartbeat).", labels=label)
        inflight = GaugeMetricFamily("seer:engine_chunks_in_flight", "Chunks the control plane has on the "
                                     "engine.", labels=label)
        preemptions = CounterMetricFamily("seer:engine_num_preemptions", "Preemptions in the engine (vLLM's "
                                          "cumulative count, since the engine started).", labels=label)
        sd_labels = ["engine_id", "method"]
        drafts = CounterMetricFamily("seer:spec_decode_num_drafts", "Speculative decoding: drafting steps "
                                     "(one sequence, one step).", labels=sd_labels)
        draft_tokens = CounterMetricFamily("seer:spec_decode_num_draft_tokens", "Speculative decoding: draft "
                                           "tokens proposed.", labels=sd_labels)
        accepted = CounterMetricFamily("seer:spec_decode_num_accepted_tokens", "Speculative decoding: draft "
                                       "tokens accepted.", labels=sd_labels)
        counts = {state: 0 for state in EngineState}
        for engine_id, view in sorted(self.engines.engines.items()):
            counts[view.state] += 1
            key = [str(engine_id)]
            up.add_metric(key, 1.0 if view.state is EngineState.READY else 0.0)
            inflight.add_metric(key, view.num_inflight)
            if view.capabilities is None:
                continue  # no hello yet: no load reported
            load = view.load
            running.add_metric(key, load.num_running)
            waiting.add_metric(key, load.num_waiting)
            kv.add_metric(key, load.kv_usage)
            preemptions.add_metric(key, load.num_preemptions)
            if self.spec_method != "off":
                sd_key = [str(engine_id), self.spec_method]
                drafts.add_metric(sd_key, load.num_spec_drafts)
                draft_tokens.add_metric(sd_key, load.num_spec_draft_tokens)
                accepted.add_metric(sd_key, load.num_spec_accepted_tokens)
        for state, count in counts.items():
            by_state.add_metric([state.value], count)
        yield from (up, by_state, running, waiting, kv, inflight, preemptions, drafts, draft_tokens, accepted)

    def _pools(self) -> Iterator[Metric]:
        label = ["host"]
        used = GaugeMetricFamily("seer:kv_pool_used_blocks", "Blocks of a host's KV pool holding KV.", labels=label)
        capacity = GaugeMetricFamily("seer:kv_pool_capacity_blocks", "Blocks of a host's KV pool.", labels=label)
        used_bytes = GaugeMetricFamily("seer:kv_pool_used_bytes", "Bytes of a host's KV pool holding KV.",
                                       labels=label)
        capacity_bytes = GaugeMetricFamily("seer:kv_pool_capacity_bytes", "Bytes of a host's KV pool.",
                                           labels=label)
        block_bytes = self._block_bytes()
        for host_id, pool in sorted(self.scheduler.kv.pools.items()):
            key = [host_id if host_id != LOCAL_HOST else "local"]
            allocator = pool.allocator
            used.add_metric(key, allocator.num_used)
            capacity.add_metric(key, allocator.num_blocks)
            if (size := block_bytes.get(pool.fingerprint)) is not None:
                used_bytes.add_metric(key, allocator.num_used * size)
                capacity_bytes.add_metric(key, allocator.num_blocks * size)
        yield from (used, capacity, used_bytes, capacity_bytes)

    def _block_bytes(self) -> dict[str, int]:
        """Bytes of one pool block by geometry fingerprint, from the engines' hellos (a pool
        knows its fingerprint; the engines that use it know the geometry behind it)."""
        out = {}
        for view in self.engines.engines.values():
            geometry = view.capabilities.kv_geometry if view.capabilities is not None else None
            if geometry is not None:
                out[geometry.fingerprint] = geometry.bytes_per_block
        return out
