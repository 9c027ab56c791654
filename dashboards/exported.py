"""The series our code exports, read from the metric definitions in ``engine/server/metrics.py`` and
``guard/metrics.py``, and the Batch API's in ``guard/batch/metrics.py`` (on the guard's registry when
``batch`` is configured).

Read with ``ast`` rather than imported: the engine's state metrics exist only while a scrape renders them,
and importing the engine would pull in torch. A definition is any call that names a ``prometheus_client``
metric class together with a string literal, either as the callee (``Gauge("guard_queue_depth", ...)``) or
as an argument (``_labelled(GaugeMetricFamily, "engine_kv_blocks", ...)``).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCES = (ROOT / "engine" / "server" / "metrics.py", ROOT / "guard" / "metrics.py",
           ROOT / "guard" / "batch" / "metrics.py")

COUNTER, GAUGE = "counter", "gauge"
# What each class exports, as (suffix, kind). A counter family's name drops its "_total" and the exposition
# adds it back; histogram buckets, sums and counts only grow, so they are read like counters.
EXPOSITION = {
    "Counter": (("_total", COUNTER),),
    "CounterMetricFamily": (("_total", COUNTER),),
    "Gauge": (("", GAUGE),),
    "GaugeMetricFamily": (("", GAUGE),),
    "Histogram": (("_bucket", COUNTER), ("_sum", COUNTER), ("_count", COUNTER)),
    "LoopHistogram": (("_bucket", COUNTER), ("_sum", COUNTER), ("_count", COUNTER)),  # guard/metrics.py
    "InfoMetricFamily": (("_info", GAUGE),),
}
# Series Prometheus itself attaches to every scrape target.
SCRAPE_SERIES = {"up": GAUGE}


def exported_series(sources: tuple[Path, ...] = SOURCES) -> dict[str, str]:
    """Series name -> ``"counter"`` or ``"gauge"``, for every series the code exports (plus ``up``)."""
    series = dict(SCRAPE_SERIES)
    for source in sources:
        for cls, name in _definitions(ast.parse(source.read_text(), str(source))):
            family = name.removesuffix("_total")
            for suffix, kind in EXPOSITION[cls]:
                series[family + suffix] = kind
    return series


def _definitions(tree: ast.AST) -> list[tuple[str, str]]:
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        parts = [node.func, *node.args]
        classes = [_name(p) for p in parts if _name(p) in EXPOSITION]
        names = [p.value for p in node.args if isinstance(p, ast.Constant) and isinstance(p.value, str)]
        if classes and names:
            found.append((classes[0], names[0]))
    return found


def _name(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None
