"""Same-host stand-ins for engines and host agents on several "hosts", speaking the real
wire protocol over real ZeroMQ sockets, with real KV pool segments in /dev/shm.

* ``FakeKVEngine``: generates a deterministic token stream (next token from the last
  three), so any chunking gives the same sample; keeps the pool contract of the vLLM
  connector: a chunk that runs to its budget with ``save`` writes the KV of every token
  but its last into its blocks and seals them; a chunk with valid tokens in the pool
  checks the tags *and* that each block holds exactly the bytes its tokens imply, and
  reports them as loaded. A block that is wrong is a test failure, not a re-prefill.
* ``FakeAgent``: registers a host's segment and executes ``PullBlocks`` by copying
  blocks between two segments of this machine (the "address" is the source segment's
  name) with kvpool's own tag checks and seal -- what a UCX/TCP agent does, minus the wire.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field

import numpy as np
import zmq

from seer.protocol import PoolGeometry
from seer.dataplane.kvpool import KVPoolSegment
from seer.protocol import (
    JOIN_ENGINE_ID,
    PROTOCOL_VERSION,
    AgentCommand,
    AgentHello,
    ChunkFinished,
    ChunkTask,
    ControlMessage,
    EngineCapabilities,
    EngineHello,
    HelloAccepted,
    PullBlocks,
    PullDone,
    Shutdown,
    pack_logprobs,
    pack_token_ids,
    unpack_token_ids,
)
from seer.wire import Codec, make_socket

GEOM = PoolGeometry(num_layers=2, num_kv_heads=1, head_size=8, block_size=16, dtype="float32")


def next_token(context: list[int]) -> int:
    return 3 + (context[-1] * 7 + context[-2] * 3 + context[-3] + len(context)) % 250


def reference(prompt: list[int], max_tokens: int) -> list[int]:
    out = list(prompt)
    for _ in range(max_tokens):
        out.append(next_token(out))
    return out[len(prompt):]


def block_bytes(tokens: list[int], index: int, geometry: PoolGeometry = GEOM) -> np.ndarray:
    """What the KV of tokens [index*bs, (index+1)*bs) "is": a pure function of those tokens."""
    bs = geometry.block_size
    chunk = np.zeros(bs, dtype=np.uint32)
    part = tokens[index * bs:(index + 1) * bs]
    chunk[:len(part)] = part
    data = np.resize(chunk * np.uint32(2654435761) + np.uint32(index), geometry.bytes_per_block // 4)
    return data.view(np.uint8).reshape(geometry.num_layers, geometry.layer_bytes)


class _Threaded:
    """A fake peer that runs ``_run`` on a thread until ``stop``."""

    def start(self):
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)  # type: ignore[attr-defined]
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)


@dataclass
class FakeKVEngine(_Threaded):
    address: str
    host_id: str
    geometry: PoolGeometry = GEOM
    max_model_len: int = 4096
    engine_id: int = JOIN_ENGINE_ID
    loaded_tokens: int = 0
    errors: list[str] = field(default_factory=list)

    def _run(self) -> None:
        ctx = zmq.Context()
        codec: Codec = Codec(ControlMessage)
        sock = make_socket(ctx, zmq.DEALER, self.address, bind=False, identity=f"join-{os.urandom(6).hex()}".encode())
        caps = EngineCapabilities(backend="vllm", model="fake", dtype="float32", max_model_len=self.max_model_len,
                                  vocab_size=259, kv_capacity_tokens=100_000, block_size=self.geometry.block_size,
                                  kv_geometry=self.geometry)
        sock.send_multipart(codec.encode(EngineHello(engine_id=JOIN_ENGINE_ID, protocol_version=PROTOCOL_VERSION,
                                                     pid=os.getpid(), capabilities=caps, weights_version=0,
                                                     host_id=self.host_id)))
        pools: dict[str, KVPoolSegment] = {}
        try:
            while not self._stop.is_set():
                if not sock.poll(100):
                    continue
                msg = codec.decode(sock.recv_multipart())
                if isinstance(msg, HelloAccepted):
                    self.engine_id = msg.engine_id
                elif isinstance(msg, ChunkTask):
                    try:
                        sock.send_multipart(codec.encode(self._run_chunk(msg, pools)))
                    except Exception as exc:  # noqa: BLE001 - recorded, the test fails on it
                        self.errors.append(f"{type(exc).__name__}: {exc}")
                elif isinstance(msg, Shutdown):
                    return
        finally:
            sock.close(0)
            ctx.term()
            for seg in pools.values():
                seg.close()

    def _run_chunk(self, task: ChunkTask, pools: dict[str, KVPoolSegment]) -> ChunkFinished:
        context = unpack_token_ids(task.prompt_token_ids)
        kv = task.kv
        loaded = 0
        bs = self.geometry.block_size
        if kv is not None and kv.valid_tokens > 0:
            seg = pools.get(kv.pool_name) or pools.setdefault(kv.pool_name, KVPoolSegment.attach(kv.pool_name))
            blocks = unpack_token_ids(kv.pool_blocks)
            usable = min(kv.valid_tokens, len(context) - 1)
            full = blocks[:-(-usable // bs)]
            bad = seg.first_bad(full, kv.key, 0, kv.weights_version)
            if bad is not None:
                raise AssertionError(f"pool block {full[bad]} (index {bad}) of key {kv.key} fails its tag check")
            saved_tokens = context[:kv.valid_tokens]  # what the saving engine wrote
            for i, block in enumerate(full):
                if not np.array_equal(seg.blocks[block], block_bytes(saved_tokens, i, self.geometry)):
                    raise AssertionError(f"pool block {block} (index {i}) holds KV of other tokens")
            loaded = usable
            self.loaded_tokens += loaded
        out = list(context)
        n = task.sampling.max_tokens
        for _ in range(n):
            out.append(next_token(out))
        new = out[len(context):]
        saved = 0
        if kv is not None and kv.save:
            seg = pools.get(kv.pool_name) or pools.setdefault(kv.pool_name, KVPoolSegment.attach(kv.pool_name))
            saved = len(out) - 1
            blocks = unpack_token_ids(kv.pool_blocks)
            first = kv.valid_tokens // bs
            last = -(-saved // bs)
            for i in range(first, last):
                seg.blocks[blocks[i]] = block_bytes(out[:saved], i, self.geometry)
            seg.seal(blocks[first:last], kv.key, first, kv.weights_version)
        return ChunkFinished(engine_id=self.engine_id, task_id=task.task_id, token_ids=pack_token_ids(new),
                             logprobs=pack_logprobs([-0.5] * len(new)), finish_reason="length",
                             num_prompt_tokens=len(context), num_cached_tokens=loaded, elapsed_ms=1.0,
                             kv_loaded_tokens=loaded, kv_saved_tokens=saved)


@dataclass
class FakeAgent(_Threaded):
    address: str
    host_id: str
    segment: KVPoolSegment
    transport: str = "tcp"
    fail: bool = False  # answer every pull with ok=False
    silent: bool = False  # never answer a pull (a wedged agent)
    num_pulls: int = 0

    def _run(self) -> None:
        ctx = zmq.Context()
        codec: Codec = Codec(AgentCommand)
        sock = make_socket(ctx, zmq.DEALER, self.address, bind=False, identity=f"agent-{os.urandom(6).hex()}".encode())
        seg = self.segment
        sock.send_multipart(codec.encode(AgentHello(
            host_id=self.host_id, protocol_version=PROTOCOL_VERSION, pid=os.getpid(), pool_name=seg.path.name,
            geometry=seg.geometry, num_blocks=seg.num_blocks, transport=self.transport, address=seg.path.name)))
        sources: dict[str, KVPoolSegment] = {}
        try:
            while not self._stop.is_set():
                if not sock.poll(100):
                    continue
                msg = codec.decode(sock.recv_multipart())
                if isinstance(msg, PullBlocks) and self.silent:
                    self.num_pulls += 1
                elif isinstance(msg, PullBlocks):
                    sock.send_multipart(codec.encode(self._pull(msg, sources)))
        finally:
            sock.close(0)
            ctx.term()
            for s in sources.values():
                s.close()

    def _pull(self, cmd: PullBlocks, sources: dict[str, KVPoolSegment]) -> PullDone:
        self.num_pulls += 1
        if self.fail:
            return PullDone(transfer_id=cmd.transfer_id, ok=False, error="fake agent told to fail")
        src = sources.get(cmd.address) or sources.setdefault(cmd.address, KVPoolSegment.attach(cmd.address))
        src_blocks, dst_blocks = unpack_token_ids(cmd.src_blocks), unpack_token_ids(cmd.dst_blocks)
        bad = src.first_bad(src_blocks, cmd.key, 0, cmd.weights_version, verify_checksums=cmd.verify)
        if bad is not None:
            return PullDone(transfer_id=cmd.transfer_id, ok=False, error=f"source block index {bad} fails its check")
        for s, d in zip(src_blocks, dst_blocks):
            self.segment.blocks[d] = src.blocks[s]
        self.segment.seal(dst_blocks, cmd.key, 0, cmd.weights_version)
        return PullDone(transfer_id=cmd.transfer_id, ok=True, num_bytes=len(dst_blocks) * src.geometry.bytes_per_block,
                        seconds=0.001)
