"""A network namespace of a test's own, joined to the host by a veth pair, so that a test can cut a real link:
``cut`` sets the namespace's end down, and from then on nothing crosses it either way, without a reset
(the peer sees silence, as behind a dead switch). The tests run as root; the kernel here has no netem, so delay
is not this helper's job.

    with Netns(0) as ns:
        engine = EngineProcess(..., wrap=ns.exec, host=ns.address)
        ns.cut(); ...; ns.mend()

Each namespace gets a /30 of its own (10.213.<pid>.<4 index>), the host at .1 and the namespace at .2.
"""

from __future__ import annotations

import os
import subprocess
from typing import Self


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


class Netns:
    def __init__(self, index: int) -> None:
        tag = f"{os.getpid() % 10000}{index}"
        self.name = f"kvg{tag}"
        self.host_side, self.inner_side = f"kvh{tag}", f"kvn{tag}"  # at most 15 characters
        base = f"10.213.{os.getpid() % 250}.{4 * index}"
        prefix, last = base.rsplit(".", 1)
        self.host_address, self.address = f"{prefix}.{int(last) + 1}", f"{prefix}.{int(last) + 2}"

    def exec(self, command: list[str]) -> list[str]:
        """``command`` run inside the namespace."""
        return ["ip", "netns", "exec", self.name, *command]

    def cut(self) -> None:
        """The link goes down: silence both ways, no reset. The namespace's end is set down, so that the
        host keeps its route (marked linkdown) and what it sends is dropped into the dead link, where
        setting its own end down would send it along the default route instead."""
        _ip("netns", "exec", self.name, "ip", "link", "set", self.inner_side, "down")

    def mend(self) -> None:
        _ip("netns", "exec", self.name, "ip", "link", "set", self.inner_side, "up")

    def __enter__(self) -> Self:
        _ip("netns", "add", self.name)
        try:
            _ip("link", "add", self.host_side, "type", "veth", "peer", "name", self.inner_side)
            _ip("link", "set", self.inner_side, "netns", self.name)
            _ip("addr", "add", f"{self.host_address}/30", "dev", self.host_side)
            _ip("link", "set", self.host_side, "up")
            inside = ["netns", "exec", self.name, "ip"]
            _ip(*inside, "addr", "add", f"{self.address}/30", "dev", self.inner_side)
            _ip(*inside, "link", "set", self.inner_side, "up")
            _ip(*inside, "link", "set", "lo", "up")
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        subprocess.run(["ip", "link", "del", self.host_side], check=False, capture_output=True)  # takes its peer along
        subprocess.run(["ip", "netns", "del", self.name], check=False, capture_output=True)
