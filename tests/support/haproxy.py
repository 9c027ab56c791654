"""A real haproxy (Debian's ``haproxy``) running the compose stack's own configuration, deploy/haproxy.cfg,
with only its addresses changed: the frontend's ``bind`` and each ``server`` line's address are replaced by
the test's ports, every other line (balance, health check, retries, timeouts) is the shipped file's.

``HAProxy`` is a ``Process``: ``haproxy -db`` (foreground) on the rendered file, ready once the frontend's
``/metrics`` (haproxy's own Prometheus exporter) answers. One thing beside the addresses comes from the
machine rather than the file: the file's ``maxconn 20000`` needs ~40,000 descriptors, more than a test
machine's limit may allow (20,000 here, and not raisable without CAP_SYS_RESOURCE), and haproxy refuses to
start then; ``-n`` caps the connections at what the descriptor limit affords. ``server_up(name)`` reads from it whether haproxy
counts that guard in (its health check passing) or out.
"""

from __future__ import annotations

import re
import resource
import shutil
from pathlib import Path

from . import ROOT
from .net import free_port, request
from .processes import Process

SHIPPED = ROOT / "deploy" / "haproxy.cfg"
SERVER = re.compile(r"^(\s*server\s+)(\S+)(\s+)(\S+)(\s+check\b)", re.MULTILINE)
BIND = re.compile(r"^(\s*bind\s+)(\S+)", re.MULTILINE)


def render(servers: dict[str, str], bind: str, source: Path = SHIPPED) -> str:
    """``source`` with its frontend bound to ``bind`` and each of its servers (by name) at ``servers[name]``
    (``host:port``); every server the file names must be given, and no other."""
    text = source.read_text()
    named = [match[2] for match in SERVER.finditer(text)]
    assert sorted(named) == sorted(servers), f"{source} names servers {named}, the test gives {sorted(servers)}"
    text = SERVER.sub(lambda m: f"{m[1]}{m[2]}{m[3]}{servers[m[2]]}{m[5]}", text)
    text, binds = BIND.subn(lambda m: f"{m[1]}{bind}", text)
    assert binds == 1, f"{source} has {binds} bind lines, expected one"
    return text


class HAProxy(Process):
    """deploy/haproxy.cfg in front of ``servers`` (its server names to ``host:port``), on a free loopback
    port; ``url`` is where clients go."""

    def __init__(self, workdir: Path, servers: dict[str, str], name: str = "haproxy") -> None:
        binary = shutil.which("haproxy")
        assert binary is not None, "haproxy is not installed (make test installs Debian's haproxy)"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.config = workdir / "haproxy.cfg"
        self.config.write_text(render(servers, f"127.0.0.1:{self.port}"))
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        maxconn = min(20_000, (soft - 100) // 2)  # each connection: a client's descriptor and a server's
        super().__init__(name, [binary, "-db", "-n", str(maxconn), "-f", self.config], ready_url=self.url + "/metrics",
                         log=workdir / f"{name}.log", ready_timeout=10.0)

    def server_up(self, server: str, backend: str = "guards") -> bool:
        """Whether haproxy's health check counts ``server`` of ``backend`` in (state UP) right now."""
        status, body = request(self.url + "/metrics", timeout=5)
        assert status == 200, body[:300]
        wanted = f'haproxy_server_status{{proxy="{backend}",server="{server}",state="UP"}} 1'
        return any(line.strip() == wanted for line in body.decode().splitlines())
