"""The disk tier under a host KV pool: pool blocks spilled to a plain file and staged back.

Owns the file's bytes and format, nothing about which blocks go there (that is
``controlplane/kvpool/tiers.py``). Layout of ``<disk_path>/seer-kvdisk-<pid>.bin``:

    [header, 4 KiB]  magic, geometry fingerprint, number of slots
    [tags]           one 32-byte tag per slot, the pool's tag format (key, block index,
                     weights version, checksum, state), written *after* the slot's bytes
    [slots]          slot s = one pool block's ``bytes_per_block`` bytes (whole 4 KiB
                     pages for every real model; then the bytes bypass the page cache)

I/O is plain positional vector I/O (``os.pwritev`` / ``os.preadv``) straight between
the pool's shared-memory mapping and the file, in runs of consecutive slots and blocks
(one system call per run, megabytes each): no Python-side buffer, no extra copy.
Checksums are end to end: a spill copies the pool block's tag (whose checksum the
engine computed while saving) to the slot's tag only after checking the bytes it wrote
against it; a stage-in reads the bytes into the pool, recomputes the checksum and seals
the pool block only if it matches the slot's tag (and key, index and weights version
match what the caller expects). A short write, ENOSPC, EIO or a mismatch is a
``DiskTierError`` naming what failed: the caller drops that KV (the request
re-prefills, with a logged reason); it never becomes a wrong token.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from seer.dataplane.kvpool import STATE_EMPTY, STATE_VALID, TAG_BYTES, TAG_DTYPE, KVPoolSegment

MAGIC = b"SEERKVD1"
HEADER_BYTES = 4096
_ALIGN = 4096
_MAX_IOV = 512  # well under IOV_MAX (1024)


class DiskTierError(RuntimeError):
    """The disk tier cannot hold or return a block (full, failing, corrupted)."""


def _round_up(n: int, align: int) -> int:
    return (n + align - 1) // align * align


def slots_for_bytes(bytes_per_block: int, num_bytes: int) -> int:
    return num_bytes // bytes_per_block


def _runs(a: list[int], b: list[int]) -> list[tuple[int, int, int]]:
    """(first a, first b, length) of the stretches where both lists step by one."""
    runs: list[tuple[int, int, int]] = []
    for x, y in zip(a, b):
        if runs and runs[-1][0] + runs[-1][2] == x and runs[-1][1] + runs[-1][2] == y:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((x, y, 1))
    return runs


def _is_direct(fd: int) -> bool:
    import fcntl

    return bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT)


class DiskTier:
    """One disk tier file, opened by the process that moves blocks (the control plane's
    host). ``create`` makes a new file (an old one of a dead owner is the caller's to
    remove); ``close`` closes and deletes it."""

    def __init__(self, path: Path, fd: int, fingerprint: str, bytes_per_block: int, num_slots: int) -> None:
        self.path = path
        self.fingerprint = fingerprint
        self.bytes_per_block = bytes_per_block
        self.num_slots = num_slots
        self._fd = fd  # header and tags (small, buffered)
        # Block bytes bypass the page cache where the file system allows it (O_DIRECT:
        # the pool mapping and every offset are page-aligned): the disk's own speed, and
        # spilled KV does not fill RAM again as cached pages. tmpfs and some others
        # refuse O_DIRECT; then the same calls go through the page cache.
        # O_DIRECT also needs whole pages per block (true of every real model's blocks).
        try:
            if bytes_per_block % _ALIGN:
                raise OSError("blocks are not whole pages")
            self._data_fd = os.open(path, os.O_RDWR | getattr(os, "O_DIRECT", 0))
        except OSError:
            self._data_fd = os.open(path, os.O_RDWR)
        self.direct = bool(getattr(os, "O_DIRECT", 0)) and _is_direct(self._data_fd)
        self._tags_offset = HEADER_BYTES
        self._data_offset = HEADER_BYTES + _round_up(num_slots * TAG_BYTES, _ALIGN)
        self.bytes_written = 0
        self.bytes_read = 0

    @classmethod
    def create(cls, directory: str | Path, pool: KVPoolSegment, num_bytes: int) -> DiskTier:
        """A tier of ``num_bytes`` (rounded down to whole blocks) in ``directory`` for
        blocks of ``pool``'s geometry. Space is reserved up front (``posix_fallocate``)
        so a full disk shows now, not in the middle of a spill."""
        directory = Path(directory)
        g = pool.geometry
        num_slots = slots_for_bytes(g.bytes_per_block, num_bytes)
        if num_slots < 1:
            raise DiskTierError(f"kv_pool.disk_gib = {num_bytes / 2**30:.3f} holds no block of "
                                f"{g.bytes_per_block} bytes; raise it or set it to 0 (no disk tier)")
        if not directory.is_dir():
            raise DiskTierError(f"kv_pool.disk_path = {str(directory)!r} is not a folder; create it or point "
                                "disk_path at an existing folder on the disk to use")
        path = directory / f"seer-kvdisk-{os.getpid()}.bin"
        size = HEADER_BYTES + _round_up(num_slots * TAG_BYTES, _ALIGN) + num_slots * g.bytes_per_block
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as exc:
            raise DiskTierError(f"kv_pool.disk_path: cannot create {path}: {exc.strerror}") from exc
        try:
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as exc:
                raise DiskTierError(f"kv_pool.disk_path: cannot reserve {size / 2**30:.2f} GiB in {directory}: "
                                    f"{exc.strerror}; lower kv_pool.disk_gib or free space") from exc
            header = MAGIC + g.fingerprint.encode()[:64].ljust(64, b"\0") + num_slots.to_bytes(8, "little")
            os.pwrite(fd, header, 0)
        except BaseException:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        return cls(path, fd, g.fingerprint, g.bytes_per_block, num_slots)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._data_fd)
            os.close(self._fd)
            self._fd = self._data_fd = -1
        self.path.unlink(missing_ok=True)

    # ------------------------------------------------------------------ tags
    def _read_tags(self, slots: list[int]) -> np.ndarray:
        out = np.zeros(len(slots), dtype=TAG_DTYPE)
        for i, s in enumerate(slots):
            raw = os.pread(self._fd, TAG_BYTES, self._tags_offset + s * TAG_BYTES)
            if len(raw) != TAG_BYTES:
                raise DiskTierError(f"short read of slot {s}'s tag in {self.path}")
            out[i] = np.frombuffer(raw, dtype=TAG_DTYPE)[0]
        return out

    def _write_tag(self, slot: int, tag: np.ndarray) -> None:
        if os.pwrite(self._fd, tag.tobytes(), self._tags_offset + slot * TAG_BYTES) != TAG_BYTES:
            raise DiskTierError(f"short write of slot {slot}'s tag in {self.path}")

    def invalidate(self, slots: list[int]) -> None:
        empty = np.zeros(1, dtype=TAG_DTYPE)
        for s in slots:
            self._write_tag(s, empty)

    # ------------------------------------------------------------------ moves
    def _check(self, pool: KVPoolSegment, blocks: list[int], slots: list[int]) -> None:
        if pool.geometry.fingerprint != self.fingerprint:
            raise DiskTierError("the pool's geometry differs from the disk tier's")
        if len(blocks) != len(slots):
            raise DiskTierError(f"{len(blocks)} pool blocks for {len(slots)} slots")
        if any(not 0 <= s < self.num_slots for s in slots) or any(not 0 <= b < pool.num_blocks for b in blocks):
            raise DiskTierError("a slot or pool block out of range")

    def _io(self, pool: KVPoolSegment, blocks: list[int], slots: list[int], write: bool) -> None:
        bpb = self.bytes_per_block
        flat = pool.blocks.reshape(pool.num_blocks, bpb)
        for s0, b0, n in _runs(slots, blocks):
            done = 0
            while done < n:
                k = min(n - done, _MAX_IOV)
                view = memoryview(flat[b0 + done:b0 + done + k].reshape(-1))
                offset = self._data_offset + (s0 + done) * bpb
                try:
                    got = (os.pwritev if write else os.preadv)(self._data_fd, [view], offset)
                except OSError as exc:
                    raise DiskTierError(f"{'write to' if write else 'read from'} {self.path} failed: "
                                        f"{exc.strerror}") from exc
                if got != k * bpb:
                    # A short transfer: finish it by plain offset arithmetic, or fail.
                    rest = view[got:]
                    while len(rest):
                        try:
                            m = (os.pwritev if write else os.preadv)(self._data_fd, [rest],
                                                                     offset + k * bpb - len(rest))
                        except OSError as exc:
                            raise DiskTierError(f"{'write to' if write else 'read from'} {self.path} failed: "
                                                f"{exc.strerror}") from exc
                        if m <= 0:
                            raise DiskTierError(f"{'write to' if write else 'read from'} {self.path} stopped "
                                                f"short ({len(rest)} bytes left)")
                        rest = rest[m:]
                done += k
        if write:
            self.bytes_written += len(blocks) * bpb
        else:
            self.bytes_read += len(blocks) * bpb

    def spill(self, pool: KVPoolSegment, blocks: list[int], slots: list[int], key: int, first_index: int,
              weights_version: int) -> None:
        """Copy sealed pool blocks (the request's blocks ``first_index`` on) to slots. The
        blocks must carry the expected tags and checksums; each slot's tag is written
        after its bytes. Raises ``DiskTierError``; then no slot of this call is valid."""
        self._check(pool, blocks, slots)
        bad = pool.first_bad(blocks, key, first_index, weights_version, verify_checksums=True)
        if bad is not None:
            raise DiskTierError(f"pool block {blocks[bad]} (index {first_index + bad}) does not hold "
                                f"request {key}'s KV; not spilled")
        tags = pool.tags[blocks].copy()
        try:
            self.invalidate(slots)
            self._io(pool, blocks, slots, write=True)
            for s, tag in zip(slots, tags):
                self._write_tag(s, tag)
        except (DiskTierError, OSError) as exc:
            try:
                self.invalidate(slots)
            except OSError:
                pass
            raise exc if isinstance(exc, DiskTierError) else DiskTierError(str(exc)) from exc

    def stage(self, pool: KVPoolSegment, slots: list[int], blocks: list[int], key: int, first_index: int,
              weights_version: int) -> int:
        """Copy slots back into pool blocks and seal the good ones; how many leading blocks
        are good (tags match and the bytes read match the checksum). Raises
        ``DiskTierError`` only if the file cannot be read at all."""
        self._check(pool, blocks, slots)
        pool.invalidate(blocks)  # whatever they held before is no one's KV any more
        tags = self._read_tags(slots)
        n_ok = len(slots)
        for i, tag in enumerate(tags):
            if (int(tag["state"]) != STATE_VALID or int(tag["key"]) != key
                    or int(tag["block_index"]) != first_index + i or int(tag["weights_version"]) != weights_version):
                n_ok = i
                break
        if not n_ok:
            return 0
        self._io(pool, blocks[:n_ok], slots[:n_ok], write=False)
        for i in range(n_ok):
            if pool.checksum(blocks[i]) != int(tags[i]["checksum"]):
                n_ok = i
                break
        pool.seal_with(blocks[:n_ok], tags["checksum"][:n_ok], key, first_index, weights_version)
        return n_ok


__all__ = ["DiskTier", "DiskTierError", "HEADER_BYTES", "MAGIC", "STATE_EMPTY", "slots_for_bytes"]
