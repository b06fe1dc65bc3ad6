"""A fractional ``engines.kv_cache_gib`` reaches vLLM as a block cap, not as a fraction
vLLM's CPU build cannot parse (it killed both engines at start)."""

from __future__ import annotations

from seer.controlplane.supervisor import kv_cache_space_env


def test_the_environment_gets_whole_gib_rounded_up():
    """VLLM_CPU_KVCACHE_SPACE is always a whole number: 0.3 -> 1, 2.0 -> 2, 1.5 -> 2."""
    assert [kv_cache_space_env(g) for g in (0.3, 2.0, 1.5, 1.0)] == ["1", "2", "2", "1"]


def test_a_fractional_budget_caps_the_blocks_at_the_exact_bytes(tmp_path):
    """K and V of every layer, head and dimension at the dtype's size: SmolLM2-135M in
    float32 is 46,080 bytes per token, so 0.5 GiB at 32-token blocks is 364 blocks; a
    whole number of GiB sets no cap."""
    from seer.engines.vllm_args import kv_blocks_for

    (tmp_path / "config.json").write_text(
        '{"head_dim": 64, "num_key_value_heads": 3, "num_hidden_layers": 30, "hidden_size": 576, '
        '"num_attention_heads": 9}')
    assert kv_blocks_for(str(tmp_path), "float32", 32, 0.5) == 2**29 // (46_080 * 32) == 364
    assert kv_blocks_for(str(tmp_path), "bfloat16", 32, 0.5) == 2**29 // (23_040 * 32)
    assert kv_blocks_for(str(tmp_path), "float32", 32, 1.0) is None
    assert kv_blocks_for(str(tmp_path), "float32", 32, None) is None
