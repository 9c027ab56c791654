"""The processes a benchmark stands up: engine, guard or any server, each on a free loopback port.

Every process writes to its own log file, never to a pipe: a pipe nobody reads fills up and stalls the
process mid-benchmark. A process counts as started once its health URL answers 200 (and, for the guard,
once it has engine telemetry, without which it admits nothing). ``taskset`` pins a process to CPUs when a
benchmark needs to know which core does what.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parent.parent


@dataclass(slots=True)
class Service:
    name: str
    process: subprocess.Popen
    url: str
    log: Path

    def stop(self, timeout: float = 10.0) -> None:
        """SIGINT first (the graceful path every server here implements), SIGKILL if it hangs."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def tail(self, lines: int = 20) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


def free_port() -> int:
    """A port that was free a moment ago (the tiny race with other programs is harmless on loopback)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def pinned(command: list[str], cpus: str | None) -> list[str]:
    return ["taskset", "-c", cpus, *command] if cpus else command


def get_json(url: str, timeout: float = 2.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return json.load(response)


def healthy(url: str) -> bool:
    """``GET /health`` answers 200."""
    with urllib.request.urlopen(url + "/health", timeout=2.0) as response:
        return response.status == 200


def backend_series(url: str, name: str) -> dict[str, float]:
    """The guard's per-replica series ``name{backend="..."}`` from its ``/metrics`` at ``url``, by replica."""
    with urllib.request.urlopen(url + "/metrics", timeout=2.0) as response:
        lines = response.read().decode().splitlines()
    return {line.split('backend="', 1)[1].split('"', 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in lines if line.startswith(name + "{")}


def guard_has_telemetry(url: str) -> bool:
    """The guard's contract metric ``guard_telemetry_age_seconds{backend}`` says it has a fresh snapshot of
    every replica."""
    ages = backend_series(url, "guard_telemetry_age_seconds")
    return bool(ages) and max(ages.values()) < 1.0


def start(name: str, command: list[str], url: str, workdir: Path, ready: Callable[[str], bool] = healthy,
          timeout: float = 120.0, tree: Path = REPO) -> Service:
    """Start ``command`` in ``tree`` (another checkout runs its own code: ``python -m`` imports from its
    working directory first), a server at ``url``, and wait until ``ready(url)`` holds."""
    log = workdir / f"{name}.log"
    with log.open("wb") as out:
        process = subprocess.Popen(command, cwd=tree, stdout=out, stderr=subprocess.STDOUT)
    service = Service(name, process, url, log)
    deadline = time.monotonic() + timeout
    while True:
        try:
            if ready(url):
                return service
        except (OSError, ValueError):  # not listening yet, or 503 while loading
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            service.stop()
            raise RuntimeError(f"{name} did not start (exit status {process.returncode}):\n{service.tail()}")
        time.sleep(0.1)


def start_engine(workdir: Path, flags: list[str], cpus: str | None = None, name: str = "engine",
                 tree: Path = REPO) -> Service:
    """An engine with ``flags`` from the checkout ``tree``; ``name`` tells several engines' logs apart."""
    port = free_port()
    command = pinned([sys.executable, "-m", "engine", "--port", str(port), *flags], cpus)
    return start(name, command, f"http://127.0.0.1:{port}", workdir, tree=tree)


def start_guard(workdir: Path, config: dict[str, Any], cpus: str | None = None,
                name: str = "guard", tree: Path = REPO) -> Service:
    """The guard with ``config`` (``listen`` is filled in), logging warnings only: at INFO, aiohttp's access
    log would format a line per request, work a benchmark should not charge to the guard (nginx runs with
    ``access_log off`` for the same reason). ``name`` tells several guards' files apart."""
    port = free_port()
    path = workdir / f"{name}.yaml"
    path.write_text(yaml.safe_dump({**config, "listen": {"host": "127.0.0.1", "port": port}}))
    command = pinned([sys.executable, "-m", "guard", "--config", str(path), "--log-level", "WARNING"], cpus)
    return start(name, command, f"http://127.0.0.1:{port}", workdir, ready=guard_has_telemetry, tree=tree)


def start_bare_relay(workdir: Path, upstream: str, cpus: str | None = None) -> Service:
    """bench/bare_relay.py in front of ``upstream``: the least an aiohttp proxy does, the floor of the guard's
    cost on the same machine."""
    port = free_port()
    return start("aiohttp", pinned([sys.executable, str(REPO / "bench" / "bare_relay.py"), "--port", str(port),
                                    "--upstream", upstream], cpus), f"http://127.0.0.1:{port}", workdir)


@contextmanager
def baseline_tree(ref: str | None, given: Path | None, workdir: Path) -> Iterator[Path | None]:
    """Tree A of a side-by-side benchmark (``--baseline REF`` or ``--a PATH``): ``given`` as it is, or, with
    ``ref``, that commit checked out as a detached git worktree under ``workdir`` and removed when the block
    ends, however it ends (None: neither was given)."""
    if ref is None:
        yield given
        return
    path = workdir / "tree-a"
    subprocess.run(["git", "worktree", "add", "--detach", str(path), ref], cwd=REPO, check=True, capture_output=True)
    try:
        yield path
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(path)], cwd=REPO, check=False,
                       capture_output=True)
