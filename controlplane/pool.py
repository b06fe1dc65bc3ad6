"""The host KV pool's lifecycle on the control-plane side.

The control plane creates the shared-memory segment when the first engine that can use
it registers (only the engines know the shape of a KV block), owns its allocator through
the scheduler, and unlinks the segment when it stops. Segments left behind by a control
plane that was killed are removed at the next start (their name carries the owner's pid).
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

import structlog

from seer.config import KVPoolConfig
from seer.controlplane.scheduler import PoolBinding
from seer.dataplane.geometry import PoolGeometry
from seer.dataplane.kvpool import KVPoolSegment, PoolAllocator, blocks_for_bytes
from seer.process import pid_alive

log = structlog.get_logger()

PREFIX = "seer-kv-"


def remove_stale_segments(shm_dir: Path = Path("/dev/shm")) -> list[str]:
    removed = []
    for path in shm_dir.glob(f"{PREFIX}*"):
        try:
            pid = int(path.name[len(PREFIX):].split("-")[0])
        except ValueError:
            continue
        if pid != os.getpid() and not pid_alive(pid):
            path.unlink(missing_ok=True)
            removed.append(path.name)
    return removed


class HostPool:
    def __init__(self, config: KVPoolConfig) -> None:
        self.config = config
        self.segment: KVPoolSegment | None = None

    def create(self, geometry: PoolGeometry) -> PoolBinding:
        stale = remove_stale_segments()
        if stale:
            log.warning("kv_pool_stale_segments_removed", segments=stale)
        name = f"{PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
        num_blocks = blocks_for_bytes(geometry, int(self.config.pool_gib * (1 << 30)))
        self.segment = KVPoolSegment.create(name, geometry, num_blocks)
        log.info("kv_pool_created", name=name, num_blocks=num_blocks, block_bytes=geometry.bytes_per_block,
                 capacity_tokens=num_blocks * geometry.block_size, geometry=geometry.fingerprint)
        return PoolBinding(name=name, allocator=PoolAllocator(num_blocks, geometry.block_size),
                           fingerprint=geometry.fingerprint, min_load_tokens=self.config.min_load_tokens)

    def close(self) -> None:
        if self.segment is not None:
            self.segment.close()
            self.segment.unlink()
            log.info("kv_pool_removed", name=self.segment.path.name)
            self.segment = None
