"""Moving KV blocks between hosts' pools (``BlockServer``, ``pull_blocks``, the host
agent in ``agent.py``). UCX (``ucxx``) is imported only when the ``ucx`` transport is
used; importing this package costs nothing extra. See docs/multi-host.md."""

from seer.dataplane.host import host_id
from seer.dataplane.transfer.blocks import TRANSPORTS, BlockServer, PullResult, pull_blocks

__all__ = ["TRANSPORTS", "BlockServer", "PullResult", "host_id", "pull_blocks"]
