"""A real Redis for the tests of shared state: Debian's ``redis-server`` on a free loopback port.

``RedisServer`` is a ``Process`` (restartable on the same port, so a test can kill Redis and bring it back
where the guards expect it); it keeps nothing on disk (no RDB snapshots, no AOF), so a restart starts empty,
as a Redis that lost its data would. Ready once it answers ``PING``. ``DEBUG`` is allowed from loopback, so
a test can make Redis slow (``DEBUG SLEEP``) without stopping it.
"""

from __future__ import annotations

import shutil
import socket
from pathlib import Path
from typing import Self

from .net import free_port
from .netns import Netns
from .processes import Process
from .wait import wait_for


def _pong(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5) as conn:
            conn.sendall(b"PING\r\n")
            return conn.recv(16).startswith(b"+PONG")
    except OSError:
        return False


class RedisServer(Process):
    """On loopback, or (``netns``, tests/support/netns.py) inside a network namespace at its address, so that
    a test can cut the link between the guards and Redis."""

    def __init__(self, workdir: Path, name: str = "redis", port: int | None = None, netns: Netns | None = None
                 ) -> None:
        binary = shutil.which("redis-server")
        assert binary is not None, "redis-server is not installed (make test installs Debian's redis-server)"
        self.port = free_port() if port is None else port
        self.host = netns.address if netns is not None else "127.0.0.1"
        self.url = f"redis://{self.host}:{self.port}/0"
        command = [binary, "--port", str(self.port), "--bind", self.host, "--save", "", "--appendonly", "no",
                   "--dir", str(workdir), "--enable-debug-command", "local" if netns is None else "yes",
                   # Reached over a veth, not loopback: protected mode would refuse the guards.
                   *([] if netns is None else ["--protected-mode", "no"])]
        super().__init__(name, netns.exec(command) if netns is not None else command, log=workdir / f"{name}.log")

    def wait_ready(self, timeout: float | None = None) -> Self:
        wait_for(lambda: _pong(self.host, self.port) or self.poll() is not None, bool, timeout or 10.0,
                 message=lambda: f"{self.name} not answering PING:\n{self.log_tail()}")
        assert self.poll() is None, f"{self.name} exited with {self.returncode}:\n{self.log_tail()}"
        return self
