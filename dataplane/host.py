"""Which host this process is on, as the data plane and the control plane name it.

A host is a kernel *and* a network namespace: two namespaces on one machine do not
share interfaces or addresses, so to the rest of Seer they are two hosts (the tests use
namespaces joined by veth as hosts). The id is stable for the life of the namespace.
"""

from __future__ import annotations

import os
import socket


def host_id() -> str:
    """``<hostname>:<inode of /proc/self/ns/net>``; differs between network namespaces."""
    try:
        netns = os.stat("/proc/self/ns/net").st_ino
    except OSError:  # no procfs (not Linux): the hostname alone
        return socket.gethostname()
    return f"{socket.gethostname()}:{netns}"
