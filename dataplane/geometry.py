"""The shape of one KV pool block (no numpy, no torch: the wire schema imports it).

Engines report it on hello; the control plane sizes the pool with it; a pool and an
engine whose fingerprints differ must never exchange blocks.
"""

from __future__ import annotations

import msgspec

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


class PoolGeometry(msgspec.Struct, frozen=True, kw_only=True):
    """What one pool block holds: ``block_size`` tokens x ``num_layers`` layers of
    ``num_kv_heads`` heads of K and V, each ``head_size`` elements of ``dtype``."""

    num_layers: int
    num_kv_heads: int
    head_size: int
    block_size: int
    dtype: str
    layout: str = "paged-v1"  # the engine's page format; part of the fingerprint

    @property
    def layer_bytes(self) -> int:
        return self.num_kv_heads * self.block_size * 2 * self.head_size * _DTYPE_BYTES[self.dtype]

    @property
    def bytes_per_block(self) -> int:
        return self.num_layers * self.layer_bytes

    @property
    def bytes_per_token(self) -> int:
        return self.bytes_per_block // self.block_size

    @property
    def fingerprint(self) -> str:
        return (f"{self.layout}:L{self.num_layers}:H{self.num_kv_heads}:D{self.head_size}:"
                f"B{self.block_size}:{self.dtype}")
