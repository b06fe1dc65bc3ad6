"""Two "hosts" on one machine: network namespaces joined by a veth pair.

Used by the multi-host tests and the transfer benchmark (needs root and iproute2). Each
namespace has its own interfaces, addresses and abstract sockets, so to UCX, TCP and
``host_id()`` it is another host; it still shares the filesystem (ipc:// sockets and
/dev/shm), which is how a test reaches both sides. Names are unique per instance, and
``close`` deletes both namespaces (which removes the veth pair with them).
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess


class NetnsUnavailable(RuntimeError):
    """This machine or user cannot create network namespaces; the message says why."""


class NetnsPair:
    """Namespaces ``names[0]`` / ``names[1]`` with ``addresses[0]`` / ``addresses[1]``
    on the two ends of one veth link (a /24 in 10.0.0.0/8)."""

    def __init__(self, subnet: int | None = None) -> None:
        if shutil.which("ip") is None:
            raise NetnsUnavailable("the `ip` command (iproute2) is not installed")
        tag = f"{os.getpid() % 100000}{secrets.token_hex(2)}"
        self.names = (f"seer{tag}a", f"seer{tag}b")
        veths = (f"sv{tag}a", f"sv{tag}b")  # interface names: at most 15 characters
        # The namespaces are isolated from each other's and the host's routes, so the
        # subnet only has to be private; a random one keeps logs of parallel runs apart.
        net = subnet if subnet is not None else 100 + secrets.randbelow(150)
        self.addresses = (f"10.{net}.0.1", f"10.{net}.0.2")
        self._created: list[str] = []
        try:
            for name in self.names:
                self._ip("netns", "add", name)
                self._created.append(name)
        except NetnsUnavailable:
            self.close()
            raise
        try:
            self._ip("link", "add", veths[0], "type", "veth", "peer", "name", veths[1])
            for name, veth, addr in zip(self.names, veths, self.addresses):
                self._ip("link", "set", veth, "netns", name)
                self._ip("-n", name, "addr", "add", f"{addr}/24", "dev", veth)
                self._ip("-n", name, "link", "set", veth, "up")
                self._ip("-n", name, "link", "set", "lo", "up")
        except NetnsUnavailable:
            self.close()
            raise

    @staticmethod
    def _ip(*args: str) -> None:
        out = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
        if out.returncode != 0:
            raise NetnsUnavailable(f"`ip {' '.join(args)}` failed: {out.stderr.strip() or out.returncode}")

    def prefix(self, i: int) -> list[str]:
        """Command prefix that runs a program in namespace ``i``."""
        return ["ip", "netns", "exec", self.names[i]]

    def close(self) -> None:
        for name in self._created:
            subprocess.run(["ip", "netns", "delete", name], capture_output=True, timeout=30)
        self._created = []

    def __enter__(self) -> NetnsPair:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
