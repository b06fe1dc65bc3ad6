"""The typed values crossing vLLM's kv_transfer_params (engines/kv_transfer.py)."""

from __future__ import annotations

import msgspec
import pytest

from seer.config import SpeculativeConfig
from seer.engines.kv_transfer import PARAMS_KEY, PoolTransfer, PoolTransferResult
from seer.engines.proposer import DraftArgs, ProposerSettings, draft_extra_args


def test_descriptor_crosses_vllm_as_plain_builtins_and_comes_back_equal() -> None:
    """The descriptor goes into kv_transfer_params as builtins and converts back unchanged."""
    desc = PoolTransfer(pool_name="seer-kv", key=7, weights_version=2, pool_blocks=[3, 4], valid_tokens=40,
                        save=True, min_load_tokens=32)
    params = desc.to_params()
    assert params == {PARAMS_KEY: {"pool_name": "seer-kv", "key": 7, "weights_version": 2, "pool_blocks": [3, 4],
                                   "valid_tokens": 40, "save": True, "min_load_tokens": 32,
                                   "save_each_step": False}}
    assert PoolTransfer.from_params(msgspec.msgpack.decode(msgspec.msgpack.encode(params))) == desc


def test_request_without_descriptor_has_none() -> None:
    """A vLLM request that is not Seer's (no params, or no "seer" key) has no descriptor."""
    assert PoolTransfer.from_params(None) is None
    assert PoolTransfer.from_params({"other": 1}) is None


def test_descriptor_missing_a_field_is_refused() -> None:
    """A descriptor without one of its fields fails loudly instead of defaulting."""
    with pytest.raises(msgspec.ValidationError, match="min_load_tokens"):
        PoolTransfer.from_params({PARAMS_KEY: {"pool_name": "p", "key": 1, "weights_version": 0,
                                               "pool_blocks": [], "valid_tokens": 0, "save": False}})


def test_result_keys_are_seer_prefixed_and_default_to_zero() -> None:
    """The result's keys in RequestOutput.kv_transfer_params are seer_*; absent means nothing happened."""
    result = PoolTransferResult(loaded_tokens=32, load_failed_tokens=3, saved_tokens=64, load_ms=1.5)
    assert result.to_params() == {"seer_loaded_tokens": 32, "seer_load_failed_tokens": 3,
                                  "seer_saved_tokens": 64, "seer_load_ms": 1.5}
    assert PoolTransferResult.from_params(result.to_params()) == result
    assert PoolTransferResult.from_params(None) == PoolTransferResult()


def test_proposer_settings_are_the_speculative_section_plus_placement() -> None:
    """ProposerSettings carries every [speculative] field and survives collective_rpc as builtins."""
    spec = SpeculativeConfig(method="grouped", gamma_max=4, adaptive=False, lam=3.0)
    settings = ProposerSettings(**msgspec.structs.asdict(spec), run_dir="/tmp/r", engine_id=2, weights_version=5)
    assert isinstance(settings, SpeculativeConfig)
    assert msgspec.convert(msgspec.to_builtins(settings), ProposerSettings) == settings
    assert {f: getattr(settings, f) for f in spec.__struct_fields__} == msgspec.structs.asdict(spec)


def test_draft_args_round_trip_through_extra_args() -> None:
    """The draft identity put into extra_args converts back to the same DraftArgs."""
    raw = draft_extra_args("g1", "r1", 12, True)
    assert msgspec.convert(raw, DraftArgs) == DraftArgs(group_id="g1", request_id="r1", num_generated_tokens=12,
                                                       probe=True)
