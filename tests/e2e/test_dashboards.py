"""The dashboard generator: committed JSON is current, conventions hold, every query is valid PromQL, and
``--check`` catches what it promises to catch."""

from __future__ import annotations

import sys

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from support.grafana_queries import custom_values, load_dashboards, panel_queries, substitute
from support.processes import run_command
from support.prometheus_tools import binary

from dashboards.__main__ import DASHBOARDS, check
from dashboards.exported import exported_series
from dashboards.lint import lint
from engine.server.metrics import EngineMetrics, EngineReading
from guard.batch.metrics import BatchMetrics
from guard.metrics import GuardMetrics

# The sample names each family type exposes (the "_created" timestamps, which no query reads, left out).
SUFFIXES = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count"),
            "info": ("_info",)}


def test_committed_dashboards_are_current_and_pass_the_check() -> None:
    result = run_command(sys.executable, "-m", "dashboards", "--check")
    assert result.returncode == 0, result.stdout + result.stderr
    assert set(load_dashboards()) == set(DASHBOARDS)


def test_every_query_is_valid_promql(tmp_path) -> None:
    """promtool parses each query (variables substituted) as a recording rule."""
    rules = []
    for dashboard in load_dashboards().values():
        values = {"job": ".*", "instance": ".*", "tenant": ".*", "backend": ".*", "__rate_interval": "1m",
                  "__range": "1h", **custom_values(dashboard)}
        rules += [{"record": f"panel:query:{i}", "expr": substitute(expr, values)}
                  for i, (_, expr) in enumerate(panel_queries(dashboard), start=len(rules))]
    path = tmp_path / "queries.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "panels", "rules": rules}]}))
    result = run_command(binary("promtool"), "check", "rules", path)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_inventory_matches_what_the_code_exports(llm) -> None:
    """The parsed inventory equals the families a guard registry (with the Batch API's series, which a guard
    with ``batch`` adds) and a rendered engine scrape declare."""
    rendered = EngineMetrics().render(EngineReading.of(llm.core, True, 0)).decode()
    guard = GuardMetrics()
    BatchMetrics(guard)
    families = [*guard.registry.collect(), *text_string_to_metric_families(rendered)]
    declared = {family.name + suffix for family in families for suffix in SUFFIXES[family.type]
                if not family.name.endswith("_created")}
    assert declared == exported_series().keys() - {"up"}


@pytest.mark.parametrize(("expr", "complaint"), [
    ("sum(guard_requests_total)", "counter guard_requests_total read outside rate()/increase()"),
    ("sum(rate(guard_requests_total[5m])) / sum(rate(guard_requests_total[5m]))",
     "denominator that may be zero"),
    ("sum(rate(guard_requests_totals[5m]))", "guard_requests_totals is not exported"),
    ("histogram_quantile(0.9, sum by (le) (guard_queue_wait_seconds_bucket))", "counter guard_queue_wait"),
    ("max_over_time(engine_preemptions_total[5m])", "counter engine_preemptions_total read outside"),
])
def test_the_check_rejects_a_bad_query(expr: str, complaint: str) -> None:
    dashboard = DASHBOARDS["engine-kv-cache.json"]()
    dashboard["panels"][1]["targets"][0]["expr"] = expr
    assert any(complaint in p for p in lint(dashboard, exported_series())), lint(dashboard, exported_series())


def test_the_check_rejects_missing_metadata_and_import_inputs() -> None:
    dashboard = DASHBOARDS["slo.json"]()
    panel = dashboard["panels"][1]
    panel["description"] = ""
    panel["fieldConfig"]["defaults"]["unit"] = ""
    panel["datasource"] = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
    dashboard["templating"]["list"] = [v for v in dashboard["templating"]["list"] if v["name"] != "tenant"]
    problems = "\n".join(lint(dashboard, exported_series()))
    for complaint in ("no description", "no unit", "datasource is not ${datasource}", "${DS_...}",
                      "query variable named 'tenant'"):
        assert complaint in problems


def test_the_pool_dashboard_repeats_a_row_per_replica() -> None:
    """Issue 15's row per replica: Grafana repeats it over the ``backend`` variable, and each of its panels
    reads that one replica."""
    dashboard = load_dashboards()["guard-pool.json"]
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["backend"]["multi"] and variables["backend"]["includeAll"]
    rows = [i for i, panel in enumerate(dashboard["panels"]) if panel["type"] == "row"]
    repeated = [i for i in rows if dashboard["panels"][i].get("repeat") == "backend"]
    assert len(repeated) == 1 and repeated[0] == rows[-1], "the repeated row comes last: it owns what follows"
    replica_panels = dashboard["panels"][repeated[0] + 1:]
    assert replica_panels
    assert all('backend=~"$backend"' in target["expr"] for panel in replica_panels for target in panel["targets"])
    dashboard["panels"][repeated[0]]["repeat"] = "replica"
    assert any("repeats over 'replica'" in p for p in lint(dashboard, exported_series()))


def test_the_check_reports_stale_json() -> None:
    built = {name: build() for name, build in DASHBOARDS.items()}
    built["slo.json"]["title"] += " (edited)"
    assert check(built) == ["slo.json: stale; run python -m dashboards"]
