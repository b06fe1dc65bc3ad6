"""The KV pool, control-plane side: every host's pool and where each request's KV lives
(``table.py``, pure), this host's shared-memory segment and agent process
(``segment.py``), and the host agents that move blocks between hosts (``agents.py``)."""
