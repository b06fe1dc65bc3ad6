"""RDMA-class transports between hosts' KV pools: UCX through ucxx (``ucx.py``), imported
lazily by ``dataplane/transfer/blocks.py`` when ``[kv_pool] transport = "ucx"``. The
transport-neutral parts (block wire format, TCP transport, the host agent) live in
``dataplane/transfer/``."""
