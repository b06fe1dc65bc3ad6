"""Faults under a running real-vLLM daemon with the host KV pool on: a pool block
failing its check, the pool segment unlinked, an engine SIGKILLed mid-rollout.

These tests are destructive (the last one kills an engine), so they run on their own
daemon (two vLLM engines, float32 SmolLM2, chunks of 8 tokens so chunks are always in
flight), never on the session's shared one. They run in file order: the kill comes
last. Generations are 40 tokens, compared with vLLM's one-shot ``LLM.generate``.
"""

from __future__ import annotations

import json
import os
import signal
import threading
from pathlib import Path

import pytest

from seer.client import SamplingParams, SeerClient
from seer.dataplane.kvpool import STATE_VALID, KVPoolSegment
from tests.daemon_helpers import Daemon, seerctl, wait_for
from tests.engine.conftest import vllm_config

pytestmark = pytest.mark.engine

MAX_TOKENS = 40
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)


@pytest.fixture(scope="module")
def fault_daemon(tmp_path_factory: pytest.TempPathFactory, all_references):
    """Own daemon; depends on the references so vLLM's reference run is over before
    these engines start."""
    root = tmp_path_factory.mktemp("vllm-fault")
    config = root / "seer.toml"
    vllm_config(config, extra="""
[scheduler]
policy = "divided"
chunk_size_tokens = 8
# Place by load, not by cached prefix: chunks move between the engines now and then, so
# migrations (and pool loads) happen without forcing every chunk to move -- after the
# kill, the moved requests must find their prefix in the pool, not in the survivor's cache.
imbalance_threshold = 0

[kv_pool]
pool_gib = 0.25
min_load_tokens = 1
""")
    daemon = Daemon(root / "run", config)
    daemon.start()
    yield daemon
    daemon.stop()


def _log(run_dir: Path) -> list[dict]:
    # Read while the daemon writes: the last line may be half written (no newline yet).
    complete = (run_dir / "controlplane.log").read_text().rpartition("\n")[0]
    return [json.loads(line) for line in complete.splitlines() if line.strip()]


def _since(events: list[dict], rollout_id: str) -> list[dict]:
    """Events from the rollout's acceptance on (the daemon runs one rollout at a time here)."""
    start = next(i for i, e in enumerate(events)
                 if e.get("event") == "rollout_accepted" and e.get("rollout_id") == rollout_id)
    return events[start:]


def _pool_name(run_dir: Path) -> str:
    return next(e["name"] for e in _log(run_dir) if e.get("event") == "kv_pool_created")


def _check_against_reference(result, references: list[dict]) -> None:
    assert len(result.groups) == len(references)
    for group, ref in zip(result.groups, references):
        (sample,) = group.samples  # exactly once
        assert sample.token_ids == ref["token_ids"][:MAX_TOKENS], f"prompt {group.group_index}"


def _rows(prompts: list[list[int]]) -> list[dict]:
    return [{"prompt_token_ids": p} for p in prompts]


def test_blocks_failing_their_check_fall_back_to_reprefill(fault_daemon, migration_prompts, migration_reference):
    """While rollouts run, a thread keeps breaking the stored checksum of every valid
    pool block: a migrated chunk whose blocks fail their check recomputes its prefix
    (kv_load_fell_back in the log) and every sample still equals one-shot
    LLM.generate token for token."""
    segment = KVPoolSegment.attach(_pool_name(fault_daemon.run_dir))
    stop = threading.Event()

    def corrupt() -> None:
        while not stop.is_set():
            valid = segment.tags["state"] == STATE_VALID
            segment.tags["checksum"][valid] ^= 0x5A5A  # the bytes stay; only their check fails
            stop.wait(0.002)

    thread = threading.Thread(target=corrupt, daemon=True)
    thread.start()
    fell_back: list[dict] = []
    try:
        with SeerClient(fault_daemon.address, timeout_s=300) as client:
            # Placement is by load, so whether a chunk moves is up to the schedule: run
            # until one did and had its load refused (bounded), checking tokens each time.
            for _ in range(4):
                result = client.rollout(_rows(migration_prompts), 1, GREEDY)
                _check_against_reference(result, migration_reference)
                events = _since(_log(fault_daemon.run_dir), result.rollout_id)
                fell_back += [e for e in events if e.get("event") == "kv_load_fell_back"]
                if fell_back:
                    break
    finally:
        stop.set()
        thread.join(10)
        segment.close()
    assert fell_back, "no migrated chunk tried to load a corrupted block"
    assert all(e["failed_tokens"] > 0 for e in fell_back), fell_back


def test_an_unlinked_pool_segment_costs_nothing_mapped_engines_keep_using_it(fault_daemon, migration_prompts,
                                                                            migration_reference):
    """The pool's /dev/shm name is removed under the running daemon: engines and the
    control plane keep the mapping they have (POSIX shared memory lives until the last
    unmap), so rollouts stay token-identical to LLM.generate and the daemon stops
    cleanly without the name (its unlink tolerates a missing file)."""
    name = _pool_name(fault_daemon.run_dir)
    os.unlink(f"/dev/shm/{name}")
    with SeerClient(fault_daemon.address, timeout_s=300) as client:
        result = client.rollout(_rows(migration_prompts), 1, GREEDY)
    _check_against_reference(result, migration_reference)
    assert not Path(f"/dev/shm/{name}").exists()


def _continuations_in_flight(events: list[dict], engine_id: int) -> int:
    """Chunks in flight on the engine that continue a sample whose prefix KV is in the pool."""
    dispatched = {e["task_id"] for e in events if e.get("event") == "chunk_dispatched"
                  and e["engine_id"] == engine_id and e["kv_valid_tokens"] > 0}
    finished = {e["task_id"] for e in events if e.get("event") == "chunk_finished" and e["engine_id"] == engine_id}
    return len(dispatched - finished)


def test_an_engine_sigkilled_mid_rollout_loses_no_sample(fault_daemon, chat_prompts, reference_outputs):
    """Engine 1 (with its vLLM helpers) is SIGKILLed while it holds in-flight chunks:
    the control plane declares it lost, re-dispatches its chunks to engine 0 from their
    last completed chunk -- loading their prefix's KV from the host pool -- every sample
    comes back exactly once, token-identical to LLM.generate, and `seerctl status`
    shows engine 1 lost."""
    victim = 1
    outcome: dict = {}
    with SeerClient(fault_daemon.address, timeout_s=300) as client:
        pid = next(e.pid for e in client.status().engines if e.engine_id == victim)

        def run() -> None:
            with SeerClient(fault_daemon.address, timeout_s=300) as c:
                outcome["result"] = c.rollout(_rows(chat_prompts), 1, GREEDY)

        thread = threading.Thread(target=run)
        num_lines = len(_log(fault_daemon.run_dir))
        thread.start()

        wait_for(lambda: _continuations_in_flight(_log(fault_daemon.run_dir)[num_lines:], victim) > 0, 120,
                 "engine 1 to run a chunk continuing from the pool", interval_s=0.05)
        os.killpg(pid, signal.SIGKILL)
        thread.join(300)
        assert not thread.is_alive()
    result = outcome["result"]
    _check_against_reference(result, reference_outputs)

    events = _since(_log(fault_daemon.run_dir), result.rollout_id)
    (lost,) = [e for e in events if e.get("event") == "engine_lost"]
    assert lost["engine_id"] == victim and lost["num_requeued"] >= 1, lost
    after = events[events.index(lost):]
    moved = [e for e in after if e.get("event") == "chunk_migrated" and e["from_engine_id"] == victim]
    assert len(moved) >= lost["num_requeued"], moved  # each requeued sample's next chunk moved
    assert all(e["to_engine_id"] == 0 for e in moved), moved
    # KV from the pool where it exists: these prompts are new to both engines (the tests
    # above used others), so the survivor's prefix cache cannot hold what the victim made.
    assert [e for e in moved if e["mode"] == "pool" and e["kv_loaded_tokens"] > 0], moved
    assert not [e for e in after if e.get("event") == "kv_load_fell_back"]

    status = seerctl("status", "--json", "--run-dir", str(fault_daemon.run_dir))
    assert status.returncode == 0, status.stderr
    states = {e["engine_id"]: e["state"] for e in json.loads(status.stdout)["engines"]}
    assert states == {0: "ready", 1: "lost"}
