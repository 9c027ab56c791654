"""Real engine and guard processes, for the tests that kill, restart or signal them (an in-process server
cannot be SIGKILLed or sent SIGTERM without taking the test with it)."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any, Self

from engine_server import request, wait_for

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def health(url: str) -> int:
    """``GET /health``'s status, 0 when nothing answers."""
    try:
        return request(url + "/health")[0]
    except OSError:
        return 0


def wait_healthy(process: subprocess.Popen, url: str, timeout: float = 60) -> None:
    wait_for(lambda: health(url) if process.poll() is None else -1, lambda status: status in (200, -1), timeout)
    assert process.poll() is None, f"{process.args} exited with {process.returncode}"


class EngineProcess:
    """``python -m engine`` on a fixed port, so that a restarted engine is found where the old one was."""

    def __init__(self, *flags: str, port: int | None = None) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.flags = flags
        self.process: subprocess.Popen | None = None

    def start(self) -> EngineProcess:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "engine", "--model", "tiny", "--port", str(self.port), *self.flags],
            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_healthy(self.process, self.url)
        return self

    def stop(self, sig: signal.Signals = signal.SIGKILL) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(sig)
            self.process.wait(30)

    def telemetry(self) -> dict[str, Any]:
        status, body = request(self.url + "/telemetry")
        assert status == 200, body
        return json.loads(body)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_guard(config: Path, log: Path, url: str) -> subprocess.Popen:
    """``python -m guard --config config``, its output in ``log``, once its ``/health`` answers."""
    with log.open("wb") as out:
        process = subprocess.Popen([sys.executable, "-m", "guard", "--config", str(config)], cwd=ROOT,
                                   stdout=out, stderr=subprocess.STDOUT)
    wait_healthy(process, url, timeout=30)
    return process
