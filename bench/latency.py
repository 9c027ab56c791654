"""Latency samples to the figures a report quotes: count, mean and nearest-rank percentiles, in ms."""

from __future__ import annotations

import math


def percentile(ordered: list[float], q: float) -> float:
    """Nearest-rank percentile of an ascending list: an observed value, never an interpolation, so a p99 of
    few samples reads as what it is (close to the maximum)."""
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def summarize(seconds: list[float]) -> dict[str, float | int | None]:
    """``n``, ``mean_ms``, ``p50_ms``, ``p90_ms``, ``p99_ms`` and ``max_ms``; None without samples."""
    if not seconds:
        return {"n": 0, "mean_ms": None, "p50_ms": None, "p90_ms": None, "p99_ms": None, "max_ms": None}
    ordered = sorted(seconds)
    return {"n": len(ordered), "mean_ms": 1e3 * sum(ordered) / len(ordered),
            "p50_ms": 1e3 * percentile(ordered, 50), "p90_ms": 1e3 * percentile(ordered, 90),
            "p99_ms": 1e3 * percentile(ordered, 99), "max_ms": 1e3 * ordered[-1]}
