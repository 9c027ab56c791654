"""bench/slo.py's figures for one block (one configuration, one round): from the clients' results and the
guard's decision records.

- A request *meets its objective* when it is answered in full (200, its stream ended) and its first token
  came within its lane's TTFT objective of its scheduled arrival. Request goodput: those per second of
  arrivals; token goodput: their generated tokens (``max_tokens``: every request sets ``ignore_eos``) per
  second.
- *Late*: served in full, first token past the objective; ``late_share`` is late over served.
- Refusals: answers other than 200, by ``status code``, their latency from scheduled arrival to answer.
- Prediction error, from the decision records of the block (``slo`` holds the guard's predictions): read
  tolerantly, every ``predicted_*_ms`` field found is scored against what it predicts (TTFT for
  ``*ttft*``, the stream's mean time per output token for ``*tpot*``, the guard's queue for ``*queue*``,
  admission to the first token for ``*engine*``), by lane and by replica: median and p90 of
  |predicted - actual| / actual, median predicted / actual, and the share of actuals at or under the
  prediction (what a p90 predictor should hold near 0.9). The queue and engine parts are scored over the
  actual TTFT, as a share of what the client waited.
"""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from pathlib import Path

from latency import percentile, summarize
from slo_scenarios import INTERACTIVE, Scenario, objective_s
from tenant_load import Result, status_counts


def met(result: Result, objective: float) -> bool:
    return served(result) and result.first_token - result.arrival <= objective


def served(result: Result) -> bool:
    return result.status == 200 and result.finished is not None and result.first_token is not None


def block_figures(sc: Scenario, results: dict[str, list[Result]], seconds: float, batch_ttft_s: float,
                  preemptions: dict[str, int]) -> dict:
    """One block's figures per lane and in all (see the module docstring)."""
    lanes: dict[str, dict] = {}
    refusals: dict[str, list[float]] = defaultdict(list)
    for lane in sorted({t.lane for t in sc.tenants}):
        objective = objective_s(lane, batch_ttft_s)
        tenants = [t for t in sc.tenants if t.lane == lane]
        rows = [(r, t.max_tokens) for t in tenants for r in results[t.name]]
        good = [tokens for r, tokens in rows if met(r, objective)]
        n_served = sum(served(r) for r, _ in rows)
        lanes[lane] = {"sent": len(rows), "served": n_served, "met": len(good), "late": n_served - len(good),
                       "attainment": len(good) / len(rows) if rows else None,
                       "late_share": (n_served - len(good)) / n_served if n_served else None,
                       "goodput_per_s": len(good) / seconds, "token_goodput_per_s": sum(good) / seconds,
                       "statuses": status_counts([r for r, _ in rows]),
                       "ttft": summarize([r.first_token - r.arrival for r, _ in rows if r.first_token is not None]),
                       "engine_preemptions": sum(preemptions.get(t.name, 0) for t in tenants)}
        for r, _ in rows:
            if r.finished is not None and r.status != 200:
                refusals[f"{r.status} {r.error}".strip()].append(r.finished - r.arrival)
    served_all = sum(lane["served"] for lane in lanes.values())
    return {"lanes": lanes, "goodput_per_s": sum(lane["goodput_per_s"] for lane in lanes.values()),
            "token_goodput_per_s": sum(lane["token_goodput_per_s"] for lane in lanes.values()),
            "offered_per_s": sum(lane["sent"] for lane in lanes.values()) / seconds,
            "late_share": sum(lane["late"] for lane in lanes.values()) / served_all if served_all else None,
            "refusals": {code: _latencies(values) for code, values in sorted(refusals.items())},
            "critical_preemptions": lanes.get(INTERACTIVE, {}).get("engine_preemptions", 0)}


def _latencies(seconds: list[float]) -> dict:
    ordered = sorted(seconds)
    return {"n": len(ordered), "p50_ms": 1e3 * percentile(ordered, 50), "p95_ms": 1e3 * percentile(ordered, 95),
            "max_ms": 1e3 * ordered[-1]}


def read_records(log: Path) -> list[dict]:
    """Every decision record of ``log`` and its rotated files (oldest first); an unreadable line is skipped."""
    files = sorted(log.parent.glob(log.name + ".*"), key=lambda p: -int(p.suffix[1:]) if p.suffix[1:].isdigit() else 0)
    records = []
    for path in [*files, log]:
        if path.exists():
            for line in path.read_text().splitlines():
                try:
                    records.append(json.loads(line))
                except ValueError:
                    continue
    return records


def _actual_ms(which: str, record: dict) -> tuple[float | None, float | None]:
    """(what ``predicted_<which>_ms`` predicts, what its error is divided by) for one record."""
    ttft, queue = record.get("ttft_ms"), record.get("queue_ms")
    if not ttft:
        return None, None
    if "tpot" in which:
        total = sum(stage.get("ms") or 0.0 for stage in record.get("stages") or [])
        tokens = (record.get("usage") or {}).get("completion_tokens") or 0
        tpot = (total - ttft) / (tokens - 1) if tokens > 1 and total > ttft else None
        return tpot, tpot
    if "queue" in which:
        return queue, ttft
    if "engine" in which:
        return (None, None) if queue is None else (ttft - queue, ttft)
    return (ttft, ttft) if "ttft" in which else (None, None)


def prediction_rows(records: list[dict]) -> dict[str, dict[str, list[tuple[float, float, float]]]]:
    """``{field: {"lane:<lane>" | "replica:<name>" | "all": [(predicted, actual, scale), ...]}}``."""
    rows: dict[str, dict[str, list]] = defaultdict(lambda: defaultdict(list))
    for record in records:
        slo = record.get("slo") or {}
        for key, predicted in slo.items():
            if not (key.startswith("predicted_") and key.endswith("_ms")) or not isinstance(predicted, (int, float)):
                continue
            actual, scale = _actual_ms(key[len("predicted_"):-len("_ms")], record)
            if actual is None or not scale or actual < 0:
                continue
            row = (float(predicted), float(actual), float(scale))
            for group in ("all", f"lane:{record.get('lane')}", f"replica:{record.get('replica')}"):
                rows[key][group].append(row)
    return rows


def prediction_error(records: list[dict]) -> dict:
    """Per prediction field and group (see ``prediction_rows``): the error's median and p90, the bias and the
    coverage."""
    out: dict[str, dict] = {}
    for key, groups in prediction_rows(records).items():
        out[key] = {}
        for group, rows in sorted(groups.items()):
            errors = sorted(abs(p - a) / s for p, a, s in rows)
            ratios = [p / a for p, a, _ in rows if a > 0]
            out[key][group] = {"n": len(rows), "median_abs_rel_error": statistics.median(errors),
                               "p90_abs_rel_error": percentile(errors, 90),
                               "median_predicted_over_actual": statistics.median(ratios) if ratios else None,
                               "covered": sum(a <= p for p, a, _ in rows) / len(rows)}
    return out


def in_window(records: list[dict], began: float, ended: float) -> list[dict]:
    """The records of requests that ended between ``began`` and ``ended`` (Unix seconds)."""
    return [r for r in records if began <= (r.get("time") or 0.0) <= ended]
