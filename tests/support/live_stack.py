"""The observability stack for the live test, as real processes on free loopback ports: a pool of two tiny
engine replicas (e0, e1), the guard, Prometheus and Alertmanager, plus an aiohttp webhook receiver standing
in for on-call.

Prometheus and Alertmanager run test variants of the committed configs, rewritten rather than copied so
that the committed files stay realistic: 1 s scrapes and rule evaluations, `for:` durations of 1 s, no
notification grouping delays, the test's own ports, and webhooks pointed at the receiver.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from aiohttp import web

from .guard_server import guard_config
from .loop_thread import AppThread
from .net import free_port, request
from .processes import Processes
from .prometheus_tools import ALERTS, binary
from .wait import wait_for

SCRAPE_INTERVAL_S = 1
TENANTS = [  # (name, key, weight, lane)
    ("acme", "sk-acme-live", 2, "interactive"),
    ("globex", "sk-globex-live", 1, "agent"),
    ("bulk", "sk-bulk-live", 1, "batch"),
]


REPLICAS = ("e0", "e1")  # the guard's pool, as guard.example.yaml names it


@dataclass(slots=True)
class Ports:
    engines: dict[str, int] = field(default_factory=lambda: {name: free_port() for name in REPLICAS})
    guard: int = field(default_factory=free_port)
    prometheus: int = field(default_factory=free_port)
    alertmanager: int = field(default_factory=free_port)
    webhook: int = field(default_factory=free_port)


def prometheus_config(ports: Ports, rules_dir: Path) -> dict[str, Any]:
    """alerts/prometheus.yml with the test's ports and rules, scraping the jobs this test runs."""
    config = yaml.safe_load((ALERTS / "prometheus.yml").read_text())
    interval = f"{SCRAPE_INTERVAL_S}s"
    config["global"].update(scrape_interval=interval, scrape_timeout=interval, evaluation_interval=interval)
    config["rule_files"] = [str(rules_dir / "*.yml")]
    alertmanager = {"targets": [f"127.0.0.1:{ports.alertmanager}"]}
    config["alerting"]["alertmanagers"][0]["static_configs"] = [alertmanager]
    targets = {"engine": list(ports.engines.values()), "guard": [ports.guard]}
    config["scrape_configs"] = [job for job in config["scrape_configs"] if job["job_name"] in targets]
    assert len(config["scrape_configs"]) == len(targets), "a job the test scrapes is gone from prometheus.yml"
    for job in config["scrape_configs"]:
        job["static_configs"] = [{"targets": [f"127.0.0.1:{port}" for port in targets[job["job_name"]]]}]
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
    tenants = [{"name": n, "api_keys": [k], "weight": w, "lane": lane} for n, k, w, lane in TENANTS]
    tenants[-1] |= {"rpm": 100_000, "tpm": 10_000_000}  # rate-limit series to show, far above what it sends
    # A list of URLs is a pool of replicas named e0, e1, ... (writes root / "guard.yaml").
    guard_config([f"http://127.0.0.1:{port}" for port in ports.engines.values()], root,
                 listen={"host": "127.0.0.1", "port": ports.guard}, secret="live-test-secret",
                 tenants=tenants, fallbacks=[{"name": "static", "message": "degraded; retry shortly"}],
                 batch={"store": str(root / "batches")})  # the Batch API's series (no batch runs)
    paths["prometheus"].write_text(yaml.safe_dump(prometheus_config(ports, rules_dir)))
    paths["alertmanager"].write_text(yaml.safe_dump(alertmanager_config(ports)))
    return paths


def start_stack(root: Path, ports: Ports, processes: Processes) -> None:
    """Engines first (Prometheus must not see them loading: that is EngineDown), then everything else."""
    configs = write_configs(root, ports)
    engines = [processes.engine("--device", "cpu", "--num-blocks", "512", port=port, name=f"engine-{name}",
                                wait=False) for name, port in ports.engines.items()]
    alertmanager = processes.start(
        "alertmanager", [binary("alertmanager"), f"--config.file={configs['alertmanager']}",
                         f"--storage.path={root / 'alertmanager-data'}",
                         f"--web.listen-address=127.0.0.1:{ports.alertmanager}", "--cluster.listen-address="],
        ready_url=f"http://127.0.0.1:{ports.alertmanager}/-/ready", cwd=root, wait=False)
    for engine in engines:
        engine.wait_ready()
    guard = processes.guard(configs["guard"], wait=False)
    prometheus_process = processes.start(
        "prometheus", [binary("prometheus"), f"--config.file={configs['prometheus']}",
                       f"--storage.tsdb.path={root / 'prometheus-data'}",
                       f"--web.listen-address=127.0.0.1:{ports.prometheus}"],
        ready_url=f"http://127.0.0.1:{ports.prometheus}/-/ready", cwd=root, wait=False)
    for process in (alertmanager, guard, prometheus_process):
        process.wait_ready()
    # The guard routes to the engine once it has the engine's telemetry (until then it is degraded), and
    # Prometheus starts scraping only when its discovery first publishes the targets (a few seconds).
    wait_for(lambda: json.loads(request(guard.url + "/health", timeout=1)[1])["mode"],
             lambda mode: mode == "normal", 30, interval=0.1,
             message=lambda: f"the guard never reached normal mode:\n{guard.log_tail()}")
    prometheus = Prometheus(ports.prometheus)
    wait_for(lambda: len(prometheus.query("up == 1")), lambda up: up == len(ports.engines) + 1, 30,
             interval=0.1,
             message=lambda: f"Prometheus never scraped every target: {prometheus.call('targets')}")


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

    def query(self, query: str) -> list[dict]:
        """An instant query's result."""
        return self.call("query", query=query)["result"]


class WebhookReceiver(AppThread):
    """On-call's side: an aiohttp server on its own loop thread recording every Alertmanager notification."""

    def __init__(self, port: int) -> None:
        super().__init__("webhook-loop", port)
        self.notifications: list[tuple[float, str, dict]] = []  # (time received, path, payload)
        self._lock = threading.Lock()

    def make_app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/{receiver}", self._receive)
        return app

    async def _receive(self, request: web.Request) -> web.Response:
        payload = await request.json()
        with self._lock:
            self.notifications.append((time.time(), request.path, payload))
        return web.Response(status=200)

    def wait_for(self, matches: Callable[[str, dict], bool], since: float,
                 timeout: float) -> tuple[str, dict]:
        """The first notification after ``since`` (wall time) whose path and payload match."""

        def first_match() -> tuple[str, dict] | None:
            with self._lock:
                received = list(self.notifications)
            return next(((path, payload) for received_at, path, payload in received
                         if received_at >= since and matches(path, payload)), None)

        found = wait_for(first_match, lambda match: match is not None, timeout, interval=0.1,
                         message=lambda: f"no matching notification in {timeout} s: {self.notifications}")
        assert found is not None
        return found
