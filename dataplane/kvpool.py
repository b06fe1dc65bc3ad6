"""The host KV pool: KV blocks of every active request in one shared-memory segment.

Owns the segment's bytes and their format, nothing about scheduling. Layout of
``/dev/shm/<name>`` (created by the control plane, mapped by every engine on the host):

    [header, 4 KiB]  magic, format version, geometry (JSON), number of blocks
    [tags]           one 32-byte tag per pool block: (request key, block index,
                     weights version, checksum, state) -- written *after* the block's bytes
    [blocks]         pool block p = ``bytes_per_block`` contiguous bytes, layer-major
                     inside: layer l occupies [l * layer_bytes, (l+1) * layer_bytes)

One pool block holds ``block_size`` tokens of one request across all layers, in the
engine's own paged-KV byte layout (copied page for page, never re-packed: on vLLM's CPU
backend K is stored transposed, and the packing depends on the ISA), so a pool is only
valid between engines with the same geometry -- ``PoolGeometry.fingerprint`` checks that.

Who does what: the control plane creates and unlinks the segment and owns the
allocator (``PoolAllocator``, single owner, so no cross-process locks). Engines attach,
copy whole blocks in and out, and write or check tags. A reader trusts a block only if
its tag matches what it expects (request key, block index, weights version) and its
checksum matches its bytes; anything else is a miss and the engine re-prefills -- a
stale, torn or corrupted block can cost time, never a wrong token.
"""

from __future__ import annotations

import mmap
from collections.abc import Iterable
from pathlib import Path

import msgspec
import numpy as np

from seer.dataplane.shm import attach_mapped, create_mapped
from seer.dataplane.shm import shm_path as shared_path
from seer.protocol import PoolGeometry

MAGIC = b"SEERKV01"
SEGMENT_PREFIX = "seer-kv-"  # /dev/shm/seer-kv-<daemon pid>-<token>: a daemon's pool segments
HEADER_BYTES = 4096
TAG_BYTES = 32
_ALIGN = 4096

# tag layout (little-endian): key u64, block_index u32, weights_version u32, checksum u64, state u32, pad
TAG_DTYPE = np.dtype([("key", "<u8"), ("block_index", "<u4"), ("weights_version", "<u4"),
                      ("checksum", "<u8"), ("state", "<u4"), ("pad", "<u4")])
assert TAG_DTYPE.itemsize == TAG_BYTES
STATE_EMPTY = 0
STATE_VALID = 1

class PoolError(RuntimeError):
    """The pool segment is missing, foreign or does not match this engine."""


class _Header(msgspec.Struct, kw_only=True):
    geometry: PoolGeometry
    num_blocks: int


def _round_up(n: int, align: int) -> int:
    return (n + align - 1) // align * align


def segment_bytes(geometry: PoolGeometry, num_blocks: int) -> int:
    return HEADER_BYTES + _round_up(num_blocks * TAG_BYTES, _ALIGN) + num_blocks * geometry.bytes_per_block


def blocks_for_bytes(geometry: PoolGeometry, num_bytes: int) -> int:
    return max(1, num_bytes // geometry.bytes_per_block)


def shm_path(name: str) -> Path:
    return shared_path(name, "pool", PoolError)


class KVPoolSegment:
    """One mapping of the pool segment. ``create`` (control plane) or ``attach``
    (engines); ``close`` unmaps; only the creator calls ``unlink``."""

    def __init__(self, path: Path, mm: mmap.mmap, geometry: PoolGeometry, num_blocks: int) -> None:
        self.path = path
        self.geometry = geometry
        self.num_blocks = num_blocks
        self._mm = mm
        tags_bytes = _round_up(num_blocks * TAG_BYTES, _ALIGN)
        self.tags = np.frombuffer(mm, dtype=TAG_DTYPE, count=num_blocks, offset=HEADER_BYTES)
        self._data_offset = HEADER_BYTES + tags_bytes
        # [num_blocks, num_layers, layer_bytes] view of the block area, no copy.
        self.blocks = np.frombuffer(mm, dtype=np.uint8, count=num_blocks * geometry.bytes_per_block,
                                    offset=self._data_offset).reshape(num_blocks, geometry.num_layers,
                                                                      geometry.layer_bytes)

    # ------------------------------------------------------------------ lifecycle
    @classmethod
    def create(cls, name: str, geometry: PoolGeometry, num_blocks: int, prefault: bool = True) -> KVPoolSegment:
        if num_blocks < 1:
            raise PoolError("a pool needs at least one block")
        path = shm_path(name)
        size = segment_bytes(geometry, num_blocks)
        header = msgspec.json.encode(_Header(geometry=geometry, num_blocks=num_blocks))
        if len(header) + 16 > HEADER_BYTES:
            raise PoolError("pool header too large")
        mm = create_mapped(path, size)
        mm[16:16 + len(header)] = header
        mm[8:16] = len(header).to_bytes(8, "little")
        mm[0:8] = MAGIC  # last: an attacher sees a complete header or none
        segment = cls(path, mm, geometry, num_blocks)
        if prefault:
            # Fresh pages copy far slower than touched ones (each first touch faults):
            # pay the page faults once at start, not during the first migrations.
            step = min(64 << 20, size)
            view = memoryview(mm)
            zeros = bytes(step)
            for off in range(segment._data_offset, size, step):
                n = min(step, size - off)
                view[off:off + n] = zeros[:n]
            view.release()
        return segment

    @classmethod
    def attach(cls, name: str, populate: bool = False) -> KVPoolSegment:
        """``populate``: fault the whole mapping in now (the engines' worker side, which
        copies through it; see ``attach_mapped``)."""
        path = shm_path(name)
        mm, size = attach_mapped(
            path, magic=MAGIC, min_size=HEADER_BYTES, error=PoolError, kind="a Seer KV pool", populate=populate,
            missing=f"KV pool segment {path} does not exist (is the control plane running?)")
        n = int.from_bytes(mm[8:16], "little")
        try:
            header = msgspec.json.decode(mm[16:16 + min(n, HEADER_BYTES - 16)], type=_Header)
        except msgspec.DecodeError as exc:
            mm.close()
            raise PoolError(f"{path} has an unreadable header ({exc}); remove it and restart the daemon") from exc
        if size < segment_bytes(header.geometry, header.num_blocks):
            mm.close()
            raise PoolError(f"{path} is truncated")
        return cls(path, mm, header.geometry, header.num_blocks)

    def close(self) -> None:
        # numpy views keep the buffer exported; drop them before closing the map.
        self.tags = None  # type: ignore[assignment]
        self.blocks = None  # type: ignore[assignment]
        try:
            self._mm.close()
        except BufferError:
            pass  # a caller still holds a view; the map goes with the process

    def unlink(self) -> None:
        self.path.unlink(missing_ok=True)

    # ------------------------------------------------------------------ tags
    def checksum(self, block: int) -> int:
        # A wrapping 64-bit sum of the block's words: ~10x cheaper than crc32 here and
        # enough to catch a torn, zeroed or overwritten block (not an adversary).
        words = self.blocks[block].reshape(-1).view(np.uint64)
        return int(np.add.reduce(words, dtype=np.uint64))

    def seal(self, blocks: Iterable[int], key: int, first_index: int, weights_version: int) -> None:
        """Mark blocks as holding (key, first_index + i) under ``weights_version``. Call
        after their bytes are written."""
        for i, block in enumerate(blocks):
            tag = self.tags[block]
            tag["state"] = STATE_EMPTY  # invalid while the fields change
            tag["key"] = key
            tag["block_index"] = first_index + i
            tag["weights_version"] = weights_version
            tag["checksum"] = self.checksum(block)
            tag["state"] = STATE_VALID

    def seal_with(self, blocks: list[int], checksums: np.ndarray, key: int, first_index: int,
                  weights_version: int) -> None:
        """``seal`` with checksums the caller computed while writing the bytes (the
        engines' fused copy), instead of a second pass over every block."""
        for i, block in enumerate(blocks):
            tag = self.tags[block]
            tag["state"] = STATE_EMPTY
            tag["key"] = key
            tag["block_index"] = first_index + i
            tag["weights_version"] = weights_version
            tag["checksum"] = int(checksums[i])
            tag["state"] = STATE_VALID

    def invalidate(self, blocks: Iterable[int]) -> None:
        for block in blocks:
            self.tags[block]["state"] = STATE_EMPTY

    def first_bad(self, blocks: list[int], key: int, first_index: int, weights_version: int,
                  verify_checksums: bool = True) -> int | None:
        """Index (into ``blocks``) of the first block whose tag or checksum does not
        match; None if all do."""
        for i, block in enumerate(blocks):
            if not 0 <= block < self.num_blocks:
                return i
            tag = self.tags[block]
            if (int(tag["state"]) != STATE_VALID or int(tag["key"]) != key
                    or int(tag["block_index"]) != first_index + i
                    or int(tag["weights_version"]) != weights_version):
                return i
            if verify_checksums and int(tag["checksum"]) != self.checksum(block):
                return i
        return None


class PoolAllocator:
    """Which pool blocks belong to which request (control plane only, single owner).

    A request owns an ordered list of blocks, block i holding its tokens
    ``[i * block_size, (i + 1) * block_size)``; ``reserve`` grows it, ``release`` gives
    everything back the moment the request finishes. When the pool is full, ``reserve``
    refuses and the caller runs the chunk without saving (the next chunk re-prefills).
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() gives low ids first
        self._owned: dict[int, list[int]] = {}
        self.peak_used = 0
        self.num_refused = 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_of(self, key: int) -> list[int]:
        return self._owned.get(key, [])

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_reserve(self, key: int, num_tokens: int) -> bool:
        missing = self.blocks_for_tokens(num_tokens) - len(self._owned.get(key, ()))
        return missing <= len(self._free)

    def reserve(self, key: int, num_tokens: int) -> list[int] | None:
        """Make ``key`` own enough blocks for ``num_tokens`` tokens; its full block list,
        or None (nothing changed) if the pool lacks room."""
        if not self.can_reserve(key, num_tokens):
            self.num_refused += 1
            return None
        owned = self._owned.setdefault(key, [])
        for _ in range(self.blocks_for_tokens(num_tokens) - len(owned)):
            owned.append(self._free.pop())
        self.peak_used = max(self.peak_used, self.num_used)
        return owned

    def release(self, key: int) -> list[int]:
        blocks = self._owned.pop(key, [])
        self._free.extend(reversed(blocks))
        return blocks

    def release_all(self) -> None:
        for key in list(self._owned):
            self.release(key)
