"""The shared-memory SPSC ring (dataplane/shmring.py): record framing, wrap-around, a
full ring that refuses without losing anything, a second process writing 100k records,
and the reader's back-off.

Rings are real /dev/shm files with unique names; the ``ring_names`` fixture unlinks every
one it handed out and fails the test if one was left behind by the code under test.
"""

from __future__ import annotations

import multiprocessing
import os
import secrets
from pathlib import Path

import pytest

from seer.dataplane.shmring import (
    HEADER_BYTES,
    MAGIC,
    PollBackoff,
    RingError,
    ShmRing,
    record_bytes,
    ring_path,
)

SHM = Path("/dev/shm")


@pytest.fixture
def ring_name():
    names: list[str] = []

    def make() -> str:
        name = f"seer-test-ring-{os.getpid()}-{secrets.token_hex(4)}"
        names.append(name)
        return name

    yield make
    for name in names:
        (SHM / name).unlink(missing_ok=True)


def test_records_come_out_in_order_and_intact(ring_name):
    """Records of any length (including empty) are read back byte-identical, oldest first."""
    name = ring_name()
    writer = ShmRing.create(name, 4096)
    reader = ShmRing.attach(name)
    records = [b"", b"a", b"bc" * 3, bytes(range(256)) * 3, b"x" * 13]
    assert writer.try_put_many(records) == len(records)
    assert reader.drain() == records
    assert reader.drain() == []
    assert writer.num_bytes_used == 0
    writer.close()
    reader.close()
    writer.unlink()
    assert not (SHM / name).exists()


def test_wrap_around_keeps_records_intact(ring_name):
    """Records that straddle the end of the data area are split and rejoined correctly,
    over many laps with lengths that do not divide the capacity."""
    ring = ShmRing.create(ring_name(), 4096)
    expected = []
    got = []
    for i in range(2000):
        record = bytes([i % 251]) * (1 + (i * 37) % 700)
        while not ring.try_put(record):
            got.extend(ring.drain(max_records=3))
        expected.append(record)
    got.extend(ring.drain())
    assert got == expected
    assert ring._tail.value > 50 * ring.capacity  # many laps around the ring
    ring.close()
    ring.unlink()


def test_full_ring_refuses_and_loses_nothing(ring_name):
    """When a record does not fit, try_put returns False and writes nothing; once the
    reader drains, the same record goes in. try_put_many stops at the first misfit."""
    ring = ShmRing.create(ring_name(), 4096)
    record = b"r" * 1000  # 1008 ring bytes each: four fit into 4096, a fifth does not
    assert record_bytes(len(record)) == 1008
    batch = [record + bytes([i]) for i in range(6)]
    written = ring.try_put_many(batch)
    assert written == 4
    used = ring.num_bytes_used
    assert not ring.try_put(batch[4])
    assert ring.num_bytes_used == used
    assert ring.drain(max_records=1) == batch[:1]
    assert ring.try_put_many(batch[4:]) == 1  # room for one more, not two
    assert ring.drain() == batch[1:5]
    assert ring.try_put(batch[5])
    assert ring.drain() == batch[5:]
    ring.close()
    ring.unlink()


def test_record_larger_than_ring_is_an_error(ring_name):
    """A record that could never fit raises instead of returning False forever."""
    ring = ShmRing.create(ring_name(), 4096)
    assert ring.try_put(b"y" * ring.max_record_bytes)
    ring.drain()
    with pytest.raises(RingError, match="can never fit"):
        ring.try_put(b"y" * (ring.max_record_bytes + 1))
    ring.close()
    ring.unlink()


def test_attach_refuses_missing_foreign_and_small_files(ring_name):
    """Attaching checks existence, size and magic, and names must be plain file names."""
    with pytest.raises(RingError, match="does not exist"):
        ShmRing.attach(ring_name())
    foreign = ring_name()
    (SHM / foreign).write_bytes(b"\0" * (HEADER_BYTES + 8192))
    with pytest.raises(RingError, match="bad magic"):
        ShmRing.attach(foreign)
    small = ring_name()
    (SHM / small).write_bytes(MAGIC + b"\0" * 100)
    with pytest.raises(RingError, match="too small"):
        ShmRing.attach(small)
    with pytest.raises(RingError, match="plain file name"):
        ring_path("a/b")
    with pytest.raises(RingError, match="capacity"):
        ShmRing.create(ring_name(), 100)


def test_create_refuses_an_existing_name(ring_name):
    """Two creators cannot share a name (O_EXCL): a ring has one producer and one consumer."""
    name = ring_name()
    ring = ShmRing.create(name, 4096)
    with pytest.raises(FileExistsError):
        ShmRing.create(name, 4096)
    ring.close()
    ring.close()  # idempotent
    ring.unlink()


def test_corrupt_length_is_detected(ring_name):
    """A published length that exceeds what was published raises instead of reading garbage."""
    ring = ShmRing.create(ring_name(), 4096)
    assert ring.try_put(b"hello")
    ring._data[0:4] = (5000).to_bytes(4, "little")
    with pytest.raises(RingError, match="corrupt record length"):
        ring.drain()
    ring.close()
    ring.unlink()


def _produce(name: str, count: int) -> None:
    ring = ShmRing.attach(name)
    backoff = PollBackoff(min_s=0.0002, max_s=0.005)
    for i in range(count):
        record = i.to_bytes(4, "little") * (1 + i % 5)
        while not ring.try_put(record):
            backoff.idle()
        backoff.reset()
    ring.close()


def test_second_process_writes_100k_records_read_in_order(ring_name):
    """A spawned producer process writes 100,000 records through a small ring (it fills
    many times); the reader gets every one, in order, with the right bytes."""
    name = ring_name()
    ring = ShmRing.create(name, 16384)
    count = 100_000
    proc = multiprocessing.get_context("spawn").Process(target=_produce, args=(name, count))
    proc.start()
    backoff = PollBackoff(min_s=0.0002, max_s=0.005)
    expected = 0
    try:
        while expected < count:
            records = ring.drain()
            if not records:
                assert proc.exitcode in (None, 0), f"producer exited with {proc.exitcode}"
                backoff.idle()
                continue
            backoff.reset()
            for record in records:
                assert record == expected.to_bytes(4, "little") * (1 + expected % 5)
                expected += 1
    finally:
        proc.join(timeout=120)
        if proc.is_alive():
            proc.kill()
    assert proc.exitcode == 0
    assert expected == count
    assert ring.drain() == []
    ring.close()
    ring.unlink()


def test_backoff_doubles_while_idle_and_resets_after_work():
    """The reader sleeps 0.5 ms, 1 ms, 2 ms ... capped at 20 ms; work resets it."""
    slept: list[float] = []
    backoff = PollBackoff(sleep=slept.append)
    for _ in range(8):
        backoff.idle()
    assert slept == [0.0005, 0.001, 0.002, 0.004, 0.008, 0.016, 0.02, 0.02]
    backoff.reset()
    backoff.idle()
    assert slept[-1] == 0.0005
    with pytest.raises(ValueError):
        PollBackoff(min_s=0.0)
