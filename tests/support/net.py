"""Loopback networking for tests: a free port, one blocking HTTP request, a ``/health`` probe."""

from __future__ import annotations

import socket
import urllib.error
import urllib.request


def free_port() -> int:
    """A port nothing listens on right now (the OS picks it; a process started next binds it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_ports_in_a_row(count: int) -> int:
    """The first of ``count`` consecutive ports nothing listens on right now (``--metrics-port`` gives worker
    i the first + i): a lone free port's neighbour may be taken."""
    while True:
        base = free_port()
        sockets = [socket.socket() for _ in range(count)]
        try:
            for offset, s in enumerate(sockets):
                s.bind(("127.0.0.1", base + offset))
            return base
        except OSError:
            continue
        finally:
            for s in sockets:
                s.close()


def request(url: str, body: bytes | None = None, headers: dict[str, str] | None = None,
            timeout: float = 60) -> tuple[int, bytes]:
    """GET (or POST ``body``) and return status and body, errors included."""
    all_headers = {"Content-Type": "application/json", **(headers or {})}
    req = urllib.request.Request(url, data=body, headers=all_headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def health(url: str, path: str = "/health") -> int:
    """``GET url + path``'s status, 0 when nothing answers (or answers too slowly)."""
    try:
        return request(url + path, timeout=5)[0]
    except OSError:
        return 0
