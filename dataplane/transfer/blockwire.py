"""What a block server and a puller say to each other, whatever carries the bytes.

Owns the pull protocol shared by both transports (``tcp.py``, ``ucx.py``):

1. the puller sends a ``BlockRequest``: which source blocks, the request key, the
   index of the first block and the weights version it expects, and how the blocks
   split into *runs* (maximal stretches where source and destination block ids both
   grow by one -- each run moves as one transfer, block bytes are large);
2. the server checks the source tags with kvpool's own rule (range, state, key, block
   index, weights version) and answers a ``BlockReply``: ok + the raw 32-byte source
   tags, or an error naming the first bad block. Nothing else follows an error;
3. after an ok reply the server sends each run's bytes, in order, straight from the
   segment; the puller receives them straight into its destination blocks.

The puller then compares every received block's checksum with the source tag's, which
catches a block corrupted at the source, torn by a concurrent overwrite or damaged in
transit, and only then seals the destination tags (``seal_verified``).
"""

from __future__ import annotations

import msgspec
import numpy as np

from seer.dataplane.kvpool import STATE_EMPTY, STATE_VALID, TAG_DTYPE, KVPoolSegment

# Largest control frame either side accepts: a request for ~1M blocks fits.
MAX_FRAME_BYTES = 16 << 20


class BlockRequest(msgspec.Struct, kw_only=True):
    request_id: int
    key: int
    first_index: int
    weights_version: int
    src_blocks: bytes  # int32 little-endian
    run_lengths: list[int]  # blocks per run, in order; sums to len(src_blocks)
    fingerprint: str  # geometry of the puller's pool; the server refuses another one
    reply_address: bytes = b""  # ucx: the puller's worker address (the server connects back)
    reply_tag: int = 0  # ucx: tag of the reply; run i uses reply_tag + 1 + i


class BlockReply(msgspec.Struct, kw_only=True):
    request_id: int
    ok: bool
    error: str = ""
    fingerprint: str = ""  # geometry of the source pool
    bytes_per_block: int = 0
    tags: bytes = b""  # the source blocks' raw tags (TAG_DTYPE), in request order


class TransferError(RuntimeError):
    """A pull failed; the message is what PullResult.error reports."""


_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(BlockRequest)
_reply_decoder = msgspec.msgpack.Decoder(BlockReply)


def encode(msg: BlockRequest | BlockReply) -> bytes:
    return _encoder.encode(msg)


def decode_request(data: bytes | memoryview) -> BlockRequest:
    return _request_decoder.decode(data)


def decode_reply(data: bytes | memoryview) -> BlockReply:
    return _reply_decoder.decode(data)


def pack_blocks(blocks: list[int]) -> bytes:
    return np.asarray(blocks, dtype="<i4").tobytes()


def unpack_blocks(data: bytes) -> list[int]:
    return np.frombuffer(data, dtype="<i4").tolist()


def coalesce_runs(src_blocks: list[int], dst_blocks: list[int]) -> list[tuple[int, int, int]]:
    """``(src_start, dst_start, num_blocks)`` for each maximal run where both sides are
    consecutive: one transfer per run instead of one per block."""
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src_blocks, dst_blocks):
        if runs:
            s0, d0, n = runs[-1]
            if s == s0 + n and d == d0 + n:
                runs[-1] = (s0, d0, n + 1)
                continue
        runs.append((s, d, 1))
    return runs


def serve_request(segment: KVPoolSegment, request: BlockRequest) -> tuple[BlockReply, list[tuple[int, int]]]:
    """The server's half: check the request and the source tags. Returns the reply and,
    if it is ok, the ``(src_start, num_blocks)`` runs to send in order."""
    blocks = unpack_blocks(request.src_blocks)
    geometry = segment.geometry
    reply = BlockReply(request_id=request.request_id, ok=False, fingerprint=geometry.fingerprint,
                       bytes_per_block=geometry.bytes_per_block)
    if sum(request.run_lengths) != len(blocks) or any(n < 1 for n in request.run_lengths):
        reply.error = f"malformed request: run lengths {request.run_lengths[:8]} do not cover {len(blocks)} blocks"
        return reply, []
    if request.fingerprint != geometry.fingerprint:
        reply.error = (f"geometry mismatch: the source pool holds {geometry.fingerprint}, the destination "
                       f"{request.fingerprint}; blocks cannot move between them")
        return reply, []
    runs: list[tuple[int, int]] = []
    i = 0
    for n in request.run_lengths:
        start = blocks[i]
        if blocks[i:i + n] != list(range(start, start + n)):
            reply.error = f"malformed request: run at position {i} is not consecutive source blocks"
            return reply, []
        runs.append((start, n))
        i += n
    # The tag rule is kvpool's (checksums are checked by the puller on what it received).
    bad = segment.first_bad(blocks, request.key, request.first_index, request.weights_version,
                            verify_checksums=False)
    if bad is not None:
        reply.error = describe_bad_block(segment, blocks, bad, request)
        return reply, []
    reply.ok = True
    reply.tags = segment.tags[np.asarray(blocks, dtype=np.int64)].tobytes()
    return reply, runs


def describe_bad_block(segment: KVPoolSegment, blocks: list[int], i: int, request: BlockRequest) -> str:
    block = blocks[i]
    where = f"source block {block} (position {i}, block index {request.first_index + i})"
    if not 0 <= block < segment.num_blocks:
        return f"{where} is out of range: the source pool has {segment.num_blocks} blocks"
    tag = segment.tags[block]
    if int(tag["state"]) != STATE_VALID:
        return f"{where} holds no saved KV (state {int(tag['state'])})"
    if int(tag["key"]) != request.key:
        return f"{where} belongs to key {int(tag['key'])}, not {request.key}"
    if int(tag["block_index"]) != request.first_index + i:
        return f"{where} holds block index {int(tag['block_index'])} of the key"
    return (f"{where} was saved under weights version {int(tag['weights_version'])}, "
            f"the pull asks for {request.weights_version}")


def check_reply(reply: BlockReply, dst: KVPoolSegment, num_blocks: int) -> np.ndarray:
    """The puller's check of an ok reply before any byte lands; returns the source tags."""
    if not reply.ok:
        raise TransferError(reply.error)
    if reply.fingerprint != dst.geometry.fingerprint:  # the server checks this too
        raise TransferError(f"geometry mismatch: the source pool holds {reply.fingerprint}, "
                            f"this pool {dst.geometry.fingerprint}; blocks cannot move between them")
    tags = np.frombuffer(reply.tags, dtype=TAG_DTYPE)
    if len(tags) != num_blocks:
        raise TransferError(f"the server sent {len(tags)} tags for {num_blocks} blocks")
    return tags


def verify_received(dst: KVPoolSegment, dst_blocks: list[int], src_tags: np.ndarray,
                    src_blocks: list[int], request: BlockRequest, verify: bool) -> list[int]:
    """Re-check the source tags the server sent and, with ``verify``, each received
    block's checksum against them; returns the checksums to seal with."""
    checksums: list[int] = []
    for i, (src_tag, d) in enumerate(zip(src_tags, dst_blocks)):
        if (int(src_tag["state"]) != STATE_VALID or int(src_tag["key"]) != request.key
                or int(src_tag["block_index"]) != request.first_index + i
                or int(src_tag["weights_version"]) != request.weights_version):
            raise TransferError(f"source block {src_blocks[i]} (position {i}): the server sent a tag that does "
                                "not match the pull; refusing it")
        expected = int(src_tag["checksum"])
        if verify:
            got = dst.checksum(d)
            if got != expected:
                raise TransferError(f"source block {src_blocks[i]} (position {i}, block index "
                                    f"{request.first_index + i}) arrived with checksum {got:#x}, its tag says "
                                    f"{expected:#x}: corrupted at the source, overwritten during the pull or "
                                    "damaged in transit")
        checksums.append(expected)
    return checksums


def seal_verified(dst: KVPoolSegment, dst_blocks: list[int], key: int, first_index: int,
                  weights_version: int, checksums: list[int]) -> None:
    """Seal destination tags like ``KVPoolSegment.seal`` (same fields, same order: state
    cleared first, set valid last) with checksums already verified against the received
    bytes, instead of summing every block a second time."""
    for i, (block, checksum) in enumerate(zip(dst_blocks, checksums)):
        tag = dst.tags[block]
        tag["state"] = STATE_EMPTY
        tag["key"] = key
        tag["block_index"] = first_index + i
        tag["weights_version"] = weights_version
        tag["checksum"] = checksum
        tag["state"] = STATE_VALID
