"""Running the disk tier's spills and stages for the server, in order, off the event loop.

Owns the one thread that moves blocks between the host pool and its disk tier file
(``dataplane/kvdisk.py``) and the ordering rule that keeps it safe: the server calls
``flush()`` before it sends anything, which hands every op the core decided so far
(``HostPoolTable.take_disk_ops``) to the thread and waits until all of them -- and all
handed over earlier -- have run. A chunk therefore never goes out before the spill that
freed its blocks or the stage that filled them, and the event loop keeps serving
heartbeats meanwhile. Then it asks the core for the prefetch (``take_prefetch_ops``:
decided from the queues as the sends about to go leave them) and hands those ops over
*without* waiting: they run while the engines compute, and only a later send waits for
whatever of them is still running. Each op's outcome goes back to the core (``disk_op_done``) and to
the log: ``kv_disk_spilled`` / ``kv_disk_staged`` (blocks, bytes, ms, ``prefetch``),
``kv_disk_spill_failed`` / ``kv_disk_stage_failed`` (the reason; the request re-prefills).
The time a send waited for ops is ``kv_disk_waited`` (``ms``): KV load time left on the
critical path of the chunks in that send.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import structlog

from seer.controlplane.kvpool.table import HostPoolTable
from seer.controlplane.kvpool.tiers import DiskOp, Spill
from seer.dataplane.kvdisk import DiskTier, DiskTierError
from seer.dataplane.kvpool import KVPoolSegment

log = structlog.get_logger()


class DiskRunner:
    def __init__(self, table: HostPoolTable) -> None:
        self.table = table
        self.tier: DiskTier | None = None
        self.segment: KVPoolSegment | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._last: asyncio.Future | None = None
        self.wait_ms = 0.0  # total time sends waited for ops (critical path)

    def attach(self, tier: DiskTier, segment: KVPoolSegment) -> None:
        self.tier, self.segment = tier, segment
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="seer-kvdisk")

    def _run(self, ops: list[DiskOp]) -> list[tuple[DiskOp, int, float, str]]:
        out = []
        assert self.tier is not None and self.segment is not None
        for op in ops:
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
            out.append((op, ok, (time.perf_counter() - t0) * 1000.0, error))
        return out

    async def flush(self) -> float:
        """Run every op decided so far (after those already handed over), then start the
        prefetch in the background; ms waited."""
        if self._executor is None:
            self.table.take_disk_ops()  # no tier: nothing decided can be run (none are)
            return 0.0
        ops = self.table.take_disk_ops()
        t0 = time.perf_counter()
        if ops:
            future = self._last = asyncio.get_running_loop().run_in_executor(self._executor, self._run, ops)
            self._start_prefetch()
            for op, ok, ms, error in await future:
                self._report(op, ok, ms, error)
        else:
            last = self._last
            self._start_prefetch()
            if last is None or last.done():
                return 0.0
            await asyncio.shield(last)  # ops handed over earlier (a prefetch, a send in progress)
        waited = (time.perf_counter() - t0) * 1000.0
        self.wait_ms += waited
        return waited

    def _start_prefetch(self) -> None:
        """Hand the prefetch the core decides now to the thread, after what is there."""
        ahead = self.table.take_prefetch_ops()
        if not ahead:
            return
        future = self._last = asyncio.get_running_loop().run_in_executor(self._executor, self._run, ahead)
        future.add_done_callback(self._prefetched)

    def _prefetched(self, future: asyncio.Future) -> None:
        if future.cancelled():
            return
        if (exc := future.exception()) is not None:
            log.error("kv_disk_prefetch_failed", error=f"{type(exc).__name__}: {exc}", exc_info=exc,
                      effect="the prefetched requests' chunks re-prefill what their KV lacks")
            return
        for op, ok, ms, error in future.result():
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
