"""The one process factory: real engine and guard processes (and any other server the tests run, such as
Prometheus), for the tests that kill, restart or signal them, or that test the command line itself (an
in-process server cannot be SIGKILLed or sent SIGTERM without taking the test with it).

- ``Process``: one subprocess whose output goes to a log file; ``start()`` returns once its ready URL
  answers 200 (failing with the log's tail if it exits or times out first); ``stop()`` sends SIGTERM (or the
  signal given), waits, and kills it if it is still there. Restartable: ``start()`` again reuses its port.
- ``EngineProcess``: ``python -m engine --model tiny --port P [flags]``; ready when ``/health`` is 200
  (``env``: the process's whole environment, when not this one's, as for ``GuardProcess``).
  ``port=0`` lets the engine pick its port, read from its ``engine: listening on`` line.
- ``GuardProcess``: ``python -m guard --config F``; its URL from the file's ``listen``; ready on ``/health``.
- ``Processes``: starts named processes logging to ``<root>/<name>.log`` and stops them all (reverse order)
  on exit; the ``processes`` fixture (conftest.py) is one rooted in the test's ``tmp_path``.
- ``run_command(*command)``: a command run to completion, its output captured (for tools and scripts).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any, Self, TypeVar

import yaml

from . import ROOT
from .net import free_port, health, request
from .wait import wait_for

STOP_TIMEOUT_S = 30.0  # for a process to exit after SIGTERM before it is killed
P = TypeVar("P", bound="Process")


class Process:
    """One subprocess, logged to ``log`` (an anonymous temporary file when None)."""

    def __init__(self, name: str, command: Sequence[str | Path], *, ready_url: str | None = None,
                 log: Path | None = None, cwd: Path = ROOT, env: dict[str, str] | None = None,
                 ready_timeout: float = 60.0) -> None:
        self.name = name
        self.command = [str(part) for part in command]
        self.ready_url = ready_url
        self.ready_timeout = ready_timeout
        self.cwd = cwd
        self.env = env
        self.log_path = log
        self.popen: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    # -- lifecycle ------------------------------------------------------------------------------------------
    def spawn(self) -> Self:
        """Start the process without waiting for it to be ready (``wait_ready`` does that)."""
        assert self.poll() is not None, f"{self.name} is already running"
        if self._log is None:  # open until close(), so that a restarted process appends to the same log
            path = self.log_path
            self._log = path.open("a+b") if path else tempfile.TemporaryFile()  # noqa: SIM115
        self.popen = subprocess.Popen(self.command, cwd=self.cwd, env=self.env, stdout=self._log,
                                      stderr=subprocess.STDOUT)
        return self

    def start(self) -> Self:
        """Spawn, and wait until ready; a process that never gets ready is stopped before the failure."""
        self.spawn()
        try:
            return self.wait_ready()
        except BaseException:
            self.stop(signal.SIGKILL)
            raise

    def wait_ready(self, timeout: float | None = None) -> Self:
        """Until ``ready_url`` answers 200; fails, with the log's tail, if the process exits first."""
        if self.ready_url is not None:
            url = self.ready_url
            wait_for(lambda: health(url, path="") if self.poll() is None else -1,
                     lambda status: status in (200, -1), timeout or self.ready_timeout, interval=0.05,
                     message=lambda: f"{self.name} not ready at {url}:\n{self.log_tail()}")
            assert self.poll() is None, f"{self.name} exited with {self.returncode}:\n{self.log_tail()}"
        return self

    def stop(self, sig: signal.Signals = signal.SIGTERM, timeout: float = STOP_TIMEOUT_S) -> int | None:
        """Send ``sig``, wait for the exit, SIGKILL after ``timeout`` s. The exit code (None: not started)."""
        if self.popen is None:
            return None
        if self.popen.poll() is None:
            self.popen.send_signal(sig)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        return self.popen.returncode

    def kill(self) -> int | None:
        return self.stop(signal.SIGKILL)

    def close(self) -> None:
        """Stop, and close the log (a named one stays on disk)."""
        self.stop()
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the running process --------------------------------------------------------------------------------
    def send_signal(self, sig: signal.Signals) -> None:
        assert self.popen is not None
        self.popen.send_signal(sig)

    def poll(self) -> int | None:
        """The exit code, None while running (a process never started counts as exited, with code 0)."""
        return self.popen.poll() if self.popen is not None else 0

    def wait(self, timeout: float | None = None) -> int:
        assert self.popen is not None
        return self.popen.wait(timeout)

    @property
    def returncode(self) -> int | None:
        return self.popen.returncode if self.popen is not None else None

    def log_text(self) -> str:
        """Everything the process (all its runs) wrote to stdout and stderr so far."""
        if self._log is None:  # closed (a named log is still on disk) or never opened
            exists = self.log_path is not None and self.log_path.exists()
            return self.log_path.read_text(errors="replace") if exists else ""
        fd = self._log.fileno()
        return os.pread(fd, os.fstat(fd).st_size, 0).decode(errors="replace")

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])


class EngineProcess(Process):
    """``python -m engine --model tiny --port P *flags`` on a fixed port (a free one unless given), so that
    a restarted engine is found where the old one was; ``port=0`` lets the engine choose."""

    LISTENING = re.compile(r"^engine: listening on (\S+)", re.MULTILINE)

    def __init__(self, *flags: str, port: int | None = None, model: str = "tiny", name: str = "engine",
                 log: Path | None = None, env: dict[str, str] | None = None) -> None:
        self.port = free_port() if port is None else port
        self.url = f"http://127.0.0.1:{self.port}" if self.port else ""
        self.flags = flags
        self._runs_before = 0
        command = [sys.executable, "-m", "engine", "--model", model, "--port", str(self.port), *flags]
        super().__init__(name, command, ready_url=self.url + "/health" if self.url else None, log=log, env=env)

    def wait_ready(self, timeout: float | None = None) -> Self:
        if not self.port:  # the engine prints its URL as soon as it listens (before the model has loaded)
            runs = self._runs_before
            found = wait_for(lambda: self.LISTENING.findall(self.log_text()) if self.poll() is None else None,
                             lambda urls: urls is None or len(urls) > runs, timeout or self.ready_timeout,
                             message=lambda: f"{self.name} never said where it listens:\n{self.log_tail()}")
            assert found is not None, f"{self.name} exited with {self.returncode}:\n{self.log_tail()}"
            self.url = found[-1]
            self.ready_url = self.url + "/health"
        return super().wait_ready(timeout)

    def spawn(self) -> Self:
        self._runs_before = len(self.LISTENING.findall(self.log_text()))  # earlier runs' lines, same log
        return super().spawn()

    def telemetry(self) -> dict[str, Any]:
        status, body = request(self.url + "/telemetry")
        assert status == 200, body
        return json.loads(body)


class GuardProcess(Process):
    """``python -m guard --config config *flags``, at the address the file's ``listen`` names (``env``: the
    process's whole environment, when not this one's)."""

    def __init__(self, config: Path, *flags: str, name: str = "guard", log: Path | None = None,
                 env: dict[str, str] | None = None) -> None:
        listen = yaml.safe_load(config.read_text())["listen"]
        self.config = config
        self.port = int(listen["port"])
        assert self.port, "a guard process needs a fixed listen port (use free_port())"
        self.url = f"http://{listen.get('host', '127.0.0.1')}:{self.port}"
        command = [sys.executable, "-m", "guard", "--config", str(config), *flags]
        super().__init__(name, command, ready_url=self.url + "/health", log=log, env=env, ready_timeout=30.0)


class Processes:
    """Named processes, each logging to ``<root>/<name>.log``; ``with Processes(root) as processes``
    stops them all on the way out (SIGTERM to all, newest first, then SIGKILL for any still there)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.running: dict[str, Process] = {}

    def engine(self, *flags: str, port: int | None = None, name: str = "engine", wait: bool = True,
               env: dict[str, str] | None = None) -> EngineProcess:
        return self.add(EngineProcess(*flags, port=port, name=name, log=self._log(name), env=env), wait)

    def guard(self, config: Path, *flags: str, name: str = "guard", wait: bool = True,
              env: dict[str, str] | None = None) -> GuardProcess:
        return self.add(GuardProcess(config, *flags, name=name, log=self._log(name), env=env), wait)

    def start(self, name: str, command: Sequence[str | Path], *, ready_url: str | None = None,
              cwd: Path = ROOT, wait: bool = True) -> Process:
        """Any other server (Prometheus, Alertmanager): ready when ``ready_url`` answers 200."""
        return self.add(Process(name, command, ready_url=ready_url, log=self._log(name), cwd=cwd), wait)

    def add(self, process: P, wait: bool = True) -> P:
        """Own ``process`` (stopped with the others) and start it (only spawn it, without ``wait``)."""
        assert process.name not in self.running, f"there is already a process named {process.name}"
        self.running[process.name] = process
        return process.start() if wait else process.spawn()

    def __getitem__(self, name: str) -> Process:
        return self.running[name]

    def _log(self, name: str) -> Path:
        self.root.mkdir(parents=True, exist_ok=True)
        return self.root / f"{name}.log"

    def stop_all(self) -> None:
        processes = list(reversed(self.running.values()))
        for process in processes:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for process in processes:
            process.stop(timeout=max(0.1, deadline - time.monotonic()))
            process.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_all()


def run_command(*command: str | Path, cwd: Path = ROOT, timeout: float = 120,
                env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run a command to completion, its output captured (put it in the assertion message when it fails)."""
    return subprocess.run([str(c) for c in command], cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env=env, check=False)


def run_bench(script: str, tmp_path: Path, *args: str, smoke: bool = False,
              timeout: float = 180) -> tuple[str, dict]:
    """``bench/<script>`` with ``args`` in its quick mode (``--smoke`` with ``smoke``), its report written to a
    file: what it printed and the report, once it exited 0 and said it measured nothing."""
    mode, says = ("--smoke", "SMOKE RUN") if smoke else ("--quick", "QUICK RUN")
    result_file = tmp_path / "result.json"
    done = run_command(sys.executable, ROOT / "bench" / script, *args, mode, "--json", result_file, timeout=timeout)
    assert done.returncode == 0, done.stdout + done.stderr
    assert says in done.stdout
    return done.stdout, json.loads(result_file.read_text())
