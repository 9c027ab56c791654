"""The guard's latency predictions against what happened, from its decision logs (``decision_log:``).

For every streamed request with a latency objective and a first token, per lane and replica:

- TTFT: median and p90 of |predicted - actual| / actual, the median of predicted / actual, the share of
  actual TTFTs at or under the predicted p90 (``predicted_ttft_p90_ms``), and the error of the two parts
  (queue: ``predicted_queue_ms`` against ``queue_ms``; engine: ``predicted_engine_ms`` against the rest),
  each over the actual TTFT;
- TPOT: the same for ``predicted_tpot_ms`` against ``observed_tpot_ms`` (streams of two tokens or more);
- the queue wait's actual / predicted by predicted wait (under 0.5 s, 0.5-1.5, 1.5-3, over 3 s): how its
  spread shrinks as the wait grows (what the learned queue margin rests on, guard/admission/slo.py);
- refusals per lane and code.

    .venv/bin/python bench/prediction_errors.py LOG.jsonl [LOG.jsonl ...] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import Counter, defaultdict
from pathlib import Path

BUCKETS_MS = ((0, 500), (500, 1500), (1500, 3000), (3000, float("inf")))


def quantile(values: list[float], q: float) -> float | None:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else None


def errors(pairs: list[tuple[float, float, float | None]]) -> dict:
    """``pairs``: (predicted median, actual, predicted p90 or None)."""
    if not pairs:
        return {"n": 0}
    relative = [abs(p - a) / a for p, a, _ in pairs]
    covered = [a <= p90 for _, a, p90 in pairs if p90 is not None]
    return {"n": len(pairs), "median_abs_rel_error": statistics.median(relative),
            "p90_abs_rel_error": quantile(relative, 0.9),
            "median_predicted_over_actual": statistics.median(p / a for p, a, _ in pairs),
            "actual_within_p90": sum(covered) / len(covered) if covered else None}


def lane_report(records: list[dict]) -> dict:
    ttft, tpot, queue, engine = [], [], [], []
    waits: dict[str, list[float]] = defaultdict(list)
    for r in records:
        slo, actual, waited = r["slo"], r["ttft_ms"], r["queue_ms"]
        ttft.append((slo["predicted_ttft_ms"], actual, slo.get("predicted_ttft_p90_ms")))
        queue.append(abs((slo.get("predicted_queue_ms") or 0.0) - waited) / actual)
        engine.append(abs((slo.get("predicted_engine_ms") or 0.0) - (actual - waited)) / actual)
        if slo.get("predicted_tpot_ms") and slo.get("observed_tpot_ms"):
            tpot.append((slo["predicted_tpot_ms"], slo["observed_tpot_ms"], slo.get("predicted_tpot_p90_ms")))
        predicted_wait = slo.get("predicted_queue_ms") or 0.0
        if predicted_wait > 50:
            lo, hi = next(b for b in BUCKETS_MS if b[0] <= predicted_wait < b[1])
            waits[f"{lo}-{hi}"].append(waited / predicted_wait)
    return {"ttft": errors(ttft) | {"median_queue_part_error": statistics.median(queue),
                                    "median_engine_part_error": statistics.median(engine)},
            "tpot": errors(tpot),
            "queue_actual_over_predicted": {bucket: {"n": len(v), "median": statistics.median(v),
                                                     "p90": quantile(v, 0.9)} for bucket, v in waits.items()}}


def report(path: Path) -> dict:
    by_key: dict[tuple[str, str], list[dict]] = defaultdict(list)
    refusals: Counter[str] = Counter()
    for line in path.read_text().splitlines():
        r = json.loads(line)
        if r.get("shed"):
            refusals[f"{r['lane']} {r['shed']['code']}"] += 1
        slo = r.get("slo") or {}
        if r.get("ttft_ms") and r.get("queue_ms") is not None and slo.get("predicted_ttft_ms") is not None:
            by_key[(r["lane"], r["replica"])].append(r)
    return {"log": str(path), "refusals": dict(refusals),
            "lanes": {f"{lane} on {replica}": lane_report(rs) for (lane, replica), rs in sorted(by_key.items())}}


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("logs", nargs="+", type=Path)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    reports = [report(path) for path in args.logs]
    for rep in reports:
        print(rep["log"], "refusals:", rep["refusals"])
        for key, lane in rep["lanes"].items():
            t, p = lane["ttft"], lane["tpot"]
            print(f"  {key}: TTFT n={t['n']} median |error| {_pct(t['median_abs_rel_error'])}, p90 "
                  f"{_pct(t['p90_abs_rel_error'])}, median predicted/actual {t['median_predicted_over_actual']:.2f}, "
                  f"within p90 {_pct(t['actual_within_p90'])} (queue part {_pct(t['median_queue_part_error'])}, "
                  f"engine part {_pct(t['median_engine_part_error'])}); TPOT n={p['n']}"
                  + (f" median |error| {_pct(p['median_abs_rel_error'])}, p90 {_pct(p['p90_abs_rel_error'])}, "
                     f"within p90 {_pct(p['actual_within_p90'])}" if p["n"] else ""))
            for bucket, spread in lane["queue_actual_over_predicted"].items():
                print(f"    queue wait predicted {bucket} ms: n={spread['n']} actual/predicted median "
                      f"{spread['median']:.2f}, p90 {spread['p90']:.2f}")
    if args.json is not None:
        args.json.write_text(json.dumps(reports, indent=1) + "\n")


if __name__ == "__main__":
    main()
