"""The routing benchmark's report as PNGs, drawn from its JSON alone (so they can be redrawn later):
``hit_ratio_ttft.png`` (engine-reported hit ratio, TTFT p50/p99 by policy) and ``replica_load.png``
(requests per replica by policy, against the mean and the 1.5x-mean goal)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt

REPLICA_COLORS = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple")


def write_plots(report: dict, out: Path) -> list[Path]:
    """Both PNGs under ``out``; returns their paths."""
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, draw in (("hit_ratio_ttft", _hit_ratio_ttft), ("replica_load", _replica_load)):
        figure = draw(report)
        paths.append(out / f"{name}.png")
        figure.savefig(paths[-1], dpi=100, bbox_inches="tight")
        plt.close(figure)
    return paths


def _subtitle(report: dict) -> str:
    workload = report["workload"]
    return (f"{report['replicas']} replicas of {report['engine_flags'][1]}; {report['tenants']} tenants x "
            f"{workload['conversations']} conversations x {workload['turns']} turns"
            f"{' (QUICK RUN)' if report['quick'] else ''}")


def _hit_ratio_ttft(report: dict) -> plt.Figure:
    runs = report["runs"]
    policies = list(runs)
    figure, (hits, ttft) = plt.subplots(1, 2, figsize=(11, 4.2))
    ratios = [runs[p]["hit_ratio"] or 0.0 for p in policies]
    bars = hits.bar(policies, ratios, color="tab:blue")
    hits.bar_label(bars, fmt="%.2f")
    hits.set_ylim(0, 1)
    hits.set_ylabel("prefix-cache hit tokens / query tokens")
    hits.set_title("Engine-reported hit ratio")
    width = 0.38
    positions = range(len(policies))
    for offset, key, color in ((-width / 2, "p50_ms", "tab:green"), (width / 2, "p99_ms", "tab:red")):
        values = [runs[p]["ttft"][key] or 0.0 for p in policies]
        bars = ttft.bar([x + offset for x in positions], values, width, color=color, label=key[:3])
        ttft.bar_label(bars, fmt="%.0f", fontsize=8)
    ttft.set_xticks(list(positions), policies)
    ttft.set_ylabel("ms (client side, streamed)")
    ttft.set_title("Time to first token")
    ttft.legend()
    for axis in (hits, ttft):
        axis.grid(True, axis="y", alpha=0.3)
    figure.suptitle(_subtitle(report), fontsize=9)
    return figure


def _replica_load(report: dict) -> plt.Figure:
    runs = report["runs"]
    policies = list(runs)
    replicas = list(next(iter(runs.values()))["replicas"])
    figure, axis = plt.subplots(figsize=(9, 4.2))
    width = 0.8 / len(replicas)
    for index, name in enumerate(replicas):
        values = [runs[p]["replicas"][name]["requests"] for p in policies]
        axis.bar([x + (index - (len(replicas) - 1) / 2) * width for x in range(len(policies))], values, width,
                 color=REPLICA_COLORS[index % len(REPLICA_COLORS)], label=name)
    mean = report["requests_per_policy"] / len(replicas)
    axis.axhline(mean, color="grey", linestyle="--", linewidth=0.8, label=f"mean ({mean:.1f})")
    axis.axhline(1.5 * mean, color="black", linestyle=":", linewidth=1.0, label="goal: at most 1.5x the mean")
    axis.set_xticks(range(len(policies)), policies)
    axis.set_ylabel("requests answered (X-Guard-Backend)")
    axis.set_title("Load per replica")
    axis.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    axis.grid(True, axis="y", alpha=0.3)
    figure.suptitle(_subtitle(report), fontsize=9)
    return figure
