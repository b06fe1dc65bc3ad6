"""The typed values that cross vLLM's ``kv_transfer_params`` between Seer's backend and
Seer's KV connector.

Owns two Structs and their conversion at the vLLM boundary. vLLM carries
``kv_transfer_params`` as a plain dict (msgpack between its processes), so each side
converts exactly once: the backend puts ``to_params(PoolTransfer)`` into the request,
the connector reads it back with ``from_params``; the connector returns
``PoolTransferResult.to_params()`` from ``request_finished`` and the backend reads the
finished request's dict with ``PoolTransferResult.from_params``. Imports no vLLM.
"""

from __future__ import annotations

from typing import Any

import msgspec

PARAMS_KEY = "seer"  # kv_transfer_params[PARAMS_KEY] holds the descriptor


class PoolTransfer(msgspec.Struct, kw_only=True, frozen=True):
    """One chunk's pool descriptor as the connector sees it (``KVDescriptor`` with its
    block list unpacked)."""

    pool_name: str  # the /dev/shm segment
    key: int  # the logical request's pool key (in every block's tag)
    weights_version: int  # blocks saved under other weights are never loaded
    pool_blocks: list[int]  # pool block of the request's tokens [i*bs, (i+1)*bs)
    valid_tokens: int  # tokens [0, valid_tokens) are in the pool
    save: bool  # save this chunk's KV at its end
    save_each_step: bool = False  # save as it goes (a trajectory's turn may stop at any step)
    min_load_tokens: int  # load only if the engine's cache lacks at least this many

    def to_params(self) -> dict[str, Any]:
        """The request's ``kv_transfer_params`` (plain builtins, as vLLM carries them)."""
        return {PARAMS_KEY: msgspec.to_builtins(self)}

    @classmethod
    def from_params(cls, params: dict[str, Any] | None) -> PoolTransfer | None:
        """The descriptor in a vLLM request's ``kv_transfer_params``; None if it has none."""
        raw = (params or {}).get(PARAMS_KEY)
        return msgspec.convert(raw, cls) if raw else None


def _seer_prefixed(name: str) -> str:
    return f"seer_{name}"


class PoolTransferResult(msgspec.Struct, kw_only=True, frozen=True, rename=_seer_prefixed):
    """What the connector did for one finished request (keys ``seer_*`` in vLLM's
    ``RequestOutput.kv_transfer_params``)."""

    loaded_tokens: int = 0  # tokens copied from the pool and used
    load_failed_tokens: int = 0  # tokens planned for load that failed their check (recomputed)
    saved_tokens: int = 0  # the pool now holds tokens [0, saved_tokens) (0: nothing new)
    load_ms: float = 0.0

    def to_params(self) -> dict[str, Any]:
        return msgspec.to_builtins(self)

    @classmethod
    def from_params(cls, params: dict[str, Any] | None) -> PoolTransferResult:
        """A finished request's result; all zeros when the connector said nothing."""
        return msgspec.convert(params or {}, cls, strict=False)


__all__ = ["PARAMS_KEY", "PoolTransfer", "PoolTransferResult"]
