"""Hosts in network namespaces for tests: each namespace has one veth link to a bridge in the root
namespace, so taking a host's link down partitions it from the others and bringing it up heals it.

Needs root and ``ip`` (iproute2); ``NetNs.available()`` says whether this machine allows it (tests skip
otherwise). Names carry the test process's id, so parallel runs and other helpers never collide; the bridge
has no address, so nothing in the root namespace's routing changes.

    with NetNs(3) as net:                  # hosts 0..2 at 10.213.0.2 .. 10.213.0.4
        DaemonProc(..., prefix=net.exec(0))
        net.cut(2); ...; net.heal(2)
"""

from __future__ import annotations

import os
import shutil
import subprocess

SUBNET = "10.213.0"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10, check=check)


class NetNs:
    def __init__(self, n: int):
        tag = f"{os.getpid() % 100000:05d}"
        self.n = n
        self.bridge = f"xb{tag}"
        self.names = [f"xpu-t{tag}-{i}" for i in range(n)]
        self.veths = [f"xv{tag}{i}" for i in range(n)]  # the root end of each link (<= 15 characters)

    @staticmethod
    def available() -> bool:
        if os.geteuid() != 0 or shutil.which("ip") is None:
            return False
        probe = f"xpu-probe-{os.getpid()}"
        ok = _ip("netns", "add", probe, check=False).returncode == 0
        _ip("netns", "del", probe, check=False)
        return ok

    def ip(self, i: int) -> str:
        return f"{SUBNET}.{i + 2}"

    def exec(self, i: int) -> tuple[str, ...]:
        """The command prefix that runs a program in host ``i``'s namespace."""
        return ("ip", "netns", "exec", self.names[i])

    def __enter__(self) -> NetNs:
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("link", "set", self.bridge, "up")
            for i, (ns, veth) in enumerate(zip(self.names, self.veths, strict=True)):
                _ip("netns", "add", ns)
                _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
                _ip("link", "set", veth, "master", self.bridge)
                _ip("link", "set", veth, "up")
                _ip("-n", ns, "addr", "add", f"{self.ip(i)}/24", "dev", "eth0")
                _ip("-n", ns, "link", "set", "eth0", "up")
                _ip("-n", ns, "link", "set", "lo", "up")
        except BaseException:
            self.__exit__()
            raise
        return self

    def cut(self, i: int) -> None:
        """Partition host ``i`` from every other (its link goes down)."""
        _ip("link", "set", self.veths[i], "down")

    def heal(self, i: int) -> None:
        _ip("link", "set", self.veths[i], "up")

    def __exit__(self, *exc) -> None:
        for ns in self.names:
            _ip("netns", "del", ns, check=False)  # removes its veth ends too
        _ip("link", "del", self.bridge, check=False)
