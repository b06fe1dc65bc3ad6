"""The disk tier's runner (controlplane/kvpool/disk.py): ops run one at a time in the order
they were decided, and a send waits only for the ops it depends on -- a chunk for the ops on
its key or its pool blocks, a client message for none, anything else for all.

The tier is a stand-in whose ops block until the test lets them go, so what waits and what
does not is decided by the runner's rule, not by timing.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from seer.controlplane.kvpool.disk import DiskRunner
from seer.controlplane.kvpool.tiers import DiskOp, Spill, Stage
from seer.protocol import KVDescriptor, pack_token_ids

POOL = "seer-pool-test"


class GatedTier:
    """Runs ops only when released; records the order they ran in."""

    bytes_per_block = 4096

    def __init__(self) -> None:
        self.gates: dict[int, threading.Event] = {}
        self.ran: list[int] = []
        self.fail_key: int | None = None
        self.path = Path("/nonexistent")

    def gate(self, key: int) -> threading.Event:
        return self.gates.setdefault(key, threading.Event())

    def _pass(self, key: int) -> None:
        assert self.gate(key).wait(10), f"op on key {key} never released"
        if key == self.fail_key:
            raise RuntimeError("boom")
        self.ran.append(key)

    def spill(self, segment, pool_blocks, slots, key, layer, epoch) -> None:
        self._pass(key)

    def stage(self, segment, slots, pool_blocks, key, layer, epoch) -> int:
        self._pass(key)
        return len(slots)

    def close(self) -> None:
        pass


class FakeSegment:
    path = Path(f"/dev/shm/{POOL}")


class FakeTable:
    def __init__(self) -> None:
        self.ops: list[DiskOp] = []
        self.prefetch: list[DiskOp] = []
        self.done: list[tuple[int, int]] = []

    def take_disk_ops(self) -> list[DiskOp]:
        ops, self.ops = self.ops, []
        return ops

    def take_prefetch_ops(self) -> list[DiskOp]:
        ops, self.prefetch = self.prefetch, []
        return ops

    def disk_op_done(self, op: DiskOp, ok: int) -> None:
        self.done.append((op.key, ok))


def stage(key: int, blocks: list[int], prefetch: bool = True) -> Stage:
    return Stage(key=key, slots=list(range(len(blocks))), pool_blocks=blocks, num_tokens=16 * len(blocks),
                 epoch=0, prefetch=prefetch)


def spill(key: int, blocks: list[int]) -> Spill:
    return Spill(key=key, pool_blocks=blocks, slots=list(range(len(blocks))), num_tokens=16 * len(blocks), epoch=0)


def kv(key: int, blocks: list[int], pool: str = POOL) -> KVDescriptor:
    return KVDescriptor(pool_name=pool, key=key, weights_version=0, pool_blocks=pack_token_ids(blocks),
                        valid_tokens=16 * len(blocks), save=True, min_load_tokens=1)


@pytest.fixture
def runner():
    table = FakeTable()
    runner = DiskRunner(table)  # type: ignore[arg-type]
    tier = GatedTier()
    runner.attach(tier, FakeSegment())  # type: ignore[arg-type]
    yield runner, table, tier
    for event in tier.gates.values():
        event.set()
    runner.close()


async def pending(coro) -> asyncio.Task:
    """Start ``coro`` and let it run until it blocks."""
    task = asyncio.ensure_future(coro)
    for _ in range(5):
        await asyncio.sleep(0)
    return task


def test_a_chunk_independent_of_a_running_prefetch_does_not_wait(runner):
    run, table, tier = runner

    async def main():
        table.prefetch = [stage(7, [4, 5])]
        run.hand_over()
        # Key 3's KV is in blocks 0-1: nothing pending touches them or its key.
        assert await asyncio.wait_for(run.ready_for_chunk(kv(3, [0, 1])), 5) == (0.0, "")
        assert await run.ready_for_chunk(None) == (0.0, "")  # no descriptor: no pool access at all
        assert table.done == []  # the prefetch still runs: it was never waited for
        tier.gate(7).set()
        await asyncio.wait_for(run.ready_for_all(), 5)
        assert table.done == [(7, 2)]

    asyncio.run(main())


@pytest.mark.parametrize("dep", ["blocks", "key"])
def test_a_chunk_waits_for_the_op_on_its_blocks_or_key_and_what_was_handed_over_before_it(runner, dep):
    run, table, tier = runner

    async def main():
        # A spill of key 1 must read blocks 2-3 before key 5's chunk loads or saves into them
        # (dep=blocks); a stage of key 5's own KV (dep=key) -- each behind a stage of key 9.
        table.ops = [stage(9, [6]), spill(1, [2, 3]) if dep == "blocks" else stage(5, [7], prefetch=False)]
        run.hand_over()
        waiter = await pending(run.ready_for_chunk(kv(5, [2, 3])))
        assert not waiter.done()
        tier.gate(9).set()
        await asyncio.sleep(0.05)
        assert not waiter.done()  # the op it depends on has not run
        tier.gate(1 if dep == "blocks" else 5).set()
        ms, why = await asyncio.wait_for(waiter, 5)
        assert ms > 0 and why == ("other" if dep == "blocks" else "staged")  # a victim's spill / its own stage
        # In the order decided, and the core heard each outcome before the chunk could go.
        assert tier.ran == [9, 1 if dep == "blocks" else 5]
        assert [key for key, _ in table.done] == tier.ran

    asyncio.run(main())


def test_another_pool_or_a_control_message_waits_for_everything(runner):
    run, table, tier = runner

    async def main():
        table.prefetch = [stage(7, [4])]
        run.hand_over()
        remote = await pending(run.ready_for_chunk(kv(3, [4], pool="seer-pool-other-host")))
        control = await pending(run.ready_for_all())
        assert not remote.done() and not control.done()
        tier.gate(7).set()
        await asyncio.wait_for(asyncio.gather(remote, control), 5)
        assert await run.ready_for_all() == 0.0  # nothing pending any more

    asyncio.run(main())


def test_an_op_that_raises_is_reported_as_failed_and_releases_its_waiters(runner):
    run, table, tier = runner

    async def main():
        tier.fail_key = 7
        table.prefetch = [stage(7, [4])]
        run.hand_over()
        waiter = await pending(run.ready_for_chunk(kv(7, [4])))
        with capture_logs() as logs:
            tier.gate(7).set()
            await asyncio.wait_for(asyncio.shield(waiter), 5)
        assert table.done == [(7, 0)]  # the core treats it as lost: the chunk re-prefills
        assert [e["event"] for e in logs] == ["kv_disk_op_failed"]
        assert "boom" in logs[0]["error"]

    asyncio.run(main())
