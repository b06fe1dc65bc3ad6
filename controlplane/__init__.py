"""The control plane. Importing it registers every scheduling policy's name with
``seer.config``, so a loaded ``seer.toml`` is checked against them."""

from seer.controlplane import policies as _policies  # noqa: F401
