"""The weights segment (seer/weights_segment.py): layout, the writer's two segments, the
reader's generation checks, source strings; and the trainer-side tensor bytes
(integrations/weights.py)."""

from __future__ import annotations

import os
import subprocess

import numpy as np
import pytest

from seer.controlplane.weights import Weights
from seer.weights_segment import (
    ALIGN_BYTES,
    PREFIX,
    SHM_DIR,
    SegmentReader,
    SegmentSource,
    SegmentWriter,
    WeightsSegmentError,
    parse_source,
    plan_layout,
    remove_orphans,
    source_exists,
)


def arrays(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"embed.weight": rng.standard_normal((7, 5), dtype=np.float32),
            "layers.0.w": rng.standard_normal((3,), dtype=np.float32),
            "layers.0.b": rng.integers(0, 9, (2, 2)).astype(np.int64)}


def items(tensors: dict[str, np.ndarray]):
    codes = {np.dtype(np.float32): "F32", np.dtype(np.int64): "I64"}
    return [(name, codes[a.dtype], a.shape, memoryview(a)) for name, a in tensors.items()]


def read(source: SegmentSource) -> dict[str, np.ndarray]:
    reader = SegmentReader(source)
    try:
        dtypes = {"F32": np.float32, "I64": np.int64}
        return {e.name: np.frombuffer(reader.buffer, dtypes[e.dtype], e.num_bytes // np.dtype(dtypes[e.dtype]).itemsize,
                                      e.offset).reshape(e.shape).copy() for e in reader.entries}
    finally:
        reader.close()


@pytest.fixture
def writer():
    w = SegmentWriter(prefix=f"seer-test-wt-{os.getpid()}")
    yield w
    w.close()


def test_a_written_segment_reads_back_every_tensor_bit_for_bit(writer):
    """Each tensor comes back with its name, dtype, shape and bytes, in the order written."""
    tensors = arrays(0)
    source = writer.write(items(tensors))
    got = read(source)
    assert list(got) == list(tensors)
    for name in tensors:
        assert got[name].dtype == tensors[name].dtype and np.array_equal(got[name], tensors[name])


def test_layout_aligns_every_tensor_and_leaves_room_for_the_manifest():
    """Offsets are 64-byte aligned and lie after the manifest; the size covers the last tensor."""
    manifest, entries, size = plan_layout([("a", "F32", (3,)), ("b", "BF16", (5, 7)), ("c", "I8", (1,))])
    assert all(e.offset % ALIGN_BYTES == 0 for e in entries)
    assert 24 + len(manifest) <= entries[0].offset
    assert all(a.offset + a.num_bytes <= b.offset for a, b in zip(entries, entries[1:]))
    assert size >= entries[-1].offset + entries[-1].num_bytes


def test_writes_alternate_between_two_segments_only_once_accepted(writer):
    """The next write goes to the other segment after accepted(); after a refused update
    it reuses the same one, so the accepted segment stays intact."""
    first = writer.write(items(arrays(1)))
    writer.accepted()
    second = writer.write(items(arrays(2)))
    assert second.segment != first.segment and second.generation == first.generation + 1
    # the update of `second` failed (no accepted()): the retry overwrites `second`'s segment
    retry = writer.write(items(arrays(3)))
    assert retry.segment == second.segment
    assert all(np.array_equal(read(first)[k], v) for k, v in arrays(1).items())  # untouched
    writer.accepted()
    assert writer.write(items(arrays(4))).segment == first.segment


def test_a_reader_refuses_a_segment_rewritten_since_its_source(writer):
    """A source names one write: once the writer wrote that segment again, reading it is an error."""
    old = writer.write(items(arrays(1)))
    writer.write(items(arrays(2)))  # not accepted: same segment, next generation
    with pytest.raises(WeightsSegmentError, match="generation"):
        SegmentReader(old)


def test_a_reader_refuses_a_segment_being_written(writer):
    """While the writer copies, the generation is 0: a reader that maps it then refuses it."""
    source = writer.write(items(arrays(1)))
    reader = SegmentReader(source)
    try:
        segment = writer._segments[source.segment]
        segment.buf[8:16] = (0).to_bytes(8, "little")  # what write() does before copying
        with pytest.raises(WeightsSegmentError, match="being rewritten"):
            reader.check_generation()
    finally:
        reader.close()


def test_new_shapes_make_a_new_segment(writer):
    """Tensors of another layout replace the segment (the manifest never changes in place)."""
    writer.write(items(arrays(1)))
    bigger = {"embed.weight": np.ones((9, 5), np.float32)}
    source = writer.write(items(bigger))
    assert read(source)["embed.weight"].shape == (9, 5)


def test_wrong_byte_count_is_refused(writer):
    """A buffer that does not hold dtype x shape bytes is an error naming the tensor."""
    with pytest.raises(WeightsSegmentError, match="'w'"):
        writer.write([("w", "F32", (4,), memoryview(np.zeros(3, np.float32)))])


def test_close_unlinks_both_segments(writer):
    """The writer removes what it created; a source of a closed writer no longer exists."""
    a = writer.write(items(arrays(1)))
    writer.accepted()
    b = writer.write(items(arrays(2)))
    assert source_exists(str(a)) and source_exists(str(b))
    writer.close()
    assert not (SHM_DIR / a.segment).exists() and not (SHM_DIR / b.segment).exists()
    with pytest.raises(WeightsSegmentError, match="does not exist"):
        SegmentReader(a)


def _dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_segments_of_writers_that_are_gone_are_removed_and_no_others(tmp_path):
    dead = _dead_pid()
    names = [f"seer-weights-{dead}-0a1b-a", f"seer-weights-{dead}-0a1b-b",  # a SIGKILLed trainer's pair
             f"seer-weights-{os.getpid()}-beef-a",  # this process's own
             f"seer-weights-{os.getppid()}-beef-a",  # a live writer
             "seer-weights-notapid-a", "seer-kv-1-x", "psm_1234"]  # not a writer's name: not ours
    for name in names:
        (tmp_path / name).write_bytes(b"x")
    removed = remove_orphans(tmp_path)
    assert sorted(removed) == sorted(names[:2])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names[2:])


def test_a_new_writer_removes_the_segments_a_killed_writer_left():
    leftover = SHM_DIR / f"{PREFIX}{_dead_pid()}-{os.urandom(4).hex()}-a"
    leftover.write_bytes(b"\0" * 64)
    try:
        writer = SegmentWriter()
        writer.close()
        assert not leftover.exists()
    finally:
        leftover.unlink(missing_ok=True)


def test_a_foreign_file_is_not_a_segment(tmp_path):
    """A file in /dev/shm that is not a weights segment is refused by its magic."""
    name = f"seer-test-foreign-{os.getpid()}"
    (SHM_DIR / name).write_bytes(b"NOTASEGMENT" + bytes(64))
    try:
        with pytest.raises(WeightsSegmentError, match="bad magic"):
            SegmentReader(SegmentSource(name, 1))
    finally:
        (SHM_DIR / name).unlink()


@pytest.mark.parametrize("text", ["shm://", "shm://x", "shm://x?generation=0", "shm://a/b?generation=1",
                                  "shm://x?generation=-1", "shm://x?generation=abc"])
def test_malformed_segment_sources_are_refused(text):
    """A shm:// source needs a plain segment name and a generation >= 1."""
    with pytest.raises(WeightsSegmentError, match="shm://<segment>"):
        parse_source(text)
    assert not source_exists(text)


def test_sources_round_trip_and_paths_are_not_segments():
    """str(SegmentSource) parses back to itself; a filesystem path is not a segment."""
    source = SegmentSource("seer-weights-1-a", 12)
    assert parse_source(str(source)) == source
    assert parse_source("/tmp/model.safetensors") is None


def test_the_control_plane_refuses_an_update_from_a_missing_segment(writer):
    """update_weights names a segment: refused as bad_weights_path unless it exists on the host."""
    weights = Weights()
    source = writer.write(items(arrays(1)))
    assert weights.refuse_update(str(source), num_sessions=0, rollouts_running=False, engines_updating=False,
                                 ready_ids=[0]) is None
    refusal = weights.refuse_update("shm://seer-no-such-segment?generation=1", num_sessions=0,
                                    rollouts_running=False, engines_updating=False, ready_ids=[0])
    assert refusal is not None and refusal.code == "bad_weights_path"


def test_policy_tensors_send_a_tied_weight_once_and_bytes_cover_bfloat16():
    """The trainer sends a tied tensor under its first name only; bfloat16 travels as its raw bytes."""
    torch = pytest.importorskip("torch")
    from seer.integrations.weights import policy_tensors, segment_items

    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(4, 3)
            self.head = torch.nn.Linear(3, 4, bias=False)
            self.head.weight = self.embed.weight
            self.norm = torch.nn.Parameter(torch.ones(3, dtype=torch.bfloat16))

    model = Tied()
    names = [name for name, _ in policy_tensors(model)]
    assert names == ["norm", "embed.weight"]
    rows = {name: (code, shape, bytes(data)) for name, code, shape, data in segment_items(policy_tensors(model))}
    assert rows["norm"][:2] == ("BF16", (3,)) and rows["norm"][2] == model.norm.detach().view(torch.uint8).numpy().tobytes()
    assert rows["embed.weight"][:2] == ("F32", (4, 3))


def test_weight_sync_sends_through_shared_memory_unless_given_a_folder(tmp_path):
    """SeerWeightSync uses a segment by default, a safetensors file when weights_dir is set; other transports are refused."""
    pytest.importorskip("transformers")
    from seer.integrations.batching import SeerIntegrationError
    from seer.integrations.trl import SeerRollout

    rollout = SeerRollout(address="ipc:///nonexistent")
    assert rollout.weight_sync().transport == "shm"
    assert rollout.weight_sync(weights_dir=str(tmp_path)).transport == "file"
    assert rollout.weight_sync(transport="file").transport == "file"
    with pytest.raises(SeerIntegrationError, match="transport='nccl'"):
        rollout.weight_sync(transport="nccl")
