"""The committed dashboards' queries as Grafana would send them: template variables substituted.

Grafana replaces a multi-value variable inside a Prometheus regex matcher with ``(v1|v2|...)`` (each value
regex-escaped), a custom variable with its current value, and ``$__rate_interval``/``$__range``/
``$__interval`` with durations derived from the step and the scrape interval.
"""

from __future__ import annotations

import json
import re
from typing import Any

from . import ROOT

DASHBOARDS = ROOT / "dashboards" / "json"
LABEL_VALUES = re.compile(r"^label_values\((?:(?P<selector>.+),\s*)?(?P<label>[A-Za-z_][A-Za-z0-9_]*)\)$")


def load_dashboards() -> dict[str, dict[str, Any]]:
    return {path.name: json.loads(path.read_text()) for path in sorted(DASHBOARDS.glob("*.json"))}


def panel_queries(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """``(panel title, expr)`` for every query of every panel."""
    return [(panel["title"], target["expr"]) for panel in dashboard["panels"] if panel["type"] != "row"
            for target in panel["targets"]]


def query_variables(dashboard: dict[str, Any]) -> list[tuple[str, str, str]]:
    """``(name, selector, label)`` of each ``label_values`` variable, in dependency order (as declared)."""
    out = []
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            match = LABEL_VALUES.match(variable["definition"])
            assert match, f"not a label_values() query: {variable['definition']}"
            out.append((variable["name"], match["selector"] or "", match["label"]))
    return out


def custom_values(dashboard: dict[str, Any]) -> dict[str, str]:
    variables = dashboard["templating"]["list"]
    return {v["name"]: v["current"]["value"] for v in variables if v["type"] == "custom"}


def all_of(values: list[str]) -> str:
    """What Grafana puts in a regex matcher for "All" of a multi-value variable: each value regex-escaped,
    with the backslashes doubled for the PromQL string literal the matcher is written in."""
    return "(" + "|".join(re.escape(v).replace("\\", "\\\\") for v in values) + ")"


def substitute(text: str, values: dict[str, str]) -> str:
    """Replace ``$name`` and ``${name}``, longer names first (``$__range`` must not eat
    ``$__rate_interval``)."""
    for name in sorted(values, key=len, reverse=True):
        text = text.replace("${" + name + "}", values[name]).replace("$" + name, values[name])
    leftover = re.search(r"\$\{?\w+", text)
    assert leftover is None, f"unsubstituted variable {leftover.group()} in {text}"
    return text
