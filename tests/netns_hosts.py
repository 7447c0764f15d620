"""The project's test hosts: worker "hosts" in network namespaces, linked to the root namespace.

Each host is a namespace `rh<i>-<tag>` with one veth pair: `vh<i>-<tag>` inside (10.231.<i>.2),
`vr<i>-<tag>` in the root namespace (10.231.<i>.1, its gateway). The services (Redis, the
example agent) listen on `SERVICE_ADDRESS`, held by one more veth pair kept in the root
namespace, which every host reaches through its own link, so cutting one host's link cuts that
host alone. Set up and torn down by the test; traffic only between these addresses. Needs root
and `ip netns` (`available()` says whether they are there).
"""

from __future__ import annotations

import os
import shutil
import subprocess

SERVICE_ADDRESS = "10.231.0.1"


def _ip(*args: str, ns: str | None = None) -> None:
    prefix = ["ip", "netns", "exec", ns, "ip"] if ns else ["ip"]
    subprocess.run(prefix + list(args), check=True, capture_output=True, timeout=10)


def available() -> str | None:
    """None when namespaces can be made here, else why not."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        return "needs root and iproute2 (ip netns)"
    probe = f"rh-probe-{os.getpid()}"
    try:
        _ip("netns", "add", probe)
        _ip("netns", "del", probe)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
        return f"ip netns is not usable here: {exc}"
    return None


class TestHosts:
    """`count` worker hosts in network namespaces, and the service address they all reach."""

    __test__ = False  # not a pytest test class

    def __init__(self, count: int = 3) -> None:
        self.tag = str(os.getpid() % 100000)
        self.count = count
        self.namespaces = [f"rh{i}-{self.tag}" for i in range(1, count + 1)]
        self._service = (f"rsa-{self.tag}", f"rsb-{self.tag}")

    def _inner(self, i: int) -> str:
        return f"vh{i}-{self.tag}"

    def up(self) -> None:
        a, b = self._service
        _ip("link", "add", a, "type", "veth", "peer", "name", b)
        _ip("addr", "add", f"{SERVICE_ADDRESS}/32", "dev", a)
        _ip("link", "set", a, "up")
        _ip("link", "set", b, "up")
        for i, ns in enumerate(self.namespaces, 1):
            outer, inner = f"vr{i}-{self.tag}", self._inner(i)
            _ip("netns", "add", ns)
            _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
            _ip("link", "set", inner, "netns", ns)
            _ip("addr", "add", f"10.231.{i}.1/24", "dev", outer)
            _ip("link", "set", outer, "up")
            _ip("addr", "add", f"10.231.{i}.2/24", "dev", inner, ns=ns)
            _ip("link", "set", "lo", "up", ns=ns)
            self.restore(i)

    def prefix(self, i: int) -> list[str]:
        """The command prefix that runs a process on host `i` (1-based)."""
        return ["ip", "netns", "exec", self.namespaces[i - 1]]

    def cut(self, i: int) -> None:
        """Cut host `i`'s link: it reaches nothing, and nothing reaches it."""
        _ip("link", "set", self._inner(i), "down", ns=self.namespaces[i - 1])

    def restore(self, i: int) -> None:
        """Bring host `i`'s link back (with its route to the services)."""
        ns = self.namespaces[i - 1]
        _ip("link", "set", self._inner(i), "up", ns=ns)
        _ip("route", "replace", "default", "via", f"10.231.{i}.1", ns=ns)

    def down(self) -> None:
        """Delete the namespaces (their veths go with them) and the service pair."""
        for ns in self.namespaces:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)
        subprocess.run(["ip", "link", "del", self._service[0]], capture_output=True, timeout=10)
