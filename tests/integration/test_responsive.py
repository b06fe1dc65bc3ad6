"""The control plane stays responsive under one maximum-size request (issue 14, defect 1):
a 100,000-prompt rollout completes on simulated engines while status keeps being
answered, no engine is lost, and a 30,000 x 64 request with a bad last prompt is refused
quickly without the daemon's memory ballooning."""

from __future__ import annotations

import asyncio
import json
import time

from benchmarks.load import memory_kib
from seer.client import AsyncSeerClient, SamplingParams, SeerClient, SeerError
from seer.protocol import Prompt
from tests.daemon_helpers import Daemon, write_sim_config

NUM_PROMPTS = 100_000  # server.max_prompts_per_rollout's default
STATUS_BOUND_S = 5.0  # generous: a loaded 2-core machine; the measured worst case is printed


async def _rollout_while_polling(address: str, prompts: list[Prompt], group_size: int) -> tuple[int, list[float]]:
    async with AsyncSeerClient(address, timeout_s=600) as roller, AsyncSeerClient(address, timeout_s=60) as poller:
        done = asyncio.Event()
        latencies: list[float] = []

        async def poll() -> None:
            while not done.is_set():
                start = time.monotonic()
                await asyncio.wait_for(poller.status(), STATUS_BOUND_S)
                latencies.append(time.monotonic() - start)
                await asyncio.sleep(0.1)

        polling = asyncio.create_task(poll())
        try:
            result = await roller.rollout(prompts, group_size, SamplingParams(max_tokens=1, ignore_eos=True))
        finally:
            done.set()
        await polling
        return sum(len(g.samples) for g in result.groups), latencies


def test_a_maximum_size_rollout_completes_while_status_is_answered(tmp_path):
    """100,000 prompts x G=1, max_tokens 1 on two sim engines (default timeouts):
    every sample comes back once, every status call during it answers within 5 s, and no
    engine is lost."""
    # The reproduction: default liveness timeouts (engines.heartbeat_timeout_s 30 s).
    config = write_sim_config(tmp_path / "sim.toml", server={"max_request_bytes": 64 * 1024 * 1024,
                                                             "client_timeout_s": 60.0},
                              heartbeat_timeout_s=30.0)
    daemon = Daemon(tmp_path / "run", config)
    daemon.start()
    try:
        prompts = [Prompt(prompt_token_ids=[5, 6, 7 + i % 200], id=f"p{i}") for i in range(NUM_PROMPTS)]
        num_samples, latencies = asyncio.run(_rollout_while_polling(daemon.address, prompts, 1))
        assert num_samples == NUM_PROMPTS
        assert latencies, "status was never polled"
        print(f"status calls: {len(latencies)}, worst {max(latencies) * 1000:.0f} ms")
    finally:
        daemon.stop()
    events = [json.loads(line) for line in (daemon.run_dir / "controlplane.log").read_text().splitlines()]
    assert not [e for e in events if e["event"] == "engine_lost"]
    stopped = next(e for e in events if e["event"] == "control_plane_stopped")
    print(f"worst loop stall: {stopped['max_loop_lag_ms']} ms")


def test_a_huge_request_with_a_bad_last_prompt_is_refused_fast_and_frees_nothing_it_never_took(tmp_path):
    """30,000 prompts x G=64 whose last prompt is out of vocabulary: bad_token_ids naming
    prompt 29999, the daemon's RSS grows by well under 1 GB, and the engines stay ready."""
    config = write_sim_config(tmp_path / "sim.toml", server={"max_request_bytes": 64 * 1024 * 1024,
                                                             "max_group_size": 64})
    daemon = Daemon(tmp_path / "run", config)
    info = daemon.start()
    try:
        prompts = [Prompt(prompt_token_ids=[5] * 20) for _ in range(29_999)] + [Prompt(prompt_token_ids=[5] * 19 + [99_999])]
        with SeerClient(daemon.address, timeout_s=120) as client:
            before = memory_kib(info["pid"])["VmRSS"]
            start = time.monotonic()
            try:
                client.rollout(prompts, 64, SamplingParams(max_tokens=1))
            except SeerError as exc:
                assert exc.code == "bad_token_ids" and "prompt 29999" in str(exc)
            else:
                raise AssertionError("the rollout was accepted")
            elapsed_s = time.monotonic() - start
            grown_mib = (memory_kib(info["pid"])["VmHWM"] - before) / 1024
            print(f"refused in {elapsed_s:.2f} s, peak RSS growth {grown_mib:.0f} MiB")
            assert grown_mib < 512
            assert [e.state for e in client.status().engines] == ["ready", "ready"]
    finally:
        daemon.stop()
