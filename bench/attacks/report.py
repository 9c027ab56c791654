"""The Fill-and-Squeeze report: figures from the raw runs, verdicts against issue 8's targets, and the text
table (bench/run_info.py writes the JSON file).

A victim's TTFT runs from its scheduled arrival to its first token. One still without a token when the run
is cut waited at least until then and counts with that lower bound; one refused (429, 503) has no TTFT and
shows up in the statuses instead.
"""

from __future__ import annotations

from collections import Counter
from itertools import pairwise

from bench.attacks.timeline import Sample
from bench.attacks.victims import VictimRequest
from bench.latency import summarize

# Issue 16's acceptance (the default config, no max_blocks_share): p99 at most 2x, with 1.5x as the goal.
TARGETS = {"unguarded_mean_ttft_ratio_min": 5.0, "guarded_p99_ttft_ratio_max": 2.0,
           "guarded_p99_ttft_ratio_goal": 1.5, "guarded_preemptions_share_max": 0.10, "confirmed_within_s": 10.0}


def victim_summary(victims: list[VictimRequest], start: float, end: float, cut: float) -> dict:
    """The victims' requests that arrived in ``[start, end)``."""
    arrived = [r.outcome for r in victims if start <= r.outcome.sent < end]
    waiting = [o for o in arrived if o.first_token is None and o.finished is None]
    ttfts = [o.ttft for o in arrived if o.ttft is not None] + [cut - o.sent for o in waiting]
    return {"sent": len(arrived), "statuses": dict(Counter(o.label for o in arrived)),
            "no_token_by_cut": len(waiting), "ttft": summarize(ttfts)}


def longest_gap(samples: list[Sample], start: float, end: float) -> float | None:
    """The longest time between two readings in ``[start, end)``, which the sampler takes every 0.25 s: well
    above that, the harness's own process stalled (a shared machine's other load), and every victim sent
    meanwhile was sent late, its TTFT charged with the stall."""
    gaps = [b - a for a, b in pairwise(s.at for s in samples if start <= s.at < end)]
    return round(max(gaps), 3) if gaps else None


def detection(samples: list[Sample], fill_start: float | None, origin: float) -> dict:
    """When the scrapes first showed the attacker ``suspect`` and ``confirmed`` (every key of it): seconds
    after the fill began (the attacker's first long request), and since the run began; and whether any
    victim was ever anything but ``normal``."""
    first = {level: next((s.at for s in samples if s.state is not None and s.state >= level), None)
             for level in (1, 2)}

    def after(t: float | None, start: float | None) -> float | None:
        return None if t is None or start is None else round(t - start, 3)

    return {"suspect_after_fill_s": after(first[1], fill_start),
            "confirmed_after_fill_s": after(first[2], fill_start), "confirmed_at_s": after(first[2], origin),
            "victims_flagged": any(s.victims_state for s in samples)}


def ttft_ratios(run: dict, baseline: dict | None = None) -> dict[str, float | None]:
    """The attack phase's victim TTFT over a baseline (mean, p50, p99): the same run's baseline phase, or,
    given ``baseline`` (the control run), the same phase of a run with the same arrivals and no attacker."""
    attack = run["victims"]["attack"]["ttft"]
    base = (baseline or run)["victims"]["attack" if baseline is not None else "baseline"]["ttft"]
    return {f: attack[f"{f}_ms"] / base[f"{f}_ms"] if attack[f"{f}_ms"] is not None and base[f"{f}_ms"]
            else None for f in ("mean", "p50", "p99")}


def verdicts(unguarded: dict, guarded: dict) -> dict[str, bool]:
    preempted = unguarded["engine_preemptions"]
    share = guarded["engine_preemptions"]["attack"] / max(1, preempted["attack"])
    return {
        "unguarded_mean_ttft_ratio": _at_least(unguarded["ttft_ratios"]["mean"],
                                               TARGETS["unguarded_mean_ttft_ratio_min"]),
        "unguarded_preemptions_climb": preempted["attack"] > preempted["baseline"],
        "guarded_p99_ttft_ratio": _at_most(guarded["ttft_vs_control"]["p99"],
                                           TARGETS["guarded_p99_ttft_ratio_max"]),
        "guarded_preemptions_share": share <= TARGETS["guarded_preemptions_share_max"],
        "confirmed_within_10_s": _at_most(guarded["detection"]["confirmed_after_fill_s"],
                                          TARGETS["confirmed_within_s"]),
        "victims_never_flagged": not guarded["detection"]["victims_flagged"],
    }


def _at_least(value: float | None, bound: float) -> bool:
    return value is not None and value >= bound


def _at_most(value: float | None, bound: float) -> bool:
    return value is not None and value <= bound


def table(report: dict) -> str:
    """Victims' TTFT (ms) per run and phase, engine preemptions, and the longest gap between two readings
    ("stall": how long the harness itself was held up; 0.25 s when it never was)."""
    head = (f"{'run':10} {'phase':9} {'victims':>7} {'ok':>4} {'TTFT mean':>9} {'p50':>7} {'p99':>7} "
            f"{'max':>7} {'preempt':>7} {'stall s':>7}")
    rows = [head, "-" * len(head)]
    for name, run in {**report["runs"], "control": report["control"]}.items():
        for phase in ("baseline", "attack"):
            victims, ttft = run["victims"][phase], run["victims"][phase]["ttft"]
            rows.append(f"{name:10} {phase:9} {victims['sent']:>7} {victims['statuses'].get('200', 0):>4} "
                        f"{_ms(ttft['mean_ms']):>9} {_ms(ttft['p50_ms']):>7} {_ms(ttft['p99_ms']):>7} "
                        f"{_ms(ttft['max_ms']):>7} {run['engine_preemptions'][phase]:>7} "
                        f"{run['longest_sampling_gap_s'][phase] or 0:>7.2f}")
    return "\n".join(rows)


def verdict_lines(report: dict) -> list[str]:
    unguarded, guarded = report["runs"]["unguarded"], report["runs"]["guarded"]
    ok, found = report["verdicts"], guarded["detection"]
    return [
        (f"unguarded: victim mean TTFT {_x(unguarded['ttft_ratios']['mean'])} its baseline (target >= 5x) "
         f"{_mark(ok['unguarded_mean_ttft_ratio'])}; engine preemptions "
         f"{unguarded['engine_preemptions']['baseline']} in the baseline, "
         f"{unguarded['engine_preemptions']['attack']} in the attack "
         f"{_mark(ok['unguarded_preemptions_climb'])}"),
        (f"guarded: victim p99 TTFT {_x(guarded['ttft_vs_control']['p99'])} the same arrivals' without the "
         f"attack (target <= 2x, goal <= 1.5x; {_x(guarded['ttft_ratios']['p99'])} the baseline phase's) "
         f"{_mark(ok['guarded_p99_ttft_ratio'])}; engine preemptions "
         f"{guarded['engine_preemptions']['attack']} vs "
         f"{unguarded['engine_preemptions']['attack']} unguarded (target <= 10%) "
         f"{_mark(ok['guarded_preemptions_share'])}"),
        (f"detection: suspect {_s(found['suspect_after_fill_s'])}, confirmed (every key) "
         f"{_s(found['confirmed_after_fill_s'])} after the fill began (target <= 10 s) "
         f"{_mark(ok['confirmed_within_10_s'])}; victims flagged: "
         f"{'yes' if found['victims_flagged'] else 'never'} {_mark(ok['victims_never_flagged'])}"),
    ]


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def _x(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}x"


def _s(value: float | None) -> str:
    return "never" if value is None else f"{value:.1f} s"


def _mark(passed: bool) -> str:
    return "PASS" if passed else "MISS"
