"""The client against a daemon it cannot talk to ends in SeerTimeoutError, never a hang.

The peer here is a bare ROUTER with CURVE on (no daemon needed): a client without keys
connects, its handshakes are refused again and again, and its DEALER pipe comes and goes
with them. A rollout then has pending heartbeats when its reply times out; before the
fix in ``AsyncSeerClient._send_nowait`` pyzmq queued the rollout's final (NOBLOCK) cancel
behind the cancelled heartbeat's pending send, with no timeout, and the call never
returned (it hung in most runs, in the first or second attempt).
"""

from __future__ import annotations

import asyncio

import pytest
import zmq

from seer.client import AsyncSeerClient, SeerTimeoutError


@pytest.fixture
def curve_router():
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    public, secret = zmq.curve_keypair()
    sock.curve_server = True
    sock.curve_publickey = public
    sock.curve_secretkey = secret
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    yield f"tcp://127.0.0.1:{port}"
    sock.close(0)
    ctx.term()


async def _rollout_without_keys(address: str) -> SeerTimeoutError:
    async with AsyncSeerClient(address, timeout_s=2.0, heartbeat_interval_s=0.2) as client:
        with pytest.raises(SeerTimeoutError) as info:
            async for _ in client.stream_rollout(["hi"], group_size=1):
                pass
    return info.value


def test_rollout_against_a_refusing_curve_peer_times_out_every_time(curve_router):
    async def attempts() -> list[SeerTimeoutError]:
        # 30 s per attempt is far above the 2 s timeout; a hang fails instead of blocking CI.
        return [await asyncio.wait_for(_rollout_without_keys(curve_router), 30.0) for _ in range(4)]

    for error in asyncio.run(attempts()):
        text = str(error)
        assert curve_router in text and "CURVE keys" in text


def test_status_against_a_refusing_curve_peer_times_out(curve_router):
    async def status() -> None:
        async with AsyncSeerClient(curve_router, timeout_s=1.0) as client:
            await client.status()

    with pytest.raises(SeerTimeoutError, match="CURVE keys"):
        asyncio.run(asyncio.wait_for(status(), 30.0))
