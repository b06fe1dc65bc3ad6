"""The control plane moves KV between hosts' pools (controlplane/kvpool/agents.py + table.py
through the real server, real sockets and real /dev/shm segments).

Two "hosts" on this machine: the control plane's own (its pool created by kvpool/segment.py at the
first engine hello) and "host-b" (a segment the test creates). One engine and one agent
per host are same-host fakes (tests/fake_hosts.py): the engines keep the pool contract of
the vLLM connector and check that every loaded block holds exactly the KV its tokens
imply; the agents copy blocks between the two segments with kvpool's tag checks.
``placement = "migrate"`` moves every chunk to the other host.
"""

from __future__ import annotations

import asyncio
import secrets
import threading
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from seer.client import SamplingParams, SeerClient
from seer.config import config_from_dict
from seer.controlplane.kvpool import segment as pool_module
from seer.controlplane.server import ControlPlane
from seer.controlplane.tokenizer import ByteTokenizer
from seer.dataplane.kvpool import KVPoolSegment
from tests.daemon_helpers import wait_for
from tests.fake_hosts import GEOM, FakeAgent, FakeKVEngine, reference

HOST_B = "host-b"


class Running:
    def __init__(self, tmp_path: Path, scheduler: dict | None = None, **kv_pool) -> None:
        config = config_from_dict({
            "engines": {"backend": "vllm", "count": 1, "heartbeat_timeout_s": 60.0},
            "scheduler": {"policy": "divided", "chunk_size_tokens": 16, "placement": "migrate",
                          "kv_admission_fraction": 1.0, **(scheduler or {})},
            "kv_pool": {"pool_gib": 0.01, **kv_pool},
            "server": {"client_timeout_s": 60.0},
        })
        run_dir = tmp_path / "run"
        run_dir.mkdir()
        self.cp = ControlPlane(config, client_address=f"ipc://{run_dir}/client.sock",
                               engine_address=f"ipc://{run_dir}/engine.sock", tokenizer=ByteTokenizer(),
                               run_dir=run_dir)
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)

    def _serve(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.loop.run_until_complete(self.cp.serve(on_ready=self._ready.set))

    def __enter__(self) -> Running:
        self._thread.start()
        assert self._ready.wait(30)
        return self

    def __exit__(self, *exc: object) -> None:
        self.loop.call_soon_threadsafe(self.cp.stop)
        self._thread.join(30)


@pytest.fixture
def hosts(tmp_path, monkeypatch):
    """Control plane + an engine and an agent on each of two hosts; yields (running, agents, engines)."""
    monkeypatch.setattr(pool_module, "agent_available", lambda: False)  # the fake is this host's agent

    def start(fail_b: bool = False, silent_b: bool = False, scheduler: dict | None = None, **kv_pool):
        running = Running(tmp_path, scheduler, **kv_pool).__enter__()
        started.append(running)
        address = running.cp.engine_address
        local = FakeKVEngine(address, host_id="").start()
        wait_for(lambda: running.cp.scheduler.pool is not None, 30, "the control plane's pool")
        local_seg = KVPoolSegment.attach(running.cp.scheduler.pool.name)
        segments.append(local_seg)
        seg_b = KVPoolSegment.create(f"seer-kv-test-{secrets.token_hex(4)}", GEOM, 256, prefault=False)
        segments.append(seg_b)
        owned.append(seg_b)
        agents = [FakeAgent(address, running.cp.agents.local_host_id, local_seg).start(),
                  FakeAgent(address, HOST_B, seg_b, fail=fail_b, silent=silent_b).start()]
        engines = [local, FakeKVEngine(address, host_id=HOST_B).start()]
        fakes.extend(agents + engines)
        wait_for(lambda: len(running.cp.agents.by_host) == 2 and len(running.cp.scheduler.live_engines()) == 2,
                 30, "two agents and two engines")
        return running, agents, engines

    started: list[Running] = []
    segments: list[KVPoolSegment] = []
    owned: list[KVPoolSegment] = []
    fakes: list = []
    yield start
    for fake in fakes:
        fake.stop()
    for running in started:
        running.__exit__()
    for seg in segments:
        seg.close()
    for seg in owned:
        seg.unlink()


def _rollout(running: Running, prompts: list[str], max_tokens: int = 64):
    with SeerClient(running.cp.client_address, timeout_s=60) as client:
        return client.rollout(prompts, group_size=2, sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                                             ignore_eos=True), timeout_s=60)


def _check_samples(result, prompts: list[str], max_tokens: int) -> None:
    tok = ByteTokenizer()
    assert len(result.groups) == len(prompts)
    for group in result.groups:
        expected = reference(tok.encode(prompts[group.group_index]), max_tokens)
        assert [s.sample_index for s in group.samples] == [0, 1]
        for sample in group.samples:
            assert sample.token_ids == expected


def test_chunks_that_move_to_another_host_load_kv_the_agents_moved(hosts):
    """Every chunk after the first runs on the other host; its KV is pulled into that host's
    pool first (kv_transferred), the engine finds exactly its tokens' KV there, the samples
    equal the unchunked reference and every pool block is free at the end."""
    with capture_logs() as logs:
        running, agents, engines = hosts()
        prompts = ["alpha", "beta beta"]
        result = _rollout(running, prompts)
    _check_samples(result, prompts, 64)
    assert not [e for e in engines if e.errors], [e.errors for e in engines]
    moved = [e for e in logs if e["event"] == "kv_transferred"]
    # 4 samples x 4 chunks of 16: 3 moves each, every one through a transfer
    assert len(moved) == 12
    assert {(e["from_host"], e["to_host"]) for e in moved} == {
        (running.cp.agents.local_host_id, HOST_B), (HOST_B, running.cp.agents.local_host_id)}
    assert all(e["num_bytes"] == e["num_blocks"] * GEOM.bytes_per_block > 0 and e["transport"] == "tcp"
               for e in moved)
    assert sum(a.num_pulls for a in agents) == 12
    assert engines[0].loaded_tokens > 0 and engines[1].loaded_tokens > 0
    assert not [e for e in logs if e["event"] in ("kv_transfer_failed", "kv_transfer_timed_out")]
    wait_for(lambda: all(p.allocator.num_used == 0 for p in running.cp.scheduler.kv.pools.values()), 10,
             "every block back")


def test_kv_of_chunks_held_for_a_busy_engine_on_another_host_moves_ahead(hosts):
    """One chunk in flight per engine: requests placed on a busy engine wait there, and the
    KV of those placed on the other host is pulled while they wait (kv_transferred with
    ahead), not when their chunk goes. Samples stay exact and every block comes back."""
    with capture_logs() as logs:
        running, agents, engines = hosts(scheduler={"max_chunks_per_engine": 1}, transfer_prefetch=True)
        prompts = ["alpha", "beta beta", "gamma gamma gamma", "delta"]
        result = _rollout(running, prompts)
    _check_samples(result, prompts, 64)
    assert not [e for e in engines if e.errors], [e.errors for e in engines]
    moved = [e for e in logs if e["event"] == "kv_transferred"]
    ahead = [e for e in moved if e["ahead"]]
    assert ahead, "no KV moved ahead of its chunk"
    assert running.cp.scheduler.kv.num_transfers_ahead == len(
        [e for e in logs if e["event"].startswith("kv_transfer") and e.get("ahead")])
    assert all(e["chunk_waited_ms"] >= 0 for e in moved)
    assert not [e for e in logs if e["event"] in ("kv_transfer_failed", "kv_transfer_timed_out")]
    wait_for(lambda: all(p.allocator.num_used == 0 for p in running.cp.scheduler.kv.pools.values()), 10,
             "every block back")


def test_failed_pulls_fall_back_to_re_prefill_and_lose_nothing(hosts):
    """Host B's agent fails every pull: chunks moving to B re-prefill (kv_transfer_failed),
    chunks moving back to A still load what B saved, and every sample is exact."""
    with capture_logs() as logs:
        running, agents, engines = hosts(fail_b=True)
        prompts = ["gamma"]
        result = _rollout(running, prompts)
    _check_samples(result, prompts, 64)
    assert not [e for e in engines if e.errors], [e.errors for e in engines]
    failed = [e for e in logs if e["event"] == "kv_transfer_failed"]
    moved = [e for e in logs if e["event"] == "kv_transferred"]
    assert failed and all(e["to_host"] == HOST_B for e in failed)
    assert moved and all(e["to_host"] == running.cp.agents.local_host_id for e in moved)
    assert engines[1].loaded_tokens == 0  # B never got KV from elsewhere
    wait_for(lambda: all(p.allocator.num_used == 0 for p in running.cp.scheduler.kv.pools.values()), 10,
             "every block back")


def test_an_agent_that_never_answers_costs_one_timeout_then_its_host_re_prefills(hosts):
    """Host B's agent swallows pulls: the first ones time out (kv_transfer_timed_out), their
    chunks re-prefill, B's agent is taken as lost (kv_agent_lost) and later chunks move to B
    without transfers; every sample is exact."""
    with capture_logs() as logs:
        running, agents, engines = hosts(silent_b=True, transfer_timeout_s=1.0)
        prompts = ["delta"]
        result = _rollout(running, prompts)
    _check_samples(result, prompts, 64)
    assert not [e for e in engines if e.errors], [e.errors for e in engines]
    # The pulls sent before the first timeout (one per sample at most) all time out; none after.
    assert 1 <= agents[1].num_pulls <= 2
    assert len([e for e in logs if e["event"] == "kv_transfer_timed_out"]) == agents[1].num_pulls
    (lost,) = [e for e in logs if e["event"] == "kv_agent_lost"]
    assert lost["host_id"] == HOST_B and "unanswered" in lost["reason"]
    assert HOST_B not in running.cp.scheduler.kv.pools


def test_an_agent_with_another_transport_is_refused(hosts):
    """kv_pool.transport is "tcp"; an agent that says "ucx" is refused with a reason and its
    host gets no pool."""
    with capture_logs() as logs:
        running, _, _ = hosts()
        seg = KVPoolSegment.create(f"seer-kv-test-{secrets.token_hex(4)}", GEOM, 4, prefault=False)
        try:
            agent = FakeAgent(running.cp.engine_address, "host-c", seg, transport="ucx").start()
            wait_for(lambda: any(e["event"] == "kv_agent_rejected" for e in logs), 10, "the refusal")
            agent.stop()
        finally:
            seg.close()
            seg.unlink()
    (refusal,) = [e for e in logs if e["event"] == "kv_agent_rejected"]
    assert "ucx" in refusal["reason"] and "kv_pool.transport" in refusal["reason"]
    assert "host-c" not in running.cp.scheduler.kv.pools
