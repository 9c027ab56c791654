"""Grafana 11 dashboard JSON as plain dicts: the conventions every kvguard dashboard follows live here.

- One ``datasource`` variable of type datasource; every panel and query points at ``${datasource}``, so a
  dashboard imports into any Grafana without the ``${DS_PROMETHEUS}`` input dance.
- ``job`` and ``instance`` variables (multi-value, "All" by default), chained, and a ``tenant`` variable.
- Every panel has a title, a description (what it shows and what good looks like) and a unit.
- A stable ``uid`` per dashboard, so links and provisioning survive regeneration.

Panels are laid out left to right in Grafana's 24-column grid, wrapping to a new line when full; a row
header starts a new line. A row may repeat once per value of a variable (one row per engine replica); its
panels then read that variable as a single value.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
GRID_WIDTH = 24
SCHEMA_VERSION = 39  # Grafana 11.0
JSON = dict[str, Any]


@dataclass(slots=True)
class Target:
    expr: str
    legend: str = ""


@dataclass(slots=True)
class Panel:
    kind: str  # timeseries, stat, state-timeline, table
    title: str
    description: str
    unit: str
    targets: list[Target]
    width: int = 12
    height: int = 8
    min: float | None = None
    max: float | None = None
    thresholds: list[tuple[float, str]] = field(default_factory=list)  # (from value, color) above ``base``
    base: str = "green"  # the color below the first threshold (red where low is bad)
    mappings: dict[int, tuple[str, str]] = field(default_factory=dict)  # value -> (text, color)
    stacked: bool = False


@dataclass(slots=True)
class Row:
    title: str
    panels: list[Panel]
    repeat: str | None = None  # a variable's name: Grafana draws the row once per selected value


def timeseries(title: str, description: str, unit: str, *targets: Target, **options: Any) -> Panel:
    return Panel("timeseries", title, description, unit, list(targets), **options)


def stat(title: str, description: str, unit: str, *targets: Target, **options: Any) -> Panel:
    return Panel("stat", title, description, unit, list(targets), **{"width": 6, "height": 5, **options})


def state_timeline(title: str, description: str, target: Target, mappings: dict[int, tuple[str, str]],
                   **options: Any) -> Panel:
    return Panel("state-timeline", title, description, "none", [target], mappings=mappings, **options)


def table(title: str, description: str, *targets: Target, **options: Any) -> Panel:
    return Panel("table", title, description, "none", list(targets), **options)


def dashboard(uid: str, title: str, description: str, variables: list[JSON], rows: list[Row]) -> JSON:
    return {
        "uid": uid,
        "title": title,
        "description": description,
        "tags": ["kvguard"],
        "editable": True,
        "graphTooltip": 1,  # shared crosshair: line up a spike across panels
        "refresh": "30s",
        "schemaVersion": SCHEMA_VERSION,
        "time": {"from": "now-1h", "to": "now"},
        "timezone": "browser",
        "version": 1,
        "links": [{"title": "kvguard dashboards", "type": "dashboards", "tags": ["kvguard"],
                   "asDropdown": True, "includeVars": True, "keepTime": True}],
        "annotations": {"list": []},
        "templating": {"list": [datasource_variable(), *variables]},
        "panels": _layout(rows),
    }


def datasource_variable() -> JSON:
    return {"name": "datasource", "label": "Data source", "type": "datasource", "query": "prometheus",
            "current": {}, "hide": 0, "includeAll": False, "multi": False, "refresh": 1, "regex": "",
            "options": []}


def query_variable(name: str, label: str, query: str) -> JSON:
    """A multi-value variable from ``label_values(...)``, "All" by default, refreshed with the time range."""
    return {"name": name, "label": label, "type": "query", "datasource": DATASOURCE,
            "query": {"query": query, "refId": f"{name}-variable"}, "definition": query,
            "current": {"text": ["All"], "value": ["$__all"]}, "includeAll": True, "multi": True,
            "refresh": 2, "sort": 1, "hide": 0, "regex": "", "options": []}


def custom_variable(name: str, label: str, values: list[str], default: str, description: str) -> JSON:
    """A single-value choice among fixed ``values`` (a threshold, a target)."""
    return {"name": name, "label": label, "type": "custom", "description": description,
            "query": ",".join(values), "current": {"text": default, "value": default}, "hide": 0,
            "includeAll": False, "multi": False,
            "options": [{"text": v, "value": v, "selected": v == default} for v in values]}


def scope_variables(tenant_query: str) -> list[JSON]:
    """``job`` -> ``instance`` -> ``tenant``, each narrowed by the ones before it."""
    return [
        query_variable("job", "Job", "label_values(up, job)"),
        query_variable("instance", "Instance", 'label_values(up{job=~"$job"}, instance)'),
        query_variable("tenant", "Tenant", tenant_query),
    ]


def _layout(rows: list[Row]) -> list[JSON]:
    out: list[JSON] = []
    y = 0
    for row in rows:
        out.append({"type": "row", "title": row.title, "collapsed": False, "panels": [],
                    "gridPos": {"x": 0, "y": y, "w": GRID_WIDTH, "h": 1},
                    **({"repeat": row.repeat} if row.repeat else {})})
        y += 1
        x = line_height = 0
        for panel in row.panels:
            if x + panel.width > GRID_WIDTH:
                x, y, line_height = 0, y + line_height, 0
            out.append(_panel(panel, {"x": x, "y": y, "w": panel.width, "h": panel.height}))
            x += panel.width
            line_height = max(line_height, panel.height)
        y += line_height
    for number, panel in enumerate(out, start=1):
        panel["id"] = number
    return out


def _panel(panel: Panel, grid: JSON) -> JSON:
    defaults: JSON = {"unit": panel.unit, "color": {"mode": "palette-classic"},
                      "thresholds": {"mode": "absolute", "steps": [{"color": panel.base, "value": None}] + [
                          {"color": color, "value": value} for value, color in panel.thresholds]}}
    if panel.min is not None:
        defaults["min"] = panel.min
    if panel.max is not None:
        defaults["max"] = panel.max
    if panel.mappings:
        defaults["mappings"] = [{"type": "value", "options": {
            str(value): {"text": text, "color": color, "index": index}
            for index, (value, (text, color)) in enumerate(sorted(panel.mappings.items()))}}]
        defaults["color"] = {"mode": "thresholds"}
    if panel.kind == "timeseries":
        defaults["custom"] = {"drawStyle": "line", "lineWidth": 1, "fillOpacity": 15 if panel.stacked else 5,
                              "showPoints": "never", "spanNulls": False,
                              "stacking": {"mode": "normal" if panel.stacked else "none", "group": "A"}}
    table = panel.kind == "table"
    return {
        "type": panel.kind,
        "title": panel.title,
        "description": panel.description,
        "datasource": DATASOURCE,
        "gridPos": grid,
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": _options(panel.kind),
        "targets": [{"refId": chr(ord("A") + i), "datasource": DATASOURCE, "expr": t.expr,
                     "legendFormat": t.legend or "__auto", "range": not table, "instant": table,
                     **({"format": "table"} if table else {})}
                    for i, t in enumerate(panel.targets)],
    }


def _options(kind: str) -> JSON:
    if kind == "stat":
        return {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                "colorMode": "background", "graphMode": "area", "textMode": "auto", "justifyMode": "auto"}
    if kind == "state-timeline":
        return {"mergeValues": True, "showValue": "auto", "rowHeight": 0.8, "legend": {"showLegend": False}}
    if kind == "table":
        return {"showHeader": True, "cellHeight": "sm"}
    return {"legend": {"displayMode": "table", "placement": "bottom", "calcs": ["lastNotNull", "max"],
                       "showLegend": True},
            "tooltip": {"mode": "multi", "sort": "desc"}}
