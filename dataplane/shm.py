"""Named POSIX shared-memory files under /dev/shm: the part every Seer segment shares.

Owns naming (a plain file name under /dev/shm), creating a file of a given size and
mapping it (never over an existing one), and attaching to an existing one with the
checks that come before any format is read: it exists, it is large enough, and it starts
with the expected magic. The formats themselves (the KV pool in ``kvpool.py``, the
draft rings in ``shmring.py``) stay with their owners; each passes its own error class,
so their messages and exceptions are unchanged.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path

SHM_DIR = Path("/dev/shm")
MAGIC_BYTES = 8  # every Seer segment starts with an 8-byte magic, written last by its creator


def shm_path(name: str, what: str, error: type[Exception]) -> Path:
    """``/dev/shm/<name>``; ``what`` ("pool", "ring") names the segment in the error."""
    if not name or "/" in name:
        raise error(f"invalid {what} name {name!r}: a plain file name under /dev/shm is expected")
    return SHM_DIR / name


def create_mapped(path: Path, size: int) -> mmap.mmap:
    """A new zero-filled file of ``size`` bytes at ``path``, mapped read-write. Fails if
    the file exists; removes it again if it cannot be sized or mapped."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, size)
        mm = mmap.mmap(fd, size)
    except BaseException:
        os.close(fd)
        path.unlink(missing_ok=True)
        raise
    os.close(fd)
    return mm


def attach_mapped(path: Path, *, magic: bytes, min_size: int, error: type[Exception], missing: str, kind: str,
                  magic_hint: str = "", populate: bool = False) -> tuple[mmap.mmap, int]:
    """Map an existing segment and check its size and magic; returns (map, file size).

    ``missing`` is the whole message when the file does not exist; ``kind`` ("a Seer KV
    pool") completes "... is not <kind> (too small)" and "... is not <kind> of this
    version (bad magic<magic_hint>)". ``populate`` maps every page now (MAP_POPULATE): a
    process that will copy through the whole segment pays its page faults here, once,
    instead of inside its first copies (they ran at half speed, docs/kv-pool.md)."""
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError as exc:
        raise error(missing) from exc
    try:
        size = os.fstat(fd).st_size
        if size < min_size:
            raise error(f"{path} is not {kind} (too small)")
        flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
        mm = mmap.mmap(fd, size, flags=flags)
    finally:
        os.close(fd)
    if mm[0:MAGIC_BYTES] != magic:
        mm.close()
        raise error(f"{path} is not {kind} of this version (bad magic{magic_hint})")
    return mm, size


__all__ = ["MAGIC_BYTES", "SHM_DIR", "attach_mapped", "create_mapped", "shm_path"]
