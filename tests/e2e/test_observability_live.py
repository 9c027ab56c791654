"""Issues 6 and 15's acceptance, live: a pool of two engine replicas, guard, Prometheus and Alertmanager on
loopback; traffic through the guard; every query of every dashboard panel (template variables resolved
from Prometheus, as Grafana would) returns data. Then one replica is killed: GuardBackendDown reaches the
on-call webhook as a ticket and nothing pages, since the pool still serves; then the other: EngineDown
reaches it through Alertmanager, routed as a page.
"""

from __future__ import annotations

import json
import math
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
from support.grafana_queries import (
    all_of,
    custom_values,
    load_dashboards,
    panel_queries,
    query_variables,
    substitute,
)
from support.live_stack import SCRAPE_INTERVAL_S, TENANTS, Ports, Prometheus, WebhookReceiver, start_stack
from support.processes import Processes
from support.wait import wait_for

from dashboards.promql import metric_uses

# Series that exist only once their event has happened, which this test does not cause. A panel reading
# one may come back empty, but only while Prometheus has no series of it at all.
EVENT_ONLY = {
    "guard_detections_total": "the Fill-and-Squeeze detector's transitions: no tenant attacks here",
    "guard_shared_state_round_trip_seconds_bucket": "Redis round trips: the stack's guard has no shared_state",
    "guard_ratelimit_rejections_total": "rate-limit refusals: the stack's one limited tenant stays far below",
    "engine_lora_requests_total": "LoRA adapters: the stack's engines serve the base model only",
    "engine_lora_resident": "LoRA adapters: the stack's engines serve the base model only",
    "guard_slo_requests_total": "latency objectives: the stack's lanes set no slo",
    "guard_ttft_predicted_seconds_bucket": "latency objectives: the stack's lanes set no slo",
    "guard_ttft_prediction_error_seconds_bucket": "latency objectives: the stack's lanes set no slo",
    "guard_batch_requests_total": "batch lines: the stack's guard serves the Batch API but runs no batch",
    "guard_batch_lines_pending": "batch lines: the stack's guard serves the Batch API but runs no batch",
}
STEP_S = 1
# Grafana's $__rate_interval: max($__interval + scrape interval, 4 x scrape interval).
RATE_INTERVAL = f"{max(STEP_S + SCRAPE_INTERVAL_S, 4 * SCRAPE_INTERVAL_S)}s"
# Longer than one KV block, so that requests sharing it hit the prefix cache.
SHARED_PREFIX = "You are a careful assistant. Answer in one short sentence, without preamble. "
REQUESTS_PER_TENANT = 6


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Ports, Processes, WebhookReceiver]]:
    root = tmp_path_factory.mktemp("observability")
    ports = Ports()
    with WebhookReceiver(ports.webhook) as webhook, Processes(root) as processes:
        start_stack(root, ports, processes)
        yield ports, processes, webhook


def post(ports: Ports, key: str, body: dict, headers: dict[str, str] | None = None) -> tuple[int, str]:
    """POST a completion to the guard and read the whole answer (a stream to its end): the status, and
    the fallback that served it ("" for the engine)."""
    request = urllib.request.Request(
        f"http://127.0.0.1:{ports.guard}/v1/completions", data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            response.read()
            return response.status, response.headers.get("X-Guard-Route", "")
    except urllib.error.HTTPError as error:
        error.read()
        return error.code, error.headers.get("X-Guard-Route", "")


def drive_traffic(ports: Ports, indices: range) -> None:
    """Streamed and unary completions from every tenant (sharing a prompt prefix, a third of them marked as
    client retries), one request with an unknown key and one invalid request."""
    def one(tenant: tuple[str, str, int, str], i: int) -> tuple[int, str]:
        _, key, _, _ = tenant
        body = {"model": "tiny", "prompt": f"{SHARED_PREFIX}Question {i}?", "max_tokens": 12,
                "temperature": 0, "ignore_eos": True, "stream": i % 3 != 2}
        return post(ports, key, body, {"X-Stainless-Retry-Count": "1"} if i % 3 == 0 else None)

    with ThreadPoolExecutor(max_workers=4) as pool:
        work = [(tenant, i) for tenant in TENANTS for i in indices]
        statuses = list(pool.map(lambda job: one(*job), work))
    assert statuses == [(200, "")] * len(statuses), "every request served by the engine"
    assert post(ports, "sk-nobody", {"model": "tiny", "prompt": "hi", "max_tokens": 4})[0] == 401
    assert post(ports, TENANTS[0][1], {"model": "tiny", "prompt": "hi", "max_tokens": -1})[0] == 400


def wait_scraped(prometheus: Prometheus, completed: int) -> None:
    """Until Prometheus has scraped at least ``completed`` completed requests of every tenant."""
    served = f'count(sum by (tenant) (guard_requests_total{{outcome="completed"}}) >= {completed})'
    result = wait_for(lambda: prometheus.query(served), lambda r: bool(r) and r[0]["value"][1] == str(len(TENANTS)),
                      15, interval=0.25, message=lambda: f"not scraped: {served}")
    assert result and result[0]["value"][1] == str(len(TENANTS)), f"not scraped: {served}"


def resolve_variables(prometheus: Prometheus, dashboard: dict, start: float, end: float) -> dict[str, str]:
    """Every template variable as Grafana fills it by default: "All" of its label values, or its current
    custom value; plus the built-in interval variables."""
    values = {"__rate_interval": RATE_INTERVAL, "__interval": f"{STEP_S}s",
              "__range": f"{math.ceil(end - start)}s", **custom_values(dashboard)}
    for name, selector, label in query_variables(dashboard):
        found = prometheus.label_values(label, substitute(selector, values), start, end)
        assert found, f"{dashboard['uid']}: variable {name} has no values"
        values[name] = all_of(found)
    return values


def finite_points(result: list[dict]) -> int:
    return sum(1 for series in result for _, value in series["values"] if math.isfinite(float(value)))


def firing(payload: dict, alertname: str) -> dict | None:
    """The firing alert of that name in an Alertmanager notification, if any."""
    return next((alert for alert in payload["alerts"]
                 if alert["labels"]["alertname"] == alertname and alert["status"] == "firing"), None)


def test_dashboards_show_data_and_a_dead_pool_pages_on_call(stack) -> None:
    ports, processes, webhook = stack
    prometheus = Prometheus(ports.prometheus)
    start = time.time()
    # Two waves: Prometheus sees a counter's first value as where it starts, so the series the first wave
    # creates get their rates from the second.
    drive_traffic(ports, range(2))
    wait_scraped(prometheus, 2)
    drive_traffic(ports, range(2, REQUESTS_PER_TENANT))
    wait_scraped(prometheus, REQUESTS_PER_TENANT)
    time.sleep(int(RATE_INTERVAL.removesuffix("s")))  # the engine's last samples fill one rate interval

    # The first incident: replica e1 dies. The pool still serves, so on-call gets a ticket, not a page.
    killed_at = time.time()
    processes["engine-e1"].kill()
    time.sleep(1)  # the guard opens a dead replica's circuit at once; a second is issue 15's allowance
    for i in range(3):
        answer = post(ports, TENANTS[0][1], {"model": "tiny", "prompt": f"e1 is gone {i}", "max_tokens": 4})
        assert answer == (200, ""), f"e0 serves alone: {answer}"
        time.sleep(0.5)
    path, payload = webhook.wait_for(lambda path, payload: firing(payload, "GuardBackendDown"),
                                     since=killed_at, timeout=30)
    alert = firing(payload, "GuardBackendDown")
    assert path == "/ticket" and payload["receiver"] == "oncall-ticket", "warnings open a ticket"
    assert alert["labels"]["backend"] == "e1" and alert["labels"]["severity"] == "warning"
    pages = [path for received_at, path, _ in list(webhook.notifications)
             if received_at >= killed_at and path == "/page"]
    assert pages == [], "one replica down while the other serves pages nobody"

    # The second: e0 dies too, and with it the pool. Clients keep coming (the guard degrades to its static
    # fallback).
    killed_at = time.time()
    processes["engine-e0"].kill()
    for i in range(3):
        post(ports, TENANTS[0][1], {"model": "tiny", "prompt": f"after the crash {i}", "max_tokens": 4})
        time.sleep(0.5)
    path, payload = webhook.wait_for(lambda path, payload: firing(payload, "EngineDown"),
                                     since=killed_at, timeout=30)
    alert = firing(payload, "EngineDown")
    assert path == "/page" and payload["receiver"] == "oncall-page", "critical alerts page"
    assert alert["labels"]["job"] == "engine" and alert["labels"]["severity"] == "critical"
    assert alert["labels"]["instance"] in {f"127.0.0.1:{port}" for port in ports.engines.values()}
    assert alert["annotations"]["runbook_url"] == "alerts/runbooks/engine-down.md"

    end = time.time()
    empty = []
    for name, dashboard in load_dashboards().items():
        values = resolve_variables(prometheus, dashboard, start, end)
        for title, expr in panel_queries(dashboard):
            if finite_points(prometheus.query_range(substitute(expr, values), start, end, STEP_S)):
                continue
            names = {use.name for use in metric_uses(expr)}
            if any(n in EVENT_ONLY and not prometheus.has_series(n, start, end) for n in names):
                continue
            empty.append(f"{name}: {title!r}: {substitute(expr, values)}")
    assert empty == [], "panels without data:\n" + "\n".join(empty)
