"""A real guard for tests: ``GuardThread`` serves the guard app on a loopback port from its own event-loop
thread, so synchronous clients (the ``openai`` SDK) and the engine's own server thread can talk to it, and
``guard.call(fn)`` reads its state on its loop. ``guard_config`` is the tests' configuration; ``mode_transitions`` reads a guard's mode changes."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from guard.config import GuardConfig
from guard.instance import STATE, GuardState
from guard.server.app import create_app
from guard.wire.connections import GuardRunner

from .loop_thread import AppThread
from .net import request
from .wait import wait_for


def guard_config(engine_url: str | list[str], tmp_path: Path | None = None, **overrides: Any) -> GuardConfig:
    """Three tenants (acme, globex: interactive; bulk: batch) in front of ``engine_url`` (a list: a pool of
    replicas named e0, e1, ...); ``overrides`` replace top-level keys. With ``tmp_path``, also written to
    ``tmp_path / "guard.yaml"`` (for a guard process, and to exercise the YAML path)."""
    engines: dict[str, Any] = ({"engines": [{"name": f"e{i}", "url": url} for i, url in enumerate(engine_url)]}
                               if isinstance(engine_url, list) else {"engine": {"name": "primary", "url": engine_url}})
    raw: dict[str, Any] = {
        "listen": {"host": "127.0.0.1", "port": 0},
        **engines,
        "secret": "test-secret",
        "tenants": [
            {"name": "acme", "api_keys": ["sk-acme"], "weight": 2, "lane": "interactive"},
            {"name": "globex", "api_keys": ["sk-globex"], "weight": 1, "lane": "interactive"},
            {"name": "bulk", "api_keys": ["sk-bulk"], "weight": 1, "lane": "batch", "max_queue": 256},
        ],
    }
    raw.update(overrides)
    if tmp_path is not None:  # also exercise the YAML path
        (tmp_path / "guard.yaml").write_text(yaml.safe_dump(raw))
    return GuardConfig.model_validate(raw)


class GuardThread(AppThread):
    """``with GuardThread(config) as guard``: listening on a free loopback port once entered, its client
    connections guarded as in a guard process."""

    runner_class = GuardRunner

    def __init__(self, config: GuardConfig) -> None:
        super().__init__("test-guard-loop", handler_cancellation=True,
                         shutdown_timeout=config.limits.shutdown_timeout)
        self.config = config

    def make_app(self) -> web.Application:
        return create_app(self.config)

    @property
    def state(self) -> GuardState:
        return self.app[STATE]


@contextlib.contextmanager
def usable_guard(config: GuardConfig, timeout: float = 5.0) -> Iterator[GuardThread]:
    """A guard with a usable replica (its first telemetry snapshot came), for synchronous tests; stopped on
    the way out. ``ready_guard`` (support.nothing_lost) is the ``async`` twin."""
    with GuardThread(config) as guard:
        wait_for(lambda: guard.call(guard.state.pool.any_usable), bool, timeout)
        yield guard


def mode_transitions(guard_url: str) -> dict[tuple[str, str], float]:
    """``guard_mode_transitions_total`` by (from, to), read from the guard's /metrics."""
    text = request(guard_url + "/metrics")[1].decode()
    return {(s.labels["from"], s.labels["to"]): s.value for family in text_string_to_metric_families(text)
            if family.name == "guard_mode_transitions" for s in family.samples if s.name.endswith("_total")}
