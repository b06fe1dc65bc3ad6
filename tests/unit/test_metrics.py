"""The control plane's Prometheus metrics (controlplane/metrics.py, metrics_state.py,
metrics_http.py), read back through prometheus_client's own exposition parser."""

from __future__ import annotations

import asyncio
import json
import re
import socket
from pathlib import Path

import msgspec
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from seer.config import MetricsConfig, SeerConfig
from seer.controlplane.kvpool.agents import Agents
from seer.controlplane.kvpool.segment import PoolSegmentOwner
from seer.controlplane.membership import Membership
from seer.controlplane.metrics import Metrics
from seer.controlplane.stats import tail_start_rank
from seer.controlplane.metrics_http import MetricsBindError, bind_metrics_socket, serve_metrics
from seer.controlplane.metrics_state import StateCollector
from seer.controlplane.outbox import ToClient
from seer.controlplane.registry import Registry
from seer.controlplane.scheduler import Dispatch, Scheduler
from seer.controlplane.sessions import ClientSessions
from seer.controlplane.tokenizer import ByteTokenizer
from seer.controlplane.weights import Weights
from seer.protocol import (
    PROTOCOL_VERSION,
    ChunkFinished,
    EngineCapabilities,
    EngineHello,
    EngineLoad,
    Prompt,
    RolloutCompleted,
    RolloutRequest,
    SamplingParams,
    pack_logprobs,
    pack_token_ids,
)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Plane:
    """The server's parts wired as ``ControlPlane.__init__`` wires them, without sockets."""

    def __init__(self, tmp_path, spec_method: str = "off", chunk_size_tokens: int = 512) -> None:
        config = SeerConfig()
        config = msgspec.structs.replace(config, scheduler=msgspec.structs.replace(
            config.scheduler, chunk_size_tokens=chunk_size_tokens))
        self.clock = clock = Clock()
        self.registry = Registry(config.engines.heartbeat_timeout_s)
        self.scheduler = Scheduler(config.scheduler, clock, registry=self.registry)
        self.weights = Weights()
        self.metrics = Metrics(clock, min_load_tokens=config.kv_pool.min_load_tokens)
        self.metrics.registry.register(StateCollector(self.metrics, self.registry, self.scheduler, self.weights,
                                                      spec_method, clock))
        self.agents = Agents(config.kv_pool, self.scheduler, clock, local_host_id="here")
        self.clients = ClientSessions(config, self.scheduler, self.registry, ByteTokenizer(), self.weights,
                                      clock=clock, metrics=self.metrics)
        self.membership = Membership(config, self.registry, self.scheduler, self.agents,
                                     PoolSegmentOwner(config.kv_pool, config), engine_address="ipc://x",
                                     run_dir=tmp_path, clock=clock)

    def add_engine(self, engine_id: int) -> None:
        caps = EngineCapabilities(backend="sim", model="m", dtype="float32", max_model_len=512, vocab_size=300,
                                  kv_capacity_tokens=100_000, block_size=16)
        hello = EngineHello(engine_id=engine_id, protocol_version=PROTOCOL_VERSION, pid=1000 + engine_id,
                            weights_version=0, capabilities=caps)
        assert self.membership.on_hello(f"engine-{engine_id}".encode(), hello, self.weights).admitted

    def dispatch(self) -> list[Dispatch]:
        sent = [d for d in self.scheduler.schedule() if isinstance(d, Dispatch)]
        for d in sent:
            self.metrics.chunk_dispatched(d)  # as ControlPlane._deliver
        return sent

    def finish(self, d: Dispatch, num_tokens: int, *, cached: int = 0, loaded: int = 0, elapsed_ms: float = 250.0,
               finish_reason: str = "length") -> list:
        msg = ChunkFinished(engine_id=d.engine_id, task_id=d.task.task_id,
                            token_ids=pack_token_ids([65] * num_tokens), logprobs=pack_logprobs([-0.5] * num_tokens),
                            finish_reason=finish_reason, num_prompt_tokens=len(d.task.prompt_token_ids) // 4,
                            num_cached_tokens=cached, elapsed_ms=elapsed_ms, kv_loaded_tokens=loaded)
        return self.clients.on_chunk_finished(msg)

    def scrape(self) -> dict[tuple[str, tuple], float]:
        """Every sample of the exposition text, parsed back by prometheus_client."""
        text = generate_latest(self.metrics.registry).decode()
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for family in text_string_to_metric_families(text) for s in family.samples}


def rollout(rollout_id: str, num_prompts: int, group_size: int, max_tokens: int) -> RolloutRequest:
    return RolloutRequest(call_id="c", rollout_id=rollout_id, group_size=group_size,
                          prompts=[Prompt(prompt_token_ids=[5, 6, 7, 8]) for _ in range(num_prompts)],
                          sampling=SamplingParams(max_tokens=max_tokens), policy="group")


def test_a_rollout_moves_the_counters_by_exactly_what_it_did(tmp_path):
    """Samples, tokens, chunks and the rollout itself are counted once each, by policy;
    the histograms saw every chunk and every sample's first chunk."""
    plane = Plane(tmp_path)
    plane.add_engine(0)
    plane.add_engine(1)
    plane.clients.on_request(b"client", rollout("r1", num_prompts=2, group_size=2, max_tokens=6))
    sent = plane.dispatch()
    assert len(sent) == 4
    plane.clock.now = 103.0
    out = []
    for i, d in enumerate(sent):
        out += plane.finish(d, 6 if i else 3, finish_reason="length" if i else "stop")
    assert any(isinstance(s.msg, RolloutCompleted) for s in out if isinstance(s, ToClient))
    m = plane.scrape()
    assert m[("seer:samples_total", (("finished_reason", "length"), ("policy", "group")))] == 3
    assert m[("seer:samples_total", (("finished_reason", "stop"), ("policy", "group")))] == 1
    assert m[("seer:generation_tokens_total", (("policy", "group"),))] == 3 + 6 * 3
    assert sum(v for (name, _), v in m.items() if name == "seer:chunks_dispatched_total") == 4
    assert sum(v for (name, _), v in m.items() if name == "seer:chunks_finished_total") == 4
    assert m[("seer:rollouts_completed_total", (("policy", "group"),))] == 1
    assert m[("seer:chunk_duration_seconds_count", ())] == 4
    assert m[("seer:chunk_duration_seconds_sum", ())] == pytest.approx(1.0)
    assert m[("seer:time_to_first_chunk_seconds_count", ())] == 4
    assert m[("seer:time_to_first_chunk_seconds_sum", ())] == pytest.approx(4 * 3.0)
    assert m[("seer:rollout_wall_time_seconds_count", ())] == 1
    assert m[("seer:num_rollouts_running", ())] == 0
    assert m[("seer:num_requests_running", ())] == 0
    assert not [k for k in m if k[0].startswith("seer:current_rollout")]  # a finished rollout has no series


def test_progress_and_tail_so_far_of_a_running_rollout(tmp_path):
    """While a rollout runs, its progress, elapsed time and tail time so far (from the
    finish of its 90 % sample, as stats.tail_time_s) are exported; running and waiting
    requests add up to the unfinished ones."""
    plane = Plane(tmp_path)
    plane.add_engine(0)
    plane.clients.on_request(b"client", rollout("r2", num_prompts=10, group_size=1, max_tokens=4))
    sent = plane.dispatch()
    key = (("policy", "group"), ("rollout_id", "r2"))
    assert tail_start_rank(10) == 9
    for i, d in enumerate(sent[:9]):
        plane.clock.now = 110.0 + i
        plane.finish(d, 4)
    plane.clock.now = 130.0
    m = plane.scrape()
    assert m[("seer:current_rollout_samples_done", key)] == 9
    assert m[("seer:current_rollout_progress_ratio", key)] == pytest.approx(0.9)
    assert m[("seer:current_rollout_elapsed_seconds", key)] == pytest.approx(30.0)
    assert m[("seer:current_rollout_tail_seconds", key)] == pytest.approx(130.0 - 118.0)
    assert m[("seer:current_rollout_generation_tokens", key)] == 36
    assert m[("seer:num_requests_running", ())] + m[("seer:num_requests_waiting", ())] == 1
    plane.clients.cancel("r2", "cancelled")
    m = plane.scrape()
    assert m[("seer:rollouts_aborted_total", (("reason", "cancelled"),))] == 1
    assert not [k for k in m if k[0].startswith("seer:current_rollout")]
    assert plane.metrics.tail_started_s == {}


def test_engine_load_preemptions_and_speculation_are_exported_per_engine(tmp_path):
    """The last heartbeat's load of each engine is exported with its id; vLLM's cumulative
    preemption and draft counts become counters; SD counters carry the method."""
    plane = Plane(tmp_path, spec_method="grouped")
    plane.add_engine(0)
    plane.add_engine(3)
    plane.registry.heard(3, 100.0, EngineLoad(num_running=5, num_waiting=2, kv_usage=0.25, num_preemptions=7,
                                              num_spec_drafts=10, num_spec_draft_tokens=40,
                                              num_spec_accepted_tokens=30))
    m = plane.scrape()
    e3 = (("engine_id", "3"),)
    assert m[("seer:engine_num_requests_running", e3)] == 5
    assert m[("seer:engine_num_requests_waiting", e3)] == 2
    assert m[("seer:engine_kv_cache_usage_perc", e3)] == 0.25
    assert m[("seer:engine_num_preemptions_total", e3)] == 7
    sd = (("engine_id", "3"), ("method", "grouped"))
    assert m[("seer:spec_decode_num_draft_tokens_total", sd)] == 40
    assert m[("seer:spec_decode_num_accepted_tokens_total", sd)] == 30
    assert m[("seer:spec_decode_num_drafts_total", sd)] == 10
    assert m[("seer:engine_up", e3)] == 1 and m[("seer:num_engines", (("state", "ready"),))] == 2
    assert m[("seer:weights_version", ())] == 0


def test_continued_chunks_count_pool_hits_misses_and_migrations(tmp_path):
    """A continued chunk that loaded its context from the pool is a hit; one that computed
    at least min_load_tokens again is a miss; one whose engine had it cached is neither."""
    plane = Plane(tmp_path, chunk_size_tokens=100)
    plane.add_engine(0)
    req = RolloutRequest(call_id="c", rollout_id="r3", group_size=1, prompts=[Prompt(prompt_token_ids=[5] * 40)],
                         sampling=SamplingParams(max_tokens=450), policy="divided")
    plane.clients.on_request(b"client", req)
    (first,) = plane.dispatch()
    plane.finish(first, 100)
    (second,) = plane.dispatch()
    plane.finish(second, 100, cached=130, loaded=0)  # the engine's own cache: neither
    (third,) = plane.dispatch()
    plane.finish(third, 100, cached=0, loaded=0)  # 240 context tokens computed again: a miss
    (fourth,) = plane.dispatch()
    plane.finish(fourth, 100, cached=320, loaded=320)  # from the pool: a hit
    m = plane.scrape()
    assert m[("seer:kv_pool_hits_total", ())] == 1
    assert m[("seer:kv_pool_misses_total", ())] == 1
    assert m[("seer:kv_pool_loads_total", ())] == 1
    assert m[("seer:kv_pool_loaded_tokens_total", ())] == 320
    assert m[("seer:time_to_first_chunk_seconds_count", ())] == 1  # only the first chunk
    assert m[("seer:prompt_tokens_total", (("policy", "divided"),))] == 40 + 140 + 240 + 340
    assert m[("seer:prompt_tokens_cached_total", (("policy", "divided"),))] == 130 + 320


def test_failures_losses_and_weight_updates(tmp_path):
    """Failed chunks are counted by reason; a weights update's duration is observed once."""
    plane = Plane(tmp_path)
    plane.metrics.chunk_failed("failed")
    plane.metrics.chunk_failed("engine_lost", 3)
    plane.metrics.chunk_failed("engine_lost", 0)
    plane.metrics.engine_lost()
    plane.metrics.weights_update_started()
    plane.clock.now += 2.5
    plane.metrics.weights_update_finished(ok=True)
    m = plane.scrape()
    assert m[("seer:chunks_failed_total", (("reason", "failed"),))] == 1
    assert m[("seer:chunks_failed_total", (("reason", "engine_lost"),))] == 3
    assert m[("seer:engines_lost_total", ())] == 1
    assert m[("seer:weight_updates_total", (("outcome", "ok"),))] == 1
    assert m[("seer:weight_update_duration_seconds_sum", ())] == pytest.approx(2.5)


def test_two_planes_do_not_share_numbers(tmp_path):
    """Each control plane owns its registry: nothing goes to prometheus_client's global one."""
    a, b = Plane(tmp_path), Plane(tmp_path)
    a.metrics.engine_lost()
    assert a.scrape()[("seer:engines_lost_total", ())] == 1
    assert b.scrape()[("seer:engines_lost_total", ())] == 0


def test_the_endpoint_serves_the_registry_and_a_taken_port_is_one_clear_error(tmp_path):
    """GET /metrics answers the exposition text; binding a port in use raises a message that
    names the port and the fix."""
    plane = Plane(tmp_path)
    plane.metrics.engine_lost()
    sock = bind_metrics_socket(MetricsConfig(enabled=True, host="127.0.0.1", port=0))
    port = sock.getsockname()[1]
    with pytest.raises(MetricsBindError, match=rf"127\.0\.0\.1:{port}: .*metrics\.port"):
        bind_metrics_socket(MetricsConfig(enabled=True, host="127.0.0.1", port=port))

    async def get(path: str) -> bytes:
        server = asyncio.create_task(serve_metrics(sock, plane.metrics.registry))
        await asyncio.sleep(0.05)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        body = await asyncio.wait_for(reader.read(), 30)
        writer.close()
        server.cancel()
        await asyncio.gather(server, return_exceptions=True)
        return body

    reply = asyncio.run(get("/metrics"))
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and b"Content-Type: text/plain" in head
    samples = {s.name: s.value for f in text_string_to_metric_families(body.decode()) for s in f.samples}
    assert samples["seer:engines_lost_total"] == 1
    with socket.socket() as probe:  # the listening socket is closed with the server
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # the scrape's TIME_WAIT is no listener
        probe.bind(("127.0.0.1", port))


REPO = Path(__file__).resolve().parents[2]


def exported_names(plane: Plane) -> set[str]:
    """Every series name the daemon can export (counters with ``_total``, histograms with
    ``_bucket``/``_sum``/``_count``), whether or not it has a sample yet."""
    names = set()
    for family in plane.metrics.registry.collect():
        suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}.get(family.type, ("",))
        names.update(family.name + s for s in suffixes)
    return names


def dashboard_exprs() -> list[str]:
    dashboard = json.loads((REPO / "docs" / "grafana" / "seer-rollout.json").read_text())
    return [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]


def test_the_grafana_dashboard_queries_only_exported_metrics(tmp_path):
    """docs/grafana/seer-rollout.json is valid JSON, and every metric its queries name is
    one the daemon exports."""
    names = exported_names(Plane(tmp_path))
    exprs = dashboard_exprs()
    assert len(exprs) >= 20
    for expr in exprs:
        used = set(re.findall(r"seer:[A-Za-z0-9_:]+", expr))
        assert used and used <= names, (expr, used - names)


def test_the_operations_doc_describes_every_metric(tmp_path):
    """docs/operations.md names every metric family the daemon exports."""
    doc = (REPO / "docs" / "operations.md").read_text()
    for family in Plane(tmp_path).metrics.registry.collect():
        shown = family.name + ("_total" if family.type == "counter" else "")
        assert f"`{shown}`" in doc, shown


class SpeculatingBackend:
    """Only what ``EngineWorker.load`` reads: the load and vLLM's cumulative SD counters."""

    def load(self) -> EngineLoad:
        return EngineLoad(num_running=2, num_waiting=1, kv_usage=0.5, num_preemptions=4)

    def spec_counts(self) -> tuple[int, int, int]:
        return (10, 40, 12)


def test_an_engine_heartbeat_carries_its_speculation_counts():
    """The load an engine sends in each heartbeat holds vLLM's cumulative drafting steps,
    draft tokens and accepted tokens next to its running/waiting/KV/preemption numbers."""
    from seer.engines.worker import EngineWorker

    worker = EngineWorker(3, "ipc:///nonexistent", SeerConfig(), SpeculatingBackend())  # type: ignore[arg-type]
    assert worker.load() == EngineLoad(num_running=2, num_waiting=1, kv_usage=0.5, num_preemptions=4,
                                       num_spec_drafts=10, num_spec_draft_tokens=40, num_spec_accepted_tokens=12)


def test_finished_samples_do_not_walk_the_rollout_each_time(tmp_path, monkeypatch):
    """The tail-start rank is computed once per rollout, not per finished sample:
    ``Rollout.num_samples`` walks every group, and walking it per sample made a
    100,000-sample rollout quadratic (over 10 minutes of control-plane CPU)."""
    from seer.controlplane.state import Rollout

    walks = []
    original = Rollout.num_samples

    def counting(self):
        walks.append(self.rollout_id)
        return original.fget(self)

    monkeypatch.setattr(Rollout, "num_samples", property(counting))
    plane = Plane(tmp_path)
    plane.add_engine(0)
    plane.clients.on_request(b"client", rollout("big", num_prompts=200, group_size=1, max_tokens=4))
    walks.clear()  # intake may count the samples once
    sent = plane.dispatch()
    assert len(sent) == 200
    for i, d in enumerate(sent):
        plane.clock.now = 110.0 + i
        plane.finish(d, 4)
    assert len(walks) <= 3, f"num_samples walked {len(walks)} times for 200 finished samples"
    assert plane.metrics.tail_started_s == {}  # the rollout completed: nothing kept
