"""The autoscaling signals live: a real tiny engine and a real guard on loopback, the signals read from the
guard's /metrics as Prometheus would. Under load the KV budget fills and requests queue, so
``guard_saturation`` rises and ``guard_desired_replicas`` follows past one replica; once the load stops both
come back (the count after ``scale_down_delay_s``). The planner's arithmetic is
tests/guard/test_autoscale_signals.py."""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor

from prometheus_client.parser import text_string_to_metric_families
from support.engine_server import ServerThread
from support.guard_server import guard_config, usable_guard
from support.net import request
from support.wait import wait_for

POOL = "tiny"
CLIENTS = 12
# 200 prompt tokens (the tiny model's tokenizer is bytes) + 64 out: 17 blocks of 16, three at a time in the
# guard's budget of 0.85 x 64 blocks, so twelve clients keep nine waiting.
BODY = json.dumps({"model": "tiny", "prompt": "x" * 200, "max_tokens": 64, "ignore_eos": True}).encode()


def signals(guard_url: str) -> tuple[float, float]:
    """(desired replicas, saturation) of the pool, from the guard's /metrics."""
    found = {family.name: sample.value
             for family in text_string_to_metric_families(request(guard_url + "/metrics")[1].decode())
             for sample in family.samples if sample.labels == {"pool": POOL}}
    return found["guard_desired_replicas"], found["guard_saturation"]


def load(url: str, stop: threading.Event) -> list[int]:
    statuses = []
    while not stop.is_set():
        statuses.append(request(url + "/v1/completions", BODY, {"Authorization": "Bearer sk-acme"})[0])
    return statuses


def test_saturation_rises_under_load_desired_replicas_follow_and_both_come_back():
    autoscaling = {"pool": POOL, "interval_s": 0.2, "window_s": 2.0, "scale_down_delay_s": 2.0}
    with ServerThread(num_blocks=64, block_size=16) as engine, \
            usable_guard(guard_config(engine.url, autoscaling=autoscaling)) as guard:
        assert wait_for(lambda: signals(guard.url), lambda s: s == (1.0, 0.0), timeout=5, interval=0.2)
        stop = threading.Event()
        with ThreadPoolExecutor(CLIENTS) as clients:
            runs = [clients.submit(load, guard.url, stop) for _ in range(CLIENTS)]
            try:
                loaded = wait_for(lambda: signals(guard.url), lambda s: s[0] >= 2 and s[1] >= 0.9, timeout=20,
                                  interval=0.2)
            finally:
                stop.set()
            statuses = [status for run in runs for status in run.result()]
        assert statuses and set(statuses) == {200}
        after = wait_for(lambda: signals(guard.url), lambda s: s == (1.0, 0.0), timeout=20, interval=0.2)
    assert loaded[0] >= 2 and loaded[1] >= 0.9 and after == (1.0, 0.0)
