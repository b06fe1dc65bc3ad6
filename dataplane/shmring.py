"""A single-producer single-consumer ring of small records in POSIX shared memory.

Owns the byte layout of one ring and nothing about what the records mean (the draft
server and its clients put msgpack messages in them). Layout of ``/dev/shm/<name>``:

    [header, 256 B]   magic, capacity (u64), creator pid (u64); the consumer's ``head``
                      (u64, offset 64) and the producer's ``tail`` (u64, offset 128) on
                      cache lines of their own
    [data]            ``capacity`` bytes; a record is a u32 length and its payload,
                      padded to 8 bytes, written at ``tail % capacity`` and wrapping
                      byte-wise around the end

``head`` and ``tail`` count bytes since creation and never wrap (u64), so ``tail - head``
is the number of bytes in use. Exactly one process writes (``try_put``) and one reads
(``drain``); each owns one counter and only reads the other, so no lock is needed. The
producer copies the record, then publishes it by storing the new ``tail``; the consumer
loads ``tail``, copies the records, then frees them by storing ``head``. The counters are
aligned 8-byte words written and read with single machine stores and loads (ctypes), and
the ordering relies on x86-64's total store order -- a weakly ordered CPU (ARM) would need
explicit barriers, which Python cannot emit.

Nothing blocks: a full ring makes ``try_put`` return False and the caller keeps the
record and retries later, so nothing is lost. Readers poll with ``PollBackoff``
(sleeps from 0.5 ms up to 20 ms while idle): on 2 shared cores a spinning reader starves
the engines sharing them.

Who unlinks: whoever created the ring calls ``unlink``; ``close`` only unmaps.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import time
from collections.abc import Sequence
from pathlib import Path

from seer.dataplane.shm import attach_mapped, create_mapped, shm_path

MAGIC = b"SEERRNG1"
HEADER_BYTES = 256
_HEAD_OFFSET = 64
_TAIL_OFFSET = 128
_LEN_BYTES = 4
_ALIGN = 8
MIN_CAPACITY = 4096


class RingError(RuntimeError):
    """The ring is missing, foreign, or its bytes are not a valid record stream."""


def ring_path(name: str) -> Path:
    return shm_path(name, "ring", RingError)


def record_bytes(payload_len: int) -> int:
    """Ring bytes one record of ``payload_len`` bytes takes (length prefix + padding)."""
    return (_LEN_BYTES + payload_len + _ALIGN - 1) // _ALIGN * _ALIGN


class ShmRing:
    """One mapping of a ring; the same class serves the producer and the consumer side."""

    def __init__(self, path: Path, mm: mmap.mmap) -> None:
        self.path = path
        self.capacity = int.from_bytes(mm[8:16], "little")
        self.creator_pid = int.from_bytes(mm[16:24], "little")
        self._mm = mm
        self._data = memoryview(mm)[HEADER_BYTES:HEADER_BYTES + self.capacity]
        self._head = ctypes.c_uint64.from_buffer(mm, _HEAD_OFFSET)
        self._tail = ctypes.c_uint64.from_buffer(mm, _TAIL_OFFSET)

    # ------------------------------------------------------------------ lifecycle
    @classmethod
    def create(cls, name: str, capacity: int) -> ShmRing:
        """A new, empty ring. ``capacity`` (bytes of record space) is rounded up to 8."""
        if capacity < MIN_CAPACITY:
            raise RingError(f"ring capacity must be >= {MIN_CAPACITY} bytes, got {capacity}")
        capacity = (capacity + _ALIGN - 1) // _ALIGN * _ALIGN
        path = ring_path(name)
        mm = create_mapped(path, HEADER_BYTES + capacity)
        mm[8:16] = capacity.to_bytes(8, "little")
        mm[16:24] = os.getpid().to_bytes(8, "little")
        mm[0:8] = MAGIC  # last: an attacher sees a complete header or none
        return cls(path, mm)

    @classmethod
    def attach(cls, name: str) -> ShmRing:
        path = ring_path(name)
        mm, size = attach_mapped(path, magic=MAGIC, min_size=HEADER_BYTES + MIN_CAPACITY, error=RingError,
                                 missing=f"ring {path} does not exist", kind="a Seer ring",
                                 magic_hint=", or still being created")
        if HEADER_BYTES + int.from_bytes(mm[8:16], "little") > size:
            mm.close()
            raise RingError(f"{path} is truncated")
        return cls(path, mm)

    def close(self) -> None:
        # The ctypes counters and the memoryview export the map's buffer; drop them first.
        if self._mm.closed:
            return
        self._data.release()
        del self._head, self._tail
        self._mm.close()

    def unlink(self) -> None:
        self.path.unlink(missing_ok=True)

    @property
    def closed(self) -> bool:
        return self._mm.closed

    # ------------------------------------------------------------------ state
    @property
    def num_bytes_used(self) -> int:
        return self._tail.value - self._head.value

    @property
    def max_record_bytes(self) -> int:
        """Largest payload that fits into an empty ring."""
        return self.capacity - _LEN_BYTES

    # ------------------------------------------------------------------ producer
    def try_put(self, record: bytes) -> bool:
        """Append one record; False (nothing written) if the ring lacks room right now."""
        return self.try_put_many((record,)) == 1

    def try_put_many(self, records: Sequence[bytes]) -> int:
        """Append records in order, stopping at the first that does not fit; publishes
        them with one ``tail`` store. Returns how many were written."""
        cap = self.capacity
        tail = start = self._tail.value
        free = cap - (tail - self._head.value)
        data = self._data
        written = 0
        for record in records:
            n = len(record)
            if n > cap - _LEN_BYTES:
                raise RingError(f"record of {n} bytes can never fit a ring of {cap} bytes")
            need = record_bytes(n)
            if need > free:
                break
            pos = tail % cap  # 8-aligned, so the length prefix never straddles the end
            data[pos:pos + _LEN_BYTES] = n.to_bytes(_LEN_BYTES, "little")
            pos += _LEN_BYTES
            first = min(n, cap - pos)
            data[pos:pos + first] = record[:first]
            if first < n:
                data[0:n - first] = record[first:]
            tail += need
            free -= need
            written += 1
        if tail != start:
            self._tail.value = tail  # publish after the bytes are in place
        return written

    # ------------------------------------------------------------------ consumer
    def drain(self, max_records: int | None = None) -> list[bytes]:
        """Take every published record (up to ``max_records``), oldest first."""
        cap = self.capacity
        head = start = self._head.value
        tail = self._tail.value
        if head == tail:
            return []
        data = self._data
        out: list[bytes] = []
        while head < tail and (max_records is None or len(out) < max_records):
            pos = head % cap
            n = int.from_bytes(data[pos:pos + _LEN_BYTES], "little")
            need = record_bytes(n)
            if n > cap - _LEN_BYTES or need > tail - head:
                raise RingError(f"{self.path}: corrupt record length {n} at offset {head} "
                                f"(published {tail - head} bytes)")
            pos += _LEN_BYTES
            first = min(n, cap - pos)
            if first < n:
                out.append(bytes(data[pos:pos + first]) + bytes(data[0:n - first]))
            else:
                out.append(bytes(data[pos:pos + n]))
            head += need
        if head != start:
            self._head.value = head  # free the space after the bytes are copied out
        return out


class PollBackoff:
    """How a ring reader waits: after work, poll again at once; while idle, sleep for
    ``min_s`` doubling up to ``max_s``. Never spins (2 shared cores)."""

    def __init__(self, min_s: float = 0.0005, max_s: float = 0.02, sleep=time.sleep) -> None:
        if not 0 < min_s <= max_s:
            raise ValueError(f"need 0 < min_s <= max_s, got {min_s} and {max_s}")
        self.min_s = min_s
        self.max_s = max_s
        self._sleep = sleep
        self._next_s = min_s

    def reset(self) -> None:
        self._next_s = self.min_s

    def idle(self) -> float:
        """Sleep once after finding nothing to do; returns the time slept."""
        slept = self._next_s
        self._sleep(slept)
        self._next_s = min(self.max_s, self._next_s * 2)
        return slept
