"""Issue 43's goals, judged on bench/slo.py's cell reports (one JSON file per scenario and load).

Every goal is judged per round (a configuration against another in the same round: the same seeds, minutes
apart on a shared machine) and then across rounds as the issue words it: the median of the rounds meets the
goal, and no round is worse than 0.9x it (for an upper bound, no round above it / 0.9). A goal whose cell
or configuration was not run is reported as not judged (None), never as met.

S1's validity gate (B1's interactive attainment <= 90 % at L = 2) is reported beside its goals: where it
fails, S1 does not test what it was meant to, and its goals say little.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from pathlib import Path

from slo_scenarios import BATCH, INTERACTIVE

Block = dict


def load_cells(directory: Path) -> dict[str, dict]:
    """Every cell report in ``directory`` by cell name (``goals.json`` and partial files are not cells)."""
    cells = {}
    for path in sorted(directory.glob("*.json")) if directory.exists() else []:
        report = json.loads(path.read_text())
        if report.get("benchmark") == "slo" and "cell" in report:
            cells[report["cell"]] = report
    return cells


def blocks(cell: dict | None, config: str) -> list[Block] | None:
    if cell is None or config not in cell["configs"]:
        return None
    return sorted(cell["configs"][config]["blocks"], key=lambda b: b["round"])


def judge(what: str, cell: str, values: list[float | None] | None, target: float | tuple[float, float],
          direction: str) -> dict:
    """One goal over the rounds' ``values`` (``direction``: ``>=``, ``<=`` or ``in`` a (low, high) range)."""
    values = [v for v in values or [] if v is not None]
    row = {"goal": what, "cell": cell, "target": target, "direction": direction, "per_round": values,
           "median": statistics.median(values) if values else None, "worst": None, "met": None}
    if not values:
        return row
    median = row["median"]
    if direction == ">=":
        row["worst"] = min(values)
        row["met"] = median >= target and row["worst"] >= 0.9 * target
    elif direction == "<=":
        row["worst"] = max(values)
        row["met"] = median <= target and row["worst"] <= (target / 0.9 if target else 0)
    else:
        low, high = target
        row["worst"] = min(values) if abs(min(values) - 1) > abs(max(values) - 1) else max(values)
        row["met"] = low <= median <= high and all(0.9 * low <= v <= high / 0.9 for v in values)
    return row


def per_round(a: list[Block] | None, f: Callable[[Block], float | None]) -> list[float | None] | None:
    """f(a's block), round by round (None: ``a`` was not run)."""
    return None if a is None else [f(x) for x in a]


def ratio(a: list[Block] | None, b: list[Block] | None, f: Callable[[Block], float | None],
          g: Callable[[Block], float | None] | None = None) -> list[float | None] | None:
    """f(a's block) / g(b's block) (g: f), round by round (None: either was not run)."""
    if a is None or b is None:
        return None
    g = g or f
    out = []
    for x, y in zip(a, b):
        num, den = f(x), g(y)
        out.append(None if num is None or not den else num / den)
    return out


def goodput(b: Block) -> float:
    return b["goodput_per_s"]


def lane(name: str, field: str) -> Callable[[Block], float | None]:
    return lambda b: b["lanes"][name][field]


def predicted(field: str, group: str, key: str) -> Callable[[Block], float | None]:
    """A block's prediction figure ``key`` of ``field`` over ``group`` (bench/slo_measures.py)."""
    return lambda block: (block["prediction"].get(field, {}).get(group) or {}).get(key)


def s1_goals(cells: dict[str, dict]) -> list[dict]:
    """S1's goals at every interactive share run (the issue's 0.5, and any raised where its gate failed)."""
    suffixes = sorted({name.split("_", 2)[2] if name.count("_") > 1 else "" for name in cells if name.startswith("S1_")})
    return [row for suffix in suffixes or [""] for row in s1_share_goals(cells, suffix)]


def s1_share_goals(cells: dict[str, dict], suffix: str) -> list[dict]:
    rows = []
    n2, n4 = "S1_L2" + (suffix and "_" + suffix), "S1_L4" + (suffix and "_" + suffix)
    l2, l4 = cells.get(n2), cells.get(n4)
    rows.append(judge("gate: B1 interactive attainment at L = 2", n2,
                      per_round(blocks(l2, "b1"), lane(INTERACTIVE, "attainment")), 0.90, "<="))
    for name, cell in ((n2, l2), (n4, l4)):
        a = blocks(cell, "a")
        rows.append(judge("(a) interactive attainment", name, per_round(a, lane(INTERACTIVE, "attainment")),
                          0.99, ">="))
        worst = min((b["lanes"][INTERACTIVE]["attainment"] or 0.0 for b in a), default=None) if a else None
        rows.append(judge("(a) interactive attainment, worst block", name, [worst], 0.97, ">="))
        for config, target in (("b1", 1.3), ("b2", 1.15), ("b3", 1.0)):
            rows.append(judge(f"(a) request goodput over {config.upper()}", name,
                              ratio(a, blocks(cell, config), goodput), target, ">="))
        oracle = cell.get("oracle_goodput_per_s") if cell else None
        rows.append(judge("(a) request goodput over the oracle", name,
                          [goodput(x) / o if o else None for x, o in zip(a, oracle)] if a and oracle else None,
                          0.9, ">="))
    rows.append(judge("(a) request goodput at L = 4 over L = 2", f"{n4}/{n2}",
                      ratio(blocks(l4, "a"), blocks(l2, "a"), goodput), 0.95, ">="))
    return rows


def s2_goals(cells: dict[str, dict]) -> list[dict]:
    rows = []
    for name in ("S2_L2", "S2_L3"):
        cell = cells.get(name)
        a, b1, b2 = blocks(cell, "a"), blocks(cell, "b1"), blocks(cell, "b2")
        best = [max(goodput(x), goodput(y)) for x, y in zip(b1, b2)] if b1 and b2 else None
        rows.append(judge("(a) request goodput over the better of B1 and B2", name,
                          [goodput(x) / y if y else None for x, y in zip(a, best)] if a and best else None, 1.0, ">="))
        rows.append(judge("(a) on-time batch over B1's batch completions", name,
                          ratio(a, b1, lane(BATCH, "met"), lane(BATCH, "served")), 0.9, ">="))
        rows.append(judge("(a) late share of served sheddable (batch)", name, per_round(a, lane(BATCH, "late_share")),
                          0.05, "<="))
        rows.append(judge("(a) token goodput over B2", name,
                          ratio(a, b2, lambda b: b["token_goodput_per_s"]), 1.05, ">="))
    return rows


def s3_goals(cells: dict[str, dict]) -> list[dict]:
    cell = cells.get("S3_L2")
    a = blocks(cell, "a")
    return [judge("(a) interactive attainment", "S3_L2", per_round(a, lane(INTERACTIVE, "attainment")), 0.99, ">="),
            judge("(a) request goodput over (a) without the slo filter", "S3_L2",
                  ratio(a, blocks(cell, "a_nofilter"), goodput), 1.15, ">=")]


def prediction_goals(cells: dict[str, dict]) -> list[dict]:
    """The guard's median predictions of TTFT and TPOT (``predicted_ttft_ms``, ``predicted_tpot_ms``: every
    such field it logged but the p90s and the TTFT's parts), per lane and replica, in every cell's (a). A p90
    prediction is not judged by its error: its coverage (the share of actuals at or under it) is in the
    reports."""
    rows = []
    for name, cell in sorted(cells.items()):
        a = blocks(cell, "a") or []
        fields = sorted({f for b in a for f in b.get("prediction", {})
                         if ("ttft" in f or "tpot" in f) and "p90" not in f})
        for field in fields:
            groups = sorted({g for b in a for g in b["prediction"].get(field, {}) if g != "all"})
            for group in groups:
                rows.append(judge(f"{field} median abs. error, {group}", name, per_round(a, predicted(field, group, "median_abs_rel_error")),
                                  0.25, "<="))
                rows.append(judge(f"{field} median predicted/actual, {group}", name,
                                  per_round(a, predicted(field, group, "median_predicted_over_actual")), (0.8, 1.25), "in"))
                if group == f"lane:{BATCH}":
                    rows.append(judge(f"{field} p90 abs. error, {group} (sheddable)", name,
                                      per_round(a, predicted(field, group, "p90_abs_rel_error")), 1.0, "<="))
    return rows


def refusal_goals(cells: dict[str, dict]) -> list[dict]:
    rows = []
    for name, cell in sorted(cells.items()):
        a = blocks(cell, "a") or []
        for code in sorted({c for b in a for c in b["refusals"]}):
            rows.append(judge(f"(a) refusal p95 ms, {code}", name,
                              [b["refusals"][code]["p95_ms"] if code in b["refusals"] else None for b in a], 200.0, "<="))
        rows.append(judge("(a) engine preemptions of critical (interactive) sequences", name,
                          per_round(a, lambda b: b["critical_preemptions"]), 0.0, "<="))
    return rows


def evaluate(cells: dict[str, dict]) -> list[dict]:
    return [*s1_goals(cells), *s2_goals(cells), *s3_goals(cells), *prediction_goals(cells), *refusal_goals(cells)]


def goal_lines(goals: list[dict]) -> list[str]:
    def fmt(v: float | None) -> str:
        return "-" if v is None else f"{v:.3f}"
    lines = [f"{'cell':12} {'goal':62} {'target':>14} {'median':>8} {'worst':>8}  met  per round"]
    for g in goals:
        target = g["target"] if isinstance(g["target"], (int, float)) else tuple(g["target"])
        met = {True: "yes", False: "NO", None: "-"}[g["met"]]
        lines.append(f"{g['cell']:12} {g['goal'][:62]:62} {g['direction'] + ' ' + str(target):>14} {fmt(g['median']):>8} "
                     f"{fmt(g['worst']):>8}  {met:3}  {', '.join(fmt(v) for v in g['per_round'])}")
    return lines


def _median(values: list[float | None]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f} %"


def _num(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def config_rows(cell: dict) -> list[str]:
    """A Markdown table of one cell: per configuration, medians over its rounds (and the rounds' range of
    request goodput)."""
    rows = [("| configuration | request goodput/s (rounds) | token goodput/s | interactive | batch | late share "
             "(batch) | refusals: code n, p95 | engine KV used | load |"),
            "| --- | --- | ---: | ---: | ---: | ---: | --- | ---: | ---: |"]
    for entry in cell["configs"].values():
        bs = entry["blocks"]
        codes: dict[str, list] = {}
        for b in bs:
            for code, r in b["refusals"].items():
                codes.setdefault(code, []).append(r)
        refusals = "; ".join(f"{code} {sum(r['n'] for r in rs)}, {max(r['p95_ms'] for r in rs):.0f} ms"
                             for code, rs in codes.items()) or "-"
        rounds = ", ".join(_num(b["goodput_per_s"]) for b in bs)
        rows.append(f"| {entry['label']} | {_num(_median([b['goodput_per_s'] for b in bs]))} ({rounds}) | "
                    f"{_num(_median([b['token_goodput_per_s'] for b in bs]), 0)} | "
                    f"{_pct(_median([b['lanes'][INTERACTIVE]['attainment'] for b in bs]))} | "
                    f"{_pct(_median([b['lanes'][BATCH]['attainment'] for b in bs]))} | "
                    f"{_pct(_median([b['lanes'][BATCH]['late_share'] for b in bs]))} | {refusals} | "
                    f"{_pct(_median([b['kv_used_mean'] for b in bs]))} | "
                    f"{_num(_median([b['load_average_1m'] for b in bs]), 1)} |")
    return rows


def goal_rows(goals: list[dict]) -> list[str]:
    """The goals as a Markdown table."""
    rows = ["| cell | goal | target | median | worst round | met | rounds |", "| --- | --- | --- | ---: | ---: | --- | --- |"]
    for g in goals:
        target = g["target"] if isinstance(g["target"], (int, float)) else f"[{g['target'][0]}, {g['target'][1]}]"
        met = {True: "yes", False: "**no**", None: "not run"}[g["met"]]
        rows.append(f"| {g['cell']} | {g['goal']} | {g['direction']} {target} | {_num(g['median'], 3)} | "
                    f"{_num(g['worst'], 3)} | {met} | {', '.join(_num(v, 3) for v in g['per_round'])} |")
    return rows
