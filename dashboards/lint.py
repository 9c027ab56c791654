"""The dashboard conventions, checked on the generated JSON (what Grafana actually loads)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from dashboards.grafana import DATASOURCE
from dashboards.promql import counters_outside_readers, metric_uses, unguarded_divisions

REQUIRED_VARIABLES = {"datasource": "datasource", "job": "query", "instance": "query", "tenant": "query"}


def panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel that shows data (rows are layout only)."""
    return (p for p in dashboard["panels"] if p["type"] != "row")


def lint(dashboard: dict[str, Any], series: dict[str, str]) -> list[str]:
    """Convention breaches of one dashboard, each prefixed with the dashboard's uid and the panel's title."""
    uid = dashboard.get("uid") or "(no uid)"
    problems = [] if dashboard.get("uid") else [f"{uid}: the dashboard has no uid"]
    if "${DS_" in json.dumps(dashboard):
        problems.append(f"{uid}: uses a ${{DS_...}} import input instead of the datasource variable")
    variables = {v["name"]: v["type"] for v in dashboard["templating"]["list"]}
    for name, kind in REQUIRED_VARIABLES.items():
        if variables.get(name) != kind:
            problems.append(f"{uid}: needs a {kind} variable named {name!r}")
    problems += [f"{uid}: row {row['title']!r} repeats over {row['repeat']!r}, which is not a variable"
                 for row in dashboard["panels"]
                 if row["type"] == "row" and row.get("repeat") and row["repeat"] not in variables]
    counters = {name for name, kind in series.items() if kind == "counter"}
    for panel in panels(dashboard):
        where = f"{uid}: panel {panel.get('title') or '(untitled)'!r}"
        for key in ("title", "description"):
            if not panel.get(key):
                problems.append(f"{where}: no {key}")
        if not panel["fieldConfig"]["defaults"].get("unit"):
            problems.append(f"{where}: no unit")
        if panel.get("datasource") != DATASOURCE:
            problems.append(f"{where}: the panel's datasource is not ${{datasource}}")
        for target in panel["targets"]:
            if target.get("datasource") != DATASOURCE:
                problems.append(f"{where}: query {target['refId']}'s datasource is not ${{datasource}}")
            problems += [f"{where}: {p}" for p in lint_expr(target["expr"], series, counters)]
    return problems


def lint_expr(expr: str, series: dict[str, str], counters: set[str]) -> list[str]:
    problems = [f"{name} is not exported by engine/server/metrics.py or guard/metrics.py"
                for name in sorted({use.name for use in metric_uses(expr)} - series.keys())]
    problems += [f"counter {name} read outside rate()/increase()"
                 for name in counters_outside_readers(expr, counters)]
    problems += [f"division by a denominator that may be zero: / {text}"
                 for text in unguarded_divisions(expr)]
    return problems
