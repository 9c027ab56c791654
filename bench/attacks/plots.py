"""The Fill-and-Squeeze report as PNGs, drawn from the report's JSON alone (so they can be redrawn later).

Both runs share one time axis, seconds since the attack phase began (negative: the baseline), so the same
moment of the attack lines up in the unguarded and the guarded run. A dotted line marks the attacker's
first long request (the fill) in each run.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt

COLORS = {"unguarded": "tab:red", "guarded": "tab:blue"}
STATE_NAMES = ("normal", "suspect", "confirmed")
# guard/detect/detector.py's thresholds, drawn for reference only.
SUSPECT_AT, CONFIRM_AT = 0.5, 0.75
X_LABEL = "seconds since the attack phase began (dotted: the attacker's first long request)"


def write_plots(report: dict, out: Path) -> list[Path]:
    """``victim_ttft.png``, ``free_blocks.png`` and ``detector.png`` under ``out``; returns their paths."""
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, draw in (("victim_ttft", _victim_ttft), ("free_blocks", _free_blocks), ("detector", _detector)):
        figure = draw(report)
        paths.append(out / f"{name}.png")
        figure.savefig(paths[-1], dpi=100, bbox_inches="tight")
        plt.close(figure)
    return paths


def _series(run: dict, column: str) -> list:
    timeline = run["timeline"]
    index = timeline["columns"].index(column)
    return [row[index] for row in timeline["rows"]]


def _times(run: dict) -> list[float]:
    start = run["phases_s"]["attack"][0]
    return [at - start for at in _series(run, "at")]


def _mark_fill(axis: plt.Axes, runs: dict) -> None:
    axis.axvline(0.0, color="black", linewidth=0.8)
    for name, run in runs.items():
        if (fill := run["attacker"]["fill_start_s"]) is not None:
            axis.axvline(fill - run["phases_s"]["attack"][0], color=COLORS[name], linestyle=":",
                         linewidth=1.2)


def _victim_ttft(report: dict) -> plt.Figure:
    runs = report["runs"]
    figure, axis = plt.subplots(figsize=(10, 4.5))
    for name, run in runs.items():
        start = run["phases_s"]["attack"][0]
        served = [(sent - start, 1e3 * ttft) for sent, ttft, _ in run["victim_requests"] if ttft is not None]
        ttft = run["victims"]
        axis.scatter([x for x, _ in served], [y for _, y in served], s=9, color=COLORS[name], alpha=0.7,
                     label=f"{name}: p99 {ttft['baseline']['ttft']['p99_ms'] or 0:.0f} ms in the baseline, "
                           f"{ttft['attack']['ttft']['p99_ms'] or 0:.0f} ms under attack")
        if refused := [sent - start for sent, ttft, _ in run["victim_requests"] if ttft is None]:
            axis.scatter(refused, [1.0] * len(refused), marker="x", color=COLORS[name],
                         label=f"{name}: no token ({len(refused)}, drawn at 1 ms)")
    _mark_fill(axis, runs)
    axis.set_yscale("log")
    axis.set_xlabel(X_LABEL)
    axis.set_ylabel("victim TTFT (ms, log scale)")
    axis.set_title("Victims' time to first token, by arrival")
    axis.legend(loc="upper left", fontsize=8)
    axis.grid(True, which="both", alpha=0.3)
    return figure


def _free_blocks(report: dict) -> plt.Figure:
    runs = report["runs"]
    figure, (blocks, preempted) = plt.subplots(2, 1, figsize=(10, 6), sharex=True, height_ratios=(2, 1))
    for name, run in runs.items():
        times, preemptions = _times(run), _series(run, "preemptions_total")
        blocks.step(times, _series(run, "reclaimable_blocks"), where="post", color=COLORS[name], label=name)
        preempted.step(times, [p - preemptions[0] for p in preemptions], where="post", color=COLORS[name],
                       label=name)
    num_blocks = _series(runs["guarded"], "num_blocks")[0]
    safe = report["guard_config"]["admission"]["safe_utilization"]
    blocks.axhline(num_blocks, color="grey", linewidth=0.8, linestyle="--",
                   label=f"pool ({num_blocks} blocks)")
    blocks.axhline(num_blocks * (1 - safe), color=COLORS["guarded"], linewidth=0.8, linestyle="--",
                   label=f"the guard's floor (1 - safe_utilization {safe})")
    for axis in (blocks, preempted):
        _mark_fill(axis, runs)
        axis.grid(True, alpha=0.3)
    blocks.set_ylabel("engine blocks free or cached")
    blocks.set_title("The engine's KV pool (GET /telemetry every 0.25 s)")
    blocks.legend(loc="lower left", fontsize=8)
    preempted.set_ylabel("preemptions\nsince the run began")
    preempted.set_xlabel(X_LABEL)
    preempted.legend(loc="upper left", fontsize=8)
    return figure


def _detector(report: dict) -> plt.Figure:
    run = report["runs"]["guarded"]
    times = _times(run)
    figure, (score, blocks) = plt.subplots(2, 1, figsize=(10, 6), sharex=True, height_ratios=(3, 2))
    score.step(times, _series(run, "suspicion"), where="post", color="tab:purple",
               label="suspicion (left axis)")
    score.step(times, [state / 2 for state in _series(run, "state")], where="post", color="black",
               linewidth=1.5, label="state (right axis)")
    for level, name in ((SUSPECT_AT, "suspect"), (CONFIRM_AT, "confirmed")):
        score.axhline(level, color="grey", linestyle="--", linewidth=0.8)
        score.annotate(f"{name} at {level}", (times[0], level), xytext=(0, 2), textcoords="offset points",
                       fontsize=7, color="grey")
    score.set_ylim(-0.05, 1.05)
    states = score.twinx()
    states.set_ylim(score.get_ylim())
    states.set_yticks([0.0, 0.5, 1.0], STATE_NAMES)
    score.set_ylabel("guard_fill_squeeze_suspicion")
    confirmed = run["detection"]["confirmed_after_fill_s"]
    verdict = "never confirmed" if confirmed is None else f"confirmed {confirmed:.1f} s after the fill began"
    score.set_title(f"The attacker in the guarded run (GET /metrics every 0.25 s): {verdict}\n"
                    "(the unguarded run has no detector)")
    score.legend(loc="upper left", fontsize=8)
    blocks.step(times, _series(run, "attacker_reserved"), where="post", color="tab:orange",
                label="reserved in the guard")
    blocks.step(times, _series(run, "attacker_blocks"), where="post", color="tab:green",
                label="held in the engine")
    blocks.set_ylabel("the attacker's blocks")
    blocks.set_xlabel(X_LABEL)
    blocks.legend(loc="upper left", fontsize=8)
    for axis in (score, blocks):
        _mark_fill(axis, {"guarded": run})
        axis.grid(True, alpha=0.3)
    return figure
