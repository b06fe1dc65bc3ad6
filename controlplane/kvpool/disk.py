"""Running the disk tier's spills and stages for the server, in order, off the event loop.

Owns the one thread that moves blocks between the host pool and its disk tier file
(``dataplane/kvdisk.py``) and the ordering rule that keeps it safe. Before the server
sends anything it calls ``hand_over()``: every op the core decided so far
(``HostPoolTable.take_disk_ops``) goes to the thread, then the prefetch the core decides
now (``take_prefetch_ops``: from the queues as the sends about to go leave them). The
thread runs ops one at a time in the order they were decided, so an op never overtakes
one decided before it. The server does not wait for them as a whole: before each send it
awaits ``ready_for_chunk`` / ``ready_for_all``, which wait only for the ops that send depends on (and, by the
thread's order, everything handed over before them):

* a chunk whose KV descriptor is in this host's pool: the ops on its request's key or on
  any of its pool blocks -- the stage that fills them, the spill that must read a
  victim's bytes before the chunk loads or saves into blocks the victim gave up;
* a chunk without a KV descriptor, a message to a client: nothing;
* anything else (a chunk into another host's pool, a message to an agent, an engine or a
  peer): every op handed over, as before this rule.

So a chunk whose KV is already in DRAM goes out while the thread stages the next
requests' KV, and only the chunk that needs a prefetch still running waits for it. Each
op's outcome goes back to the core (``disk_op_done``) and to the log as soon as it ends:
``kv_disk_spilled`` / ``kv_disk_staged`` (blocks, bytes, ms, ``prefetch``),
``kv_disk_spill_failed`` / ``kv_disk_stage_failed`` (the reason; the request re-prefills).
The time sends waited for ops is ``kv_disk_waited`` (once per delivery): ``ms`` in all (KV
time left on the critical path of the chunks in that delivery), split into waits for a
chunk's own prefetched stage (``prefetched_ms``), for its own stage on the dispatch path
(``staged_ms``) and for anything else (``other_ms``: a spill out of its blocks, or ops ahead
of those on the thread; sends other than chunks wait for everything).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import structlog

from seer.controlplane.kvpool.table import HostPoolTable
from seer.controlplane.kvpool.tiers import DiskOp, Spill, Stage
from seer.dataplane.kvdisk import DiskTier, DiskTierError
from seer.dataplane.kvpool import KVPoolSegment
from seer.protocol import KVDescriptor, unpack_token_ids

log = structlog.get_logger()


class DiskRunner:
    def __init__(self, table: HostPoolTable) -> None:
        self.table = table
        self.tier: DiskTier | None = None
        self.segment: KVPoolSegment | None = None
        self._executor: ThreadPoolExecutor | None = None
        # Handed over and not yet reported, in the order the thread runs them.
        self._pending: deque[tuple[asyncio.Future, DiskOp, frozenset[int]]] = deque()

    def attach(self, tier: DiskTier, segment: KVPoolSegment) -> None:
        self.tier, self.segment = tier, segment
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="seer-kvdisk")

    def _run(self, op: DiskOp) -> tuple[int, float, str]:
        assert self.tier is not None and self.segment is not None
        t0 = time.perf_counter()
        error = ""
        try:
            if isinstance(op, Spill):
                self.tier.spill(self.segment, op.pool_blocks, op.slots, op.key, 0, op.epoch)
                ok = len(op.slots)
            else:
                ok = self.tier.stage(self.segment, op.slots, op.pool_blocks, op.key, 0, op.epoch)
                if ok < len(op.slots):
                    error = f"{len(op.slots) - ok} of {len(op.slots)} blocks failed their tag or checksum"
        except (DiskTierError, OSError) as exc:
            ok, error = 0, str(exc)
        return ok, (time.perf_counter() - t0) * 1000.0, error

    def hand_over(self) -> None:
        """Give the thread every op decided so far, then the prefetch decided now; wait for
        none of them (``ready_for_chunk`` / ``ready_for_all`` do, per send)."""
        if self._executor is None:
            self.table.take_disk_ops()  # no tier: nothing decided can be run (none are)
            return
        for op in self.table.take_disk_ops():
            self._submit(op)
        for op in self.table.take_prefetch_ops():
            self._submit(op)

    def _submit(self, op: DiskOp) -> None:
        future = asyncio.get_running_loop().run_in_executor(self._executor, self._run, op)
        # Added before anyone awaits it: the core hears the outcome before a waiting send goes.
        future.add_done_callback(partial(self._done, op))
        self._pending.append((future, op, frozenset(op.pool_blocks)))

    async def ready_for_chunk(self, kv: KVDescriptor | None) -> tuple[float, str]:
        """Wait for the ops a chunk with this KV descriptor depends on. Returns the ms waited
        and for what: ``"prefetched"`` (its own KV's stage, started ahead of its turn, had not
        finished), ``"staged"`` (its own KV staged on its dispatch path), ``"other"`` (a
        spill out of its blocks, ops before it on the thread, or -- for another host's pool --
        everything handed over); ``""`` when it waited for nothing."""
        if kv is None:
            return 0.0, ""
        if self.segment is None or kv.pool_name != self.segment.path.name:
            return await self.ready_for_all(), "other"  # another host's pool: no block-level reading
        blocks = set(unpack_token_ids(kv.pool_blocks))
        last = None
        why = "other"
        for future, op, op_blocks in reversed(self._pending):
            if op.key == kv.key and isinstance(op, Stage):
                why = "prefetched" if op.prefetch else "staged"
                last = last or future
                break
            if last is None and (op.key == kv.key or not op_blocks.isdisjoint(blocks)):
                last = future
        return (await self._wait(last), why) if last is not None else (0.0, "")

    async def ready_for_all(self) -> float:
        """Wait for every op handed over so far; ms waited."""
        return await self._wait(self._pending[-1][0]) if self._pending else 0.0

    async def _wait(self, future: asyncio.Future) -> float:
        if future.done():
            return 0.0
        t0 = time.perf_counter()
        # The thread runs every op handed over before it first. asyncio.wait neither raises
        # the op's error (``_done`` reports it) nor cancels the op if this send is cancelled.
        await asyncio.wait([future])
        return (time.perf_counter() - t0) * 1000.0

    def _done(self, op: DiskOp, future: asyncio.Future) -> None:
        for i, (f, _, _) in enumerate(self._pending):
            if f is future:
                del self._pending[i]
                break
        if future.cancelled():
            return
        if (exc := future.exception()) is not None:
            log.error("kv_disk_op_failed", key=op.key, error=f"{type(exc).__name__}: {exc}", exc_info=exc,
                      effect="the request's next chunk re-prefills what its KV lacks")
            self.table.disk_op_done(op, 0)
            return
        ok, ms, error = future.result()
        self._report(op, ok, ms, error)

    def _report(self, op: DiskOp, ok: int, ms: float, error: str) -> None:
        nbytes = len(op.slots) * (self.tier.bytes_per_block if self.tier else 0)
        spill = isinstance(op, Spill)
        if error:
            log.warning("kv_disk_spill_failed" if spill else "kv_disk_stage_failed", key=op.key,
                        num_blocks=len(op.slots), ok_blocks=ok, error=error,
                        effect="the request's next chunk re-prefills what its KV lacks")
        elif spill:
            log.info("kv_disk_spilled", key=op.key, num_blocks=len(op.slots), num_tokens=op.num_tokens,
                     num_bytes=nbytes, ms=round(ms, 3))
        else:
            log.info("kv_disk_staged", key=op.key, num_blocks=len(op.slots), num_tokens=op.num_tokens,
                     num_bytes=nbytes, ms=round(ms, 3), prefetch=op.prefetch)  # type: ignore[union-attr]
        self.table.disk_op_done(op, ok)

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        if self.tier is not None:
            self.tier.close()
            log.info("kv_disk_removed", path=str(self.tier.path))
            self.tier = None


__all__ = ["DiskRunner"]
