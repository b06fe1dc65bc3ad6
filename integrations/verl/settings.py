"""Owns the Seer settings of the veRL integration: one ``SeerSettings`` Struct read from
``actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.seer`` (veRL hands that dict to
the checkpoint engine as keyword arguments; the agent-loop manager reads the same dict), so
the daemon's address is written once in the trainer's config.

Errors name the key, the bad value and the fix. No torch, no verl.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any

import msgspec
from msgspec import Meta

CONFIG_PATH = "actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.seer"


class SeerSettingsError(ValueError):
    """A bad ``engine_kwargs.seer`` entry in the trainer's config."""


class SeerSettings(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    # The daemon: an explicit ``ipc://``/``tcp://`` address, or the run dir whose daemon.json names it.
    address: str | None = None
    run_dir: str | None = None
    keys_dir: str | None = None  # CURVE keys (``seerctl keys DIR``) for an authenticated tcp:// daemon
    timeout_s: Annotated[float, Meta(gt=0, le=86400)] = 120.0  # how long any call waits for an answer
    rollout_timeout_s: Annotated[float, Meta(gt=0)] | None = None  # bound on one whole rollout
    weights_timeout_s: Annotated[float, Meta(gt=0)] = 600.0
    policy: str | None = None  # None: the daemon's scheduler.policy
    seed: Annotated[int, Meta(ge=0, le=2**62)] | None = None  # per-step seed = seed + global_steps
    # Where the trainer writes the weights it hands to Seer (must be visible to the daemon's host).
    weights_dir: str = "/dev/shm"


def load_settings(raw: Mapping[str, Any] | None) -> SeerSettings:
    """``SeerSettings`` from the config dict (a DictConfig or a plain dict), or SeerSettingsError."""
    values = {str(k): v for k, v in (raw or {}).items()}
    try:
        return msgspec.convert(values, SeerSettings)
    except msgspec.ValidationError as exc:
        raise SeerSettingsError(f"{CONFIG_PATH}: {exc}; allowed keys: "
                                f"{', '.join(SeerSettings.__struct_fields__)}") from None
