"""Where every request's KV lives when each host has its own KV pool, and moving it.

Owns, for the pure scheduler core: the host pools (one ``PoolBinding`` per host: its
segment name, its allocator, its geometry fingerprint and, once the host's agent has
registered, how other hosts pull from it), which host each engine runs on, each
request's *home* (the one pool that holds its valid KV) and the transfers in flight.
No sockets, no clocks: the server carries transfers to agents and reports their end.

A chunk goes to an engine on host H:
* its KV is at home on H, or nowhere: as with one pool -- descriptor into H's pool,
  blocks grown for the chunk's save, home = H;
* its KV is at home on another host S: blocks for the valid tokens are allocated in H's
  pool and a ``Transfer`` (S's blocks -> H's blocks) is emitted; the chunk waits for it
  and is then dispatched with a descriptor into H's pool (S's blocks are released). A
  failed transfer (or one that times out) sends the chunk with re-prefill; a full
  destination pool sends it without a descriptor and leaves the KV at home on S.

Invariants: a key owns blocks in its home pool only, plus in the destination pool of
its one transfer in flight; ``request.kv_valid_tokens > 0`` only while it has a home or
its KV is in the local pool's disk tier (``tiers.py``: evicted by queue order when the
pool is full, staged back ahead of its turn -- decided when the server takes the ops,
``take_prefetch_ops`` -- or on its dispatch).
Blocks a pull may still write into are never handed to anyone else: a transfer given
up before its agent answered keeps its destination blocks under its (retired) key until
the answer comes, and the request continues under a fresh key.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from seer.controlplane.kvpool.tiers import DiskOp, DiskSlots, QueueOrder, Spill, Stage, pick_victims
from seer.controlplane.state import Request, RequestState
from seer.dataplane.kvpool import PoolAllocator
from seer.protocol import KVDescriptor, pack_token_ids

LOCAL_HOST = ""  # the control plane's own host (and every engine that does not say)


@dataclass(eq=False)
class PoolBinding:
    """One host's KV pool as the scheduler sees it."""

    name: str
    allocator: PoolAllocator
    fingerprint: str
    min_load_tokens: int
    host_id: str = LOCAL_HOST
    # Set once the host's agent registered: other hosts pull from ``address`` over
    # ``transport``, and the agent pulls into this pool. Empty: no transfers to or from it.
    transport: str = ""
    address: str = ""

    @property
    def has_agent(self) -> bool:
        return bool(self.transport)


@dataclass(eq=False)
class Transfer:
    """Copy the first ``num_tokens`` tokens of a request's KV from ``src`` to ``dst``."""

    transfer_id: int
    request: Request
    key: int
    src: PoolBinding
    dst: PoolBinding
    src_blocks: list[int]
    dst_blocks: list[int]
    num_tokens: int
    kv_epoch: int
    waiter: tuple[int, int, int] | None  # (task_id, engine_id, max_tokens) of the chunk waiting for it
    abandoned: bool = False  # given up: its result is ignored, its destination blocks freed when it ends
    ahead: bool = False  # started for a request placed but held, before any chunk waited for it
    chunk_waits_since_s: float | None = None  # when a chunk began to wait for it (the scheduler's clock)


@dataclass(frozen=True)
class KVPlan:
    kv: KVDescriptor | None
    pool_full: bool = False  # the pool had no room: the chunk runs without saving (or loading)
    transfer: Transfer | None = None  # the chunk waits for this transfer
    kv_lost: bool = False  # its KV was on disk and could not come back (pool and disk full): it re-prefills


PREFETCH_PER_ENGINE = 4  # default prefetch depth: this many waiting requests per engine
PREFETCH_POOL_SHARE = 0.5  # the prefetch window's KV fills at most this share of the pool (the rest: saves)
TRANSFER_AHEAD_FREE_SHARE = 0.25  # a move ahead leaves at least this share of the destination pool free


def _can_pull(src: PoolBinding, dst: PoolBinding) -> bool:
    """KV can move from ``src``'s pool to ``dst``'s: both hosts have an agent and the same block shape."""
    return src.has_agent and dst.has_agent and src.fingerprint == dst.fingerprint


class HostPoolTable:
    def __init__(self, policies: Mapping[str, object] | None = None) -> None:
        self.pools: dict[str, PoolBinding] = {}
        self.engine_hosts: dict[int, str] = {}
        self.num_live_engines = 0  # kept by the scheduler as engines join and are lost: the default prefetch depth
        self._homes: dict[int, tuple[PoolBinding, Request]] = {}  # key -> (its home pool, its request)
        self.transfers: dict[int, Transfer] = {}
        self._moving: dict[int, Transfer] = {}  # key -> its live (not abandoned) transfer
        self._new: list[Transfer] = []
        self._next_transfer_id = 1
        self._next_key = 1
        self.num_transfers = 0
        # Move a held request's KV to its engine's host before its chunk is released
        # (``move_ahead``; kv_pool.transfer_prefetch); how many moves started that way.
        self.transfer_ahead = False
        self.num_transfers_ahead = 0
        # The local pool's disk tier (None: off): key -> (request, slots, valid tokens).
        self.disk: DiskSlots | None = None
        self._on_disk: dict[int, tuple[Request, list[int], int]] = {}
        # When waiting requests will be needed: the policies' own queues (``policies``: the
        # scheduler's live map of them), return order for a policy that cannot tell.
        self.queue = QueueOrder(policies)
        self._disk_ops: list[DiskOp] = []
        self._epoch = 0
        self._prefetch_on = True
        self.prefetch_depth = 0  # 0: PREFETCH_PER_ENGINE per engine
        self.prefetch_pool_share = PREFETCH_POOL_SHARE
        self.disk_counts = {"spilled_blocks": 0, "staged_blocks": 0, "prefetched": 0, "staged_on_dispatch": 0,
                            "disk_full": 0, "failed": 0, "lost": 0}

    # ------------------------------------------------------------------ pools
    def add(self, pool: PoolBinding) -> list[Transfer]:
        """Register a host's pool. The same segment again (its agent registering) only
        updates how to reach it; another segment for a known host retires the old one
        (its KV is gone). Returns transfers that ended because of it (see ``remove``)."""
        old = self.pools.get(pool.host_id)
        if old is not None and old.name == pool.name:
            old.transport, old.address = pool.transport, pool.address
            return []
        ended = self.remove(pool.host_id) if old is not None else []
        self.pools[pool.host_id] = pool
        return ended

    def remove(self, host_id: str) -> list[Transfer]:
        """A host's pool is gone (its agent left, or a new segment replaced it): the KV at
        home there is lost, and transfers into it can never finish -- they end as failed
        (returned, so their waiting chunks can go with re-prefill)."""
        old = self.pools.pop(host_id, None)
        if old is None:
            return []
        for key, (home, request) in list(self._homes.items()):
            if home is old:
                del self._homes[key]
                request.kv_valid_tokens = 0
        ended = []
        for transfer in list(self.transfers.values()):
            if transfer.dst is old:
                self.finish(transfer.transfer_id, ok=False)
                ended.append(transfer)
        return ended

    def pool_of(self, engine_id: int) -> PoolBinding | None:
        return self.pools.get(self.engine_hosts.get(engine_id, LOCAL_HOST))

    def take_new_transfers(self) -> list[Transfer]:
        new, self._new = self._new, []
        return [t for t in new if not t.abandoned and self.transfers.get(t.transfer_id) is t]

    # ------------------------------------------------------------------ chunks
    def plan(self, request: Request, engine_id: int, fingerprint: str | None, context: int, max_tokens: int,
             continues: bool, epoch: int, task_id: int) -> KVPlan:
        """The KV side of dispatching a chunk of ``max_tokens`` to ``engine_id``."""
        self._epoch = epoch
        dst = self.pool_of(engine_id)
        if dst is None or fingerprint != dst.fingerprint:
            return KVPlan(None)
        moving = self._moving.get(request.kv_key) if request.kv_key else None
        if moving is not None:
            if moving.dst is dst:  # re-dispatched (engine lost) to the host its KV is moving to
                moving.waiter = (task_id, engine_id, max_tokens)
                return KVPlan(None, transfer=moving)
            return KVPlan(None)  # its KV is on its way elsewhere: re-prefill, touch nothing
        home = self._homes.get(request.kv_key, (None, None))[0] if request.kv_key else None
        if home is not None and home is not dst:
            if request.kv_valid_tokens > 0 and _can_pull(home, dst):
                return self._start_transfer(request, home, dst, epoch, (task_id, engine_id, max_tokens))
            self.drop(request)  # unusable from here: start afresh on this host
        return self._local(request, dst, context, max_tokens, continues, epoch)

    def _local(self, request: Request, dst: PoolBinding, context: int, max_tokens: int, continues: bool,
               epoch: int) -> KVPlan:
        lost = False
        if request.kv_key in self._on_disk:
            if not (self._disk_home(dst) and self._stage(request, dst, context + max_tokens - 1 if continues else 0,
                                                         prefetch=False)):
                # No DRAM for it and no disk room to make some: this chunk re-prefills.
                self._forget_disk(request.kv_key)
                request.kv_valid_tokens = 0
                lost = True
                self.disk_counts["lost"] += 1
        if not continues and request.kv_valid_tokens == 0:
            return KVPlan(None, kv_lost=lost)
        if not request.kv_key:
            request.kv_key = self._fresh_key()
        save = full = False
        if continues:
            # KV of every token but the chunk's last (which is sampled, never fed back).
            want = context + max_tokens - 1
            if not dst.allocator.can_reserve(request.kv_key, want) and self._disk_home(dst):
                self._make_room(dst, dst.allocator.blocks_for_tokens(want)
                                - len(dst.allocator.blocks_of(request.kv_key)), request.kv_key)
            save = dst.allocator.reserve(request.kv_key, want) is not None
            full = not save
        blocks = dst.allocator.blocks_of(request.kv_key)
        if blocks:
            self._homes[request.kv_key] = (dst, request)
        return KVPlan(KVDescriptor(pool_name=dst.name, key=request.kv_key, weights_version=epoch,
                                   pool_blocks=pack_token_ids(blocks), valid_tokens=request.kv_valid_tokens,
                                   save=save, min_load_tokens=dst.min_load_tokens), pool_full=full, kv_lost=lost)

    def move_ahead(self, request: Request, engine_id: int, fingerprint: str | None,
                   epoch: int) -> Transfer | None:
        """Prefetch across hosts: ``request`` is placed on ``engine_id`` and held until the
        engine has room. If its KV is at home on another host, start moving it to the
        engine's host now, with no chunk waiting; when the chunk is released, ``plan``
        makes it wait only for what is left of the move (nothing, if it ended). Only while
        the destination pool keeps at least ``TRANSFER_AHEAD_FREE_SHARE`` of its blocks
        free afterwards: the chunks in flight there must still find room to save. None:
        nothing moved."""
        key = request.kv_key
        dst = self.pool_of(engine_id)
        if not self.transfer_ahead or dst is None or fingerprint != dst.fingerprint or not key \
                or request.kv_valid_tokens <= 0 or key in self._moving:
            return None
        home = self._homes.get(key, (None, None))[0]
        if home is None or home is dst or not _can_pull(home, dst):
            return None
        need = dst.allocator.blocks_for_tokens(request.kv_valid_tokens)
        if dst.allocator.num_free - need < TRANSFER_AHEAD_FREE_SHARE * dst.allocator.num_blocks:
            return None
        transfer = self._start_transfer(request, home, dst, epoch, None).transfer
        if transfer is not None:
            transfer.ahead = True
            self.num_transfers_ahead += 1
        return transfer

    def _start_transfer(self, request: Request, src: PoolBinding, dst: PoolBinding, epoch: int,
                        waiter: tuple[int, int, int] | None) -> KVPlan:
        key, num_tokens = request.kv_key, request.kv_valid_tokens
        dst_blocks = dst.allocator.reserve(key, num_tokens)
        if dst_blocks is None:
            # No room on this host: run the chunk without the pool; its KV stays on ``src``.
            return KVPlan(None, pool_full=True)
        num_blocks = len(dst_blocks)
        transfer = Transfer(transfer_id=self._next_transfer_id, request=request, key=key, src=src, dst=dst,
                            src_blocks=list(src.allocator.blocks_of(key)[:num_blocks]), dst_blocks=list(dst_blocks),
                            num_tokens=num_tokens, kv_epoch=epoch, waiter=waiter)
        self._next_transfer_id += 1
        self.num_transfers += 1
        self.transfers[transfer.transfer_id] = transfer
        self._moving[key] = transfer
        self._new.append(transfer)
        return KVPlan(None, transfer=transfer)

    def saved(self, request: Request, num_tokens: int) -> None:
        """An engine saved tokens [0, num_tokens) of the request into its home pool."""
        if num_tokens > 0 and request.kv_key in self._homes:
            request.kv_valid_tokens = num_tokens
        if request.kv_key:
            self.queue.returned.returned(request.kv_key)  # the fallback order: behind everyone waiting

    # ------------------------------------------------------------------ disk tier
    def attach_disk(self, num_slots: int, prefetch: bool = True, depth: int = 0) -> None:
        """The local pool has a disk tier of ``num_slots`` blocks (``prefetch``: stage KV
        back ahead of its turn, for the next ``depth`` waiting requests -- 0: a few per
        engine; otherwise only on its chunk's dispatch)."""
        self.disk = DiskSlots(num_slots)
        self._prefetch_on = prefetch
        self.prefetch_depth = depth

    def take_disk_ops(self) -> list[DiskOp]:
        """Spills and stages decided since the last call, in order; the server runs them
        (in that order) before it sends any chunk decided after them."""
        ops, self._disk_ops = self._disk_ops, []
        return ops

    def take_prefetch_ops(self) -> list[DiskOp]:
        """Decide the prefetch now, from the queues as every decision so far left them,
        and return its ops (call right after ``take_disk_ops``). Nothing sent so far
        depends on them: the server runs them after the ops taken before, in the
        background, and makes only later sends wait for them."""
        self._disk_ops, earlier = [], self._disk_ops  # not expected: keep them first
        self.prefetch()
        ops, self._disk_ops = earlier + self._disk_ops, []
        return ops

    def _disk_home(self, pool: PoolBinding) -> bool:
        return self.disk is not None and pool.host_id == LOCAL_HOST and self.pools.get(LOCAL_HOST) is pool

    def _make_room(self, pool: PoolBinding, need_blocks: int, keep: int,
                   later_than: dict[int, int] | None = None) -> bool:
        """Spill waiting requests' KV, needed last first (only keys absent from
        ``later_than`` or ranked in it after ``keep``, if given), until ``need_blocks``
        blocks are free -- or nothing, if that cannot be reached (disk too full): then
        False, the caller's reserve fails and its chunk runs without saving (``kv_pool_full``)."""
        assert self.disk is not None
        missing = need_blocks - pool.allocator.num_free
        if missing <= 0:
            return True
        candidates = {key: len(pool.allocator.blocks_of(key)) for key, (home, req) in self._homes.items()
                      if home is pool and key != keep and key not in self._moving and req.kv_key == key
                      and req.state is RequestState.WAITING and req.kv_valid_tokens > 0
                      and (later_than is None or later_than.get(key, len(later_than)) > later_than[keep])}
        if sum(candidates.values()) < missing:
            return False
        last_first = self.queue.soonest_first([self._homes[key][1] for key in candidates])[::-1]
        victims = pick_victims(candidates, missing, [r.kv_key for r in last_first])
        if victims is None:
            return False
        bs = pool.allocator.block_size
        if sum(-(-self._homes[k][1].kv_valid_tokens // bs) for k in victims) > self.disk.num_free:
            if later_than is None:
                self.disk_counts["disk_full"] += 1
            return False
        for key in victims:
            request = self._homes.pop(key)[1]
            n = -(-request.kv_valid_tokens // bs)
            slots = self.disk.take(n)
            assert slots is not None
            blocks = pool.allocator.blocks_of(key)[:n]
            self._disk_ops.append(Spill(key=key, pool_blocks=list(blocks), slots=slots,
                                        num_tokens=request.kv_valid_tokens, epoch=self._epoch))
            pool.allocator.release(key)  # reused only by chunks sent after the spill ran
            self._on_disk[key] = (request, slots, request.kv_valid_tokens)
            self.disk_counts["spilled_blocks"] += n
        return True

    def _stage(self, request: Request, pool: PoolBinding, want_tokens: int, prefetch: bool) -> bool:
        """Bring the request's KV back from disk into ``pool`` (blocks for ``want_tokens``,
        at least its valid ones), making room if needed; False if there is no room."""
        key = request.kv_key
        _, slots, valid = self._on_disk[key]
        want = max(want_tokens, valid)
        need = pool.allocator.blocks_for_tokens(want)
        if not pool.allocator.can_reserve(key, want) and not prefetch:
            self._make_room(pool, need, key)
        blocks = pool.allocator.reserve(key, want)
        if blocks is None:
            return False
        del self._on_disk[key]
        self._disk_ops.append(Stage(key=key, slots=slots, pool_blocks=list(blocks[:len(slots)]), num_tokens=valid,
                                    epoch=self._epoch, prefetch=prefetch))
        self.disk.give(slots)  # type: ignore[union-attr]  # reused only by ops after this one
        self._homes[key] = (pool, request)
        self.disk_counts["staged_blocks"] += len(slots)
        self.disk_counts["prefetched" if prefetch else "staged_on_dispatch"] += 1
        return True

    def prefetch(self) -> None:
        """Keep DRAM holding the KV needed soonest: stage back the on-disk KV of the next
        ``prefetch_depth`` waiting requests, soonest first, into free blocks or into blocks
        of waiting requests needed *after* it (spilled first), until the next one would
        displace nothing needed later or the KV of the requests needed up to it would
        fill more than ``PREFETCH_POOL_SHARE`` of the pool. Costs O(depth log n) in the policy's queue plus a
        sort of the requests with KV in DRAM or on disk."""
        pool = self.pools.get(LOCAL_HOST)
        if self.disk is None or pool is None or not self._on_disk or not self._prefetch_on:
            return
        depth = self.prefetch_depth or PREFETCH_PER_ENGINE * max(1, self.num_live_engines)
        due = self.queue.due([entry[0] for entry in self._on_disk.values()], depth)
        if not due:
            return
        in_dram = [req for home, req in self._homes.values()
                   if home is pool and req.state is RequestState.WAITING]
        soonest = self.queue.soonest_first(due + in_dram)
        rank = {r.kv_key: i for i, r in enumerate(soonest)}
        bs = pool.allocator.block_size
        # The window's KV may fill at most PREFETCH_POOL_SHARE of the pool: the rest stays
        # for the chunks in flight to save into. A window larger than that made every save
        # spill prefetched KV and every prefetch spill it back (1,388 spills for 16
        # requests in a real run, docs/kv-pool.md).
        budget = int(pool.allocator.num_blocks * self.prefetch_pool_share)
        used = 0
        for r in soonest:
            entry = self._on_disk.get(r.kv_key)
            used += -(-(entry[2] if entry is not None else r.kv_valid_tokens) // bs)
            if used > budget:
                due = due[:next((i for i, d in enumerate(due) if rank[d.kv_key] >= rank[r.kv_key]), len(due))]
                break
        for request in due:
            need = -(-self._on_disk[request.kv_key][2] // bs)
            if need > pool.allocator.num_free and not self._make_room(pool, need, request.kv_key,
                                                                       later_than=rank):
                return
            if not self._stage(request, pool, 0, prefetch=True):
                return

    def disk_op_done(self, op: DiskOp, ok_blocks: int) -> None:
        """The server ran ``op``; ``ok_blocks`` of its blocks made it (all: success). A
        failed spill loses that KV (the request re-prefills); a short stage leaves the
        rest of the blocks invalid (the engine's tag check recomputes them)."""
        n = len(op.slots)
        if ok_blocks >= n:
            return
        self.disk_counts["failed"] += 1
        if isinstance(op, Spill):
            entry = self._on_disk.get(op.key)
            if entry is not None and entry[1] is op.slots:
                self._forget_disk(op.key)
                entry[0].kv_valid_tokens = 0
            return
        home = self._homes.get(op.key)
        if home is not None:
            request = home[1]
            bs = home[0].allocator.block_size
            request.kv_valid_tokens = min(request.kv_valid_tokens, ok_blocks * bs)

    def _forget_disk(self, key: int) -> None:
        entry = self._on_disk.pop(key, None)
        if entry is not None and self.disk is not None:
            self.disk.give(entry[1])

    # ------------------------------------------------------------------ transfers end
    def finish(self, transfer_id: int, ok: bool) -> Transfer | None:
        """The agent answered (or the destination is gone). On success the KV's home is
        the destination and the source blocks are free; on failure the destination
        blocks are free and, if a chunk waits, the request starts afresh there (the chunk
        re-prefills). None: unknown (already ended)."""
        transfer = self.transfers.pop(transfer_id, None)
        if transfer is None:
            return None
        key, request = transfer.key, transfer.request
        if transfer.abandoned:
            transfer.dst.allocator.release(key)  # nothing can write into them any more
            return transfer
        del self._moving[key]
        if ok and self.pools.get(transfer.dst.host_id) is transfer.dst:
            home = self._homes.get(key, (None, None))[0]
            if home is not None:
                home.allocator.release(key)
            self._homes[key] = (transfer.dst, request)
            request.kv_valid_tokens = transfer.num_tokens
            return transfer
        transfer.dst.allocator.release(key)
        if transfer.waiter is not None:
            self.drop(request)
        return transfer

    def abandon(self, transfer: Transfer) -> None:
        """Give up on a transfer before its agent answered (timeout, request gone, new
        weights). The destination blocks stay held until it answers; a live request
        continues under a fresh key with nothing in any pool (its next chunk re-prefills)."""
        if transfer.abandoned or self.transfers.get(transfer.transfer_id) is not transfer:
            return
        transfer.abandoned = True
        del self._moving[transfer.key]
        request = transfer.request
        home = self._homes.pop(transfer.key, (None, None))[0]
        if home is not None:
            home.allocator.release(transfer.key)
        if request.kv_key == transfer.key:
            request.kv_key = 0
        request.kv_valid_tokens = 0

    # ------------------------------------------------------------------ requests
    def drop(self, request: Request) -> None:
        """Forget the request's KV (finished, cancelled, or unusable where it runs next)."""
        key = request.kv_key
        moving = self._moving.get(key) if key else None
        if moving is not None:
            self.abandon(moving)
        elif key:
            home = self._homes.pop(key, (None, None))[0]
            if home is not None:
                home.allocator.release(key)
        if key:
            self._forget_disk(key)
            self.queue.returned.forget(key)
        request.kv_valid_tokens = 0

    def weights_changed(self, requests: list[Request]) -> None:
        """No KV saved under the old weights may load: every transfer is given up and every
        block not held by one is free."""
        for transfer in list(self.transfers.values()):
            self.abandon(transfer)
        for request in requests:
            self.drop(request)
        held = {id(t.dst) for t in self.transfers.values()}
        for pool in self.pools.values():
            if id(pool) not in held:
                pool.allocator.release_all()
        self._homes.clear()
        for key in list(self._on_disk):
            self._forget_disk(key)

    def _fresh_key(self) -> int:
        key = self._next_key
        self._next_key += 1
        return key
