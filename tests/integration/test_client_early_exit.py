"""Leaving a rollout early cancels it on the daemon at once (not after client_lost).

The daemon's client timeout is 30 s and every rollout here needs about 10 s of engine
time, so a rollout that is not cancelled would still show in ``status`` long after the
few seconds each test waits for it to disappear."""

from __future__ import annotations

import asyncio

import pytest

from seer.client import AsyncSeerClient, SamplingParams, SeerClient, SeerServiceError
from tests.daemon_helpers import Daemon, wait_for, write_sim_config

# Geometric lengths (mean 64) capped at 400 tokens of 30 ms: among 48 prompts (G = 1)
# the first group finishes within a few steps, the last after about 12 s.
PROMPTS = [f"question {i}" for i in range(48)]
SAMPLING = SamplingParams(max_tokens=400)
CANCEL_WAIT_S = 3.0


@pytest.fixture(scope="module")
def slow_daemon(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("early-exit")
    daemon = Daemon(root / "run", write_sim_config(root / "sim.toml", server={"client_timeout_s": 30.0},
                                                   sim_step_s=0.03))
    daemon.start()
    yield daemon
    daemon.stop()


@pytest.fixture()
def daemon(slow_daemon):
    """The module's daemon once no rollout of an earlier test is left (each test starts clean)."""
    wait_for(lambda: _no_rollout(slow_daemon.address), 60, "rollouts of earlier tests to end")
    return slow_daemon


def _no_rollout(address: str) -> bool:
    with SeerClient(address, timeout_s=10) as client:
        return client.status().rollouts == []


def test_break_out_of_a_stream_cancels_the_rollout_while_the_client_stays_open(daemon):
    """`async for ...: break` with the client still open: the rollout leaves status within seconds."""

    async def go():
        async with AsyncSeerClient(daemon.address) as client:
            async for _group in client.stream_rollout(PROMPTS, 1, SAMPLING):
                break
            for _ in range(int(CANCEL_WAIT_S / 0.1)):
                if not (await client.status()).rollouts:
                    return True
                await asyncio.sleep(0.1)
            return False

    assert asyncio.run(go()), "the rollout was still running after the stream was left"


def test_break_then_closing_the_client_cancels_the_rollout(daemon):
    """`async with client: async for ...: break`: leaving the client cancels the abandoned rollout."""

    async def go():
        async with AsyncSeerClient(daemon.address) as client:
            async for _group in client.stream_rollout(PROMPTS, 1, SAMPLING):
                break

    asyncio.run(go())
    wait_for(lambda: _no_rollout(daemon.address), CANCEL_WAIT_S, "the rollout to be cancelled")


def test_an_exception_inside_the_stream_loop_cancels_the_rollout(daemon):
    """An exception raised in the body of `async for` cancels the rollout at once."""

    async def go():
        async with AsyncSeerClient(daemon.address) as client:
            with pytest.raises(RuntimeError, match="scoring failed"):
                async for _group in client.stream_rollout(PROMPTS, 1, SAMPLING):
                    raise RuntimeError("scoring failed")
            for _ in range(int(CANCEL_WAIT_S / 0.1)):
                if not (await client.status()).rollouts:
                    return True
                await asyncio.sleep(0.1)
            return False

    assert asyncio.run(go()), "the rollout was still running after the exception"


def test_an_on_group_exception_in_the_sync_client_cancels_the_rollout(daemon):
    """SeerClient.rollout with an on_group that raises: the error propagates and, with the
    client still open and idle, the rollout is gone from status within seconds."""

    def on_group(_group):
        raise ValueError("reward model down")

    with SeerClient(daemon.address) as client:
        with pytest.raises(ValueError, match="reward model down"):
            client.rollout(PROMPTS, 1, SAMPLING, on_group=on_group)
        # Polled from another client: this one's private loop stays idle, as in a trainer.
        wait_for(lambda: _no_rollout(daemon.address), CANCEL_WAIT_S, "the rollout to be cancelled")


def test_a_rollout_cancelled_by_another_client_ends_its_owners_call(daemon):
    """An operator cancels a running rollout from another client: the owner's stream ends at
    once with ``rollout_cancelled`` (it used to wait forever for groups that never came)."""

    async def go():
        async with AsyncSeerClient(daemon.address) as owner, AsyncSeerClient(daemon.address) as operator:
            groups = 0
            with pytest.raises(SeerServiceError) as ended:
                async for _group in owner.stream_rollout(PROMPTS, 1, SAMPLING, timeout_s=60):
                    groups += 1
                    if groups == 1:
                        await operator.cancel((await operator.status()).rollouts[0].rollout_id)
            assert ended.value.code == "rollout_cancelled"
            return groups

    assert asyncio.run(go()) < len(PROMPTS)
