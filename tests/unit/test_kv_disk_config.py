"""kv_pool.disk_path / disk_gib at config load: off by default, errors name the keys and the fix."""

from __future__ import annotations

import pytest

from seer.config import ConfigError, config_from_dict, load_config


def test_the_disk_tier_is_off_by_default():
    """The embedded defaults and an empty config have no disk tier."""
    for config in (load_config(None), config_from_dict({})):
        assert config.kv_pool.disk_gib == 0.0 and config.kv_pool.disk_path == ""


def test_a_size_without_a_folder_is_refused_naming_both_keys():
    """disk_gib > 0 needs disk_path."""
    with pytest.raises(ConfigError, match=r"kv_pool.disk_gib = 1.0 but kv_pool.disk_path is empty"):
        config_from_dict({"kv_pool": {"disk_gib": 1.0}})


def test_a_missing_folder_is_refused_and_a_relative_one_is_made_absolute(tmp_path):
    """The folder must exist; relative paths are taken from the config file's folder."""
    with pytest.raises(ConfigError, match=r"kv_pool.disk_path = 'nope': no such folder"):
        config_from_dict({"kv_pool": {"disk_gib": 1.0, "disk_path": "nope"}}, base_dir=tmp_path)
    (tmp_path / "kv").mkdir()
    config = config_from_dict({"kv_pool": {"disk_gib": 1.0, "disk_path": "kv"}}, base_dir=tmp_path)
    assert config.kv_pool.disk_path == str(tmp_path / "kv")


def test_a_negative_size_and_unknown_keys_are_refused():
    """Meta bounds and forbid_unknown_fields apply to the new keys too."""
    with pytest.raises(ConfigError, match="disk_gib"):
        config_from_dict({"kv_pool": {"disk_gib": -1.0}})
    with pytest.raises(ConfigError, match="disk_size"):
        config_from_dict({"kv_pool": {"disk_size": 1}})
