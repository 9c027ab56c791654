"""The observability stack for the live test, as real processes on free loopback ports: the tiny engine, the
guard, Prometheus and Alertmanager, plus an aiohttp webhook receiver standing in for on-call.

Prometheus and Alertmanager run test variants of the committed configs, rewritten rather than copied so
that the committed files stay realistic: 1 s scrapes and rule evaluations, `for:` durations of 1 s, no
notification grouping delays, the test's own ports, and webhooks pointed at the receiver.
"""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

import yaml
from aiohttp import web
from prometheus_tools import ALERTS, binary

SCRAPE_INTERVAL_S = 1
TENANTS = [  # (name, key, weight, lane)
    ("acme", "sk-acme-live", 2, "interactive"),
    ("globex", "sk-globex-live", 1, "agent"),
    ("bulk", "sk-bulk-live", 1, "batch"),
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(slots=True)
class Ports:
    engine: int = field(default_factory=free_port)
    guard: int = field(default_factory=free_port)
    prometheus: int = field(default_factory=free_port)
    alertmanager: int = field(default_factory=free_port)
    webhook: int = field(default_factory=free_port)


def guard_config(ports: Ports) -> dict[str, Any]:
    return {
        "listen": {"host": "127.0.0.1", "port": ports.guard},
        "engine": {"name": "primary", "url": f"http://127.0.0.1:{ports.engine}"},
        "fallbacks": [{"name": "static", "message": "degraded; retry shortly"}],
        "secret": "live-test-secret",
        "tenants": [{"name": n, "api_keys": [k], "weight": w, "lane": lane} for n, k, w, lane in TENANTS],
    }


def prometheus_config(ports: Ports, rules_dir: Path) -> dict[str, Any]:
    """alerts/prometheus.yml with the test's ports and rules, scraping the jobs this test runs."""
    config = yaml.safe_load((ALERTS / "prometheus.yml").read_text())
    interval = f"{SCRAPE_INTERVAL_S}s"
    config["global"].update(scrape_interval=interval, scrape_timeout=interval, evaluation_interval=interval)
    config["rule_files"] = [str(rules_dir / "*.yml")]
    alertmanager = {"targets": [f"127.0.0.1:{ports.alertmanager}"]}
    config["alerting"]["alertmanagers"][0]["static_configs"] = [alertmanager]
    targets = {"engine": ports.engine, "guard": ports.guard}
    config["scrape_configs"] = [job for job in config["scrape_configs"] if job["job_name"] in targets]
    assert len(config["scrape_configs"]) == len(targets), "a job the test scrapes is gone from prometheus.yml"
    for job in config["scrape_configs"]:
        job["static_configs"] = [{"targets": [f"127.0.0.1:{targets[job['job_name']]}"]}]
    return config


def fast_rules(rule_file: Path) -> dict[str, Any]:
    """A committed rule file with every `for:` cut to 1 s, so an alert fires within seconds."""
    rules = yaml.safe_load(rule_file.read_text())
    for group in rules["groups"]:
        for rule in group["rules"]:
            if "for" in rule:
                rule["for"] = "1s"
    return rules


def alertmanager_config(ports: Ports) -> dict[str, Any]:
    """alerts/alertmanager.yml notifying at once, to the test's receiver (same paths as committed)."""
    config = yaml.safe_load((ALERTS / "alertmanager.yml").read_text())
    for route in [config["route"], *config["route"]["routes"]]:
        route.update(group_wait="0s", group_interval="1s")
    for receiver in config["receivers"]:
        for hook in receiver["webhook_configs"]:
            path = urllib.parse.urlsplit(hook["url"]).path
            hook["url"] = f"http://127.0.0.1:{ports.webhook}{path}"
    return config


def write_configs(root: Path, ports: Ports) -> dict[str, Path]:
    rules_dir = root / "rules"
    rules_dir.mkdir()
    for rule_file in sorted((ALERTS / "rules").glob("*.yml")):
        (rules_dir / rule_file.name).write_text(yaml.safe_dump(fast_rules(rule_file)))
    paths = {"guard": root / "guard.yaml", "prometheus": root / "prometheus.yml",
             "alertmanager": root / "alertmanager.yml"}
    paths["guard"].write_text(yaml.safe_dump(guard_config(ports)))
    paths["prometheus"].write_text(yaml.safe_dump(prometheus_config(ports, rules_dir)))
    paths["alertmanager"].write_text(yaml.safe_dump(alertmanager_config(ports)))
    return paths


class Processes:
    """Named subprocesses, each logging to a file; stopped (SIGTERM, then SIGKILL) in reverse order."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.running: dict[str, subprocess.Popen] = {}

    def start(self, name: str, command: list[str]) -> None:
        log = (self.root / f"{name}.log").open("wb")
        self.running[name] = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=self.root)
        log.close()  # the child holds its own descriptor

    def kill(self, name: str) -> None:
        process = self.running[name]
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=10)

    def wait_ready(self, name: str, url: str, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while not _answers(url):
            if self.running[name].poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"{name} did not become ready at {url}:\n{self.log_tail(name)}")
            time.sleep(0.1)

    def log_tail(self, name: str, lines: int = 30) -> str:
        return "\n".join((self.root / f"{name}.log").read_text(errors="replace").splitlines()[-lines:])

    def stop_all(self) -> None:
        for process in reversed(self.running.values()):
            if process.poll() is None:
                process.terminate()
        for process in reversed(self.running.values()):
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def start_stack(root: Path, ports: Ports, processes: Processes) -> None:
    """Engine first (Prometheus must not see it loading: that is EngineDown), then everything else."""
    configs = write_configs(root, ports)
    python = sys.executable
    processes.start("engine", [python, "-m", "engine", "--model", "tiny", "--device", "cpu",
                               "--port", str(ports.engine), "--num-blocks", "512"])
    processes.start("alertmanager", [binary("alertmanager"), f"--config.file={configs['alertmanager']}",
                                     f"--storage.path={root / 'alertmanager-data'}",
                                     f"--web.listen-address=127.0.0.1:{ports.alertmanager}",
                                     "--cluster.listen-address="])
    processes.wait_ready("engine", f"http://127.0.0.1:{ports.engine}/health")
    processes.start("guard", [python, "-m", "guard", "--config", str(configs["guard"])])
    processes.start("prometheus", [binary("prometheus"), f"--config.file={configs['prometheus']}",
                                   f"--storage.tsdb.path={root / 'prometheus-data'}",
                                   f"--web.listen-address=127.0.0.1:{ports.prometheus}"])
    processes.wait_ready("alertmanager", f"http://127.0.0.1:{ports.alertmanager}/-/ready")
    processes.wait_ready("guard", f"http://127.0.0.1:{ports.guard}/health")
    processes.wait_ready("prometheus", f"http://127.0.0.1:{ports.prometheus}/-/ready")
    # The guard routes to the engine once it has the engine's telemetry (until then it is degraded), and
    # Prometheus starts scraping only when its discovery first publishes the targets (a few seconds).
    guard_health = f"http://127.0.0.1:{ports.guard}/health"
    _wait(lambda: json.loads(urllib.request.urlopen(guard_health, timeout=1).read())["mode"] == "normal", 30,
          f"the guard never reached normal mode:\n{processes.log_tail('guard')}")
    prometheus = Prometheus(ports.prometheus)
    _wait(lambda: len(prometheus.call("query", query="up == 1")["result"]) == 2, 30,
          f"Prometheus never scraped both targets: {prometheus.call('targets')}")


def _wait(done: Callable[[], bool], timeout: float, failure: str) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            raise AssertionError(failure)
        time.sleep(0.1)


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as response:
            return response.status == 200
    except (OSError, urllib.error.HTTPError):
        return False


class Prometheus:
    """The HTTP API calls the test makes: queries POSTed (panel queries are long), metadata by GET."""

    def __init__(self, port: int) -> None:
        self.url = f"http://127.0.0.1:{port}/api/v1/"

    def call(self, endpoint: str, **params: Any) -> Any:
        encoded = urllib.parse.urlencode(params, doseq=True)
        post = endpoint in ("query", "query_range")
        url = self.url + endpoint + ("" if post else "?" + encoded)
        try:
            with urllib.request.urlopen(url, data=encoded.encode() if post else None, timeout=30) as response:
                reply = json.loads(response.read())
        except urllib.error.HTTPError as error:
            reply = json.loads(error.read())
        assert reply["status"] == "success", f"{endpoint} {params}: {reply.get('error')}"
        return reply["data"]

    def query_range(self, query: str, start: float, end: float, step: float) -> list[dict]:
        return self.call("query_range", query=query, start=start, end=end, step=step)["result"]

    def label_values(self, label: str, selector: str, start: float, end: float) -> list[str]:
        return self.call(f"label/{label}/values", **{"match[]": selector}, start=start, end=end)

    def has_series(self, metric: str, start: float, end: float) -> bool:
        return bool(self.call("series", **{"match[]": metric}, start=start, end=end))

    def wait_for(self, query: str, done: Callable[[list[dict]], bool], timeout: float) -> list[dict]:
        deadline = time.monotonic() + timeout
        while True:
            result = self.call("query", query=query)["result"]
            if done(result) or time.monotonic() > deadline:
                return result
            time.sleep(0.25)


class WebhookReceiver:
    """On-call's side: an aiohttp server on its own loop thread recording every Alertmanager notification."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.notifications: list[tuple[float, str, dict]] = []  # (time received, path, payload)
        self._received = threading.Condition()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="webhook-loop", daemon=True)
        self._runner: web.AppRunner | None = None

    def __enter__(self) -> Self:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    async def _start(self) -> None:
        app = web.Application()
        app.router.add_post("/{receiver}", self._receive)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()

    async def _receive(self, request: web.Request) -> web.Response:
        payload = await request.json()
        with self._received:
            self.notifications.append((time.time(), request.path, payload))
            self._received.notify_all()
        return web.Response(status=200)

    def wait_for(self, matches: Callable[[str, dict], bool], since: float,
                 timeout: float) -> tuple[str, dict]:
        """The first notification after ``since`` (wall time) whose path and payload match."""
        deadline = time.monotonic() + timeout
        with self._received:
            while True:
                for received_at, path, payload in self.notifications:
                    if received_at >= since and matches(path, payload):
                        return path, payload
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise AssertionError(f"no matching notification in {timeout} s: {self.notifications}")
                self._received.wait(remaining)
