"""A trainer's weights in one shared-memory segment: written once by the trainer, loaded
in place by every engine on the host (no file, no second copy, no re-read).

Owns: the segment's byte layout, the trainer-side writer (two segments used in turn), the
engine-side read-only mapping, and the *weights source* string that names a segment in
``update_weights`` / ``LoadWeights``. Torch-free: tensors come in as buffers (the trainer's
adapter passes each tensor's bytes) and go out as offsets (the engine builds its tensor
views on the mapping). Engines never write a segment; the writer creates and unlinks it.

Layout of ``/dev/shm/<name>`` (little-endian):

    [0, 8)      magic ``SEERWT01``
    [8, 16)     generation, u64: 0 while the writer copies, else the number of the write
                whose bytes the segment holds (written last)
    [16, 24)    manifest length in bytes, u64
    [24, ...)   manifest: JSON ``[[name, dtype, shape, offset], ...]``; dtype is the
                safetensors code ("F32", "BF16", ...), offset absolute and 64-byte aligned
    data        each tensor's bytes in C order at its offset

Invariants: the manifest never changes over a segment's life (a writer whose tensors
change shape or dtype makes a new segment); a reader trusts the bytes only if the
generation it reads before *and* after copying equals the one its source names, so a
segment rewritten under it is an error, never a mix of two steps.

Orphans: a writer unlinks its segments on ``close()``, and Python's resource tracker does
if the trainer dies; when both are SIGKILLed (the OOM killer takes the process group) the
two segments stay in /dev/shm. Their names carry the writer's pid
(``seer-weights-<pid>-<hex>-a|b``), so the next writer and ``seerctl stop`` remove those of
writers that are gone (``remove_orphans``).

Why two segments: the writer writes step n+1 into the segment that does not hold the
last update the engines accepted, so that segment stays intact while they load the new
one. An engine whose load fails half way reloads the intact one (``engines/
vllm_backend.py``); the daemon can replay the accepted one to an engine that joins later.

A weights source is a filesystem path (a safetensors file or a folder of them: the
checkpoint path) or ``shm://<segment>?generation=<n>`` (``SegmentSource``).
"""

from __future__ import annotations

import json
import mmap
import os
import secrets
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from multiprocessing import shared_memory
from pathlib import Path

import structlog

from seer.process import remove_stale_shm

SHM_DIR = Path("/dev/shm")
PREFIX = "seer-weights-"
MAGIC = b"SEERWT01"
SCHEME = "shm://"
_PREAMBLE = struct.Struct("<8sQQ")  # magic, generation, manifest length
_GENERATION_AT = 8
ALIGN_BYTES = 64
_PAGE_BYTES = 4096
DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}


class WeightsSegmentError(ValueError):
    """A segment that is missing, foreign, torn or does not hold what its source names."""


@dataclass(frozen=True)
class SegmentSource:
    """``shm://<segment>?generation=<n>``: the bytes of write ``generation`` of a segment."""

    segment: str
    generation: int

    def __str__(self) -> str:
        return f"{SCHEME}{self.segment}?generation={self.generation}"

    @property
    def path(self) -> Path:
        return SHM_DIR / self.segment


def parse_source(source: str) -> SegmentSource | None:
    """The segment a source string names, or None for a filesystem path."""
    if not source.startswith(SCHEME):
        return None
    name, sep, query = source[len(SCHEME):].partition("?generation=")
    if not sep or not name or "/" in name or not query.isdigit() or int(query) < 1:
        raise WeightsSegmentError(f"weights source {source!r} is not shm://<segment>?generation=<n> "
                                  f"(n >= 1, a plain segment name)")
    return SegmentSource(name, int(query))


def source_exists(source: str) -> bool:
    """Does the checkpoint path or the segment a source names exist on this host?"""
    try:
        segment = parse_source(source)
    except WeightsSegmentError:
        return False
    return os.path.exists(source if segment is None else segment.path)


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: str  # safetensors code
    shape: tuple[int, ...]
    offset: int  # absolute byte offset in the segment

    @property
    def num_bytes(self) -> int:
        count = 1
        for dim in self.shape:
            count *= dim
        return count * DTYPE_BYTES[self.dtype]


def _round_up(n: int, align: int = ALIGN_BYTES) -> int:
    return (n + align - 1) // align * align


def plan_layout(specs: Iterable[tuple[str, str, tuple[int, ...]]]) -> tuple[bytes, list[TensorEntry], int]:
    """The manifest bytes, the entries and the segment size for tensors ``(name, dtype, shape)``."""
    specs = [(name, dtype, tuple(int(d) for d in shape)) for name, dtype, shape in specs]
    for name, dtype, _ in specs:
        if dtype not in DTYPE_BYTES:
            raise WeightsSegmentError(f"tensor {name!r} has dtype {dtype!r}; a segment holds {sorted(DTYPE_BYTES)}")
    if len({name for name, _, _ in specs}) != len(specs):
        raise WeightsSegmentError("two tensors have the same name")
    # The offsets depend on the manifest's length, which depends on the offsets' digits:
    # place the data after a generous bound on the manifest instead of iterating.
    bound = len(json.dumps([[n, d, list(s), 10**15] for n, d, s in specs]).encode())
    cursor = _round_up(_PREAMBLE.size + bound)
    entries = []
    for name, dtype, shape in specs:
        entry = TensorEntry(name, dtype, shape, cursor)
        entries.append(entry)
        cursor = _round_up(cursor + entry.num_bytes)
    manifest = json.dumps([[e.name, e.dtype, list(e.shape), e.offset] for e in entries]).encode()
    assert _PREAMBLE.size + len(manifest) <= entries[0].offset if entries else True
    return manifest, entries, max(cursor, _round_up(_PREAMBLE.size + len(manifest)))


def remove_orphans(shm_dir: Path = SHM_DIR) -> list[str]:
    """Unlink the segments of writers that died without closing them (module doc)."""
    return remove_stale_shm(PREFIX, shm_dir)


class SegmentWriter:
    """Trainer side: writes whole weight sets into two segments in turn (see the module doc).

    ``write(tensors)`` copies every tensor once and returns the source to pass to
    ``update_weights``; call ``accepted()`` when the daemon took it. ``close()`` unlinks
    both segments (Python's resource tracker also unlinks them if the trainer dies).
    """

    def __init__(self, prefix: str | None = None) -> None:
        if orphans := remove_orphans():
            structlog.get_logger().warning("weight_segments_of_dead_writers_removed", names=orphans)
        self.prefix = prefix or f"{PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
        self._segments: dict[str, shared_memory.SharedMemory] = {}
        self._manifests: dict[str, bytes] = {}
        self._accepted: str | None = None  # the segment holding the update the daemon last accepted
        self._pending: str | None = None
        self.generation = 0  # of the last write, across both segments

    def write(self, tensors: Iterable[tuple[str, str, tuple[int, ...], memoryview]]) -> SegmentSource:
        """Copy ``(name, dtype, shape, bytes)`` for every tensor into the segment not
        holding the accepted update; the bytes are each tensor's C-order bytes."""
        tensors = list(tensors)
        manifest, entries, size = plan_layout((n, d, s) for n, d, s, _ in tensors)
        name = f"{self.prefix}-{'b' if self._accepted == f'{self.prefix}-a' else 'a'}"
        segment = self._segment(name, manifest, size)
        twin = f"{self.prefix}-{'a' if name.endswith('-b') else 'b'}"
        if twin not in self._segments:  # made now, so no later step pays its first-touch cost
            self._segment(twin, manifest, size)
        buf = segment.buf
        struct.pack_into("<Q", buf, _GENERATION_AT, 0)  # readers refuse it from here on
        for entry, (_, _, _, data) in zip(entries, tensors, strict=True):
            data = memoryview(data).cast("B")
            if data.nbytes != entry.num_bytes:
                raise WeightsSegmentError(f"tensor {entry.name!r}: {data.nbytes} bytes given, its dtype and shape "
                                          f"make {entry.num_bytes}")
            buf[entry.offset:entry.offset + entry.num_bytes] = data
        self.generation += 1
        struct.pack_into("<Q", buf, _GENERATION_AT, self.generation)
        self._pending = name
        return SegmentSource(name, self.generation)

    def accepted(self) -> None:
        """The daemon accepted the last write: the next one goes to the other segment."""
        if self._pending is not None:
            self._accepted, self._pending = self._pending, None

    def _segment(self, name: str, manifest: bytes, size: int) -> shared_memory.SharedMemory:
        segment = self._segments.get(name)
        if segment is not None and self._manifests[name] == manifest:
            return segment
        if segment is not None:  # other tensors than last time: a segment of the new layout
            self._unlink(name)
        segment = shared_memory.SharedMemory(name=name, create=True, size=size)
        # Touch every page once here: a first write into fresh pages ran at ~0.5-1 GB/s
        # (page faults), a later one at memcpy speed.
        pages = segment.buf[::_PAGE_BYTES]
        pages[:] = bytes(len(pages))
        pages.release()
        _PREAMBLE.pack_into(segment.buf, 0, MAGIC, 0, len(manifest))
        segment.buf[_PREAMBLE.size:_PREAMBLE.size + len(manifest)] = manifest
        self._segments[name], self._manifests[name] = segment, manifest
        return segment

    def _unlink(self, name: str) -> None:
        segment = self._segments.pop(name)
        self._manifests.pop(name, None)
        segment.close()
        try:
            segment.unlink()
        except FileNotFoundError:
            pass

    def close(self) -> None:
        for name in list(self._segments):
            self._unlink(name)
        self._accepted = self._pending = None


class SegmentReader:
    """Engine side: one segment mapped read-only, its manifest, its generation checks."""

    def __init__(self, source: SegmentSource, *, populate: bool = True) -> None:
        """``populate``: map every page now (MAP_POPULATE), for a reader about to copy
        the whole segment; False for one that only reads the manifest."""
        self.source = source
        try:
            fd = os.open(source.path, os.O_RDONLY)
        except FileNotFoundError:
            raise WeightsSegmentError(f"weights segment {source.segment!r} does not exist on this host (the "
                                      f"trainer that wrote it exited or removed it)") from None
        try:
            size = os.fstat(fd).st_size
            if size < _PREAMBLE.size:
                raise WeightsSegmentError(f"{source.path} is not a Seer weights segment (too small)")
            flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
            self.buffer = mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        magic, _, manifest_bytes = _PREAMBLE.unpack_from(self.buffer, 0)
        if magic != MAGIC:
            self.close()
            raise WeightsSegmentError(f"{source.path} is not a Seer weights segment of this version (bad magic)")
        try:
            rows = json.loads(self.buffer[_PREAMBLE.size:_PREAMBLE.size + manifest_bytes])
            self.entries = [TensorEntry(n, d, tuple(s), o) for n, d, s, o in rows]
        except (ValueError, TypeError) as exc:
            self.close()
            raise WeightsSegmentError(f"{source.path} has an unreadable manifest: {exc}") from None
        for entry in self.entries:
            if entry.dtype not in DTYPE_BYTES or entry.offset + entry.num_bytes > size:
                self.close()
                raise WeightsSegmentError(f"{source.path}: tensor {entry.name!r} lies outside the segment")
        self.check_generation()

    def generation(self) -> int:
        return struct.unpack_from("<Q", self.buffer, _GENERATION_AT)[0]

    def check_generation(self) -> None:
        """Raise unless the segment still holds exactly the write its source names."""
        found = self.generation()
        if found != self.source.generation:
            state = "being rewritten" if found == 0 else f"at generation {found}"
            raise WeightsSegmentError(f"weights segment {self.source.segment!r} is {state}, not generation "
                                      f"{self.source.generation}: the trainer overwrote it before the engines "
                                      f"loaded it (push the next update only after update_weights returned)")

    def shapes(self) -> dict[str, list[int]]:
        return {e.name: list(e.shape) for e in self.entries}

    def close(self) -> None:
        try:
            self.buffer.close()
        except BufferError:  # tensor views still alive: the mapping goes with the last of them
            pass


__all__ = ["SCHEME", "SegmentReader", "SegmentSource", "SegmentWriter", "TensorEntry", "WeightsSegmentError",
           "parse_source", "plan_layout", "source_exists"]
