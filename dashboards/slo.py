"""SLOs: latency quantiles per tenant and lane as clients see them through the guard, the share of requests
within a chosen target, the lanes' latency objectives (attainment, goodput, burn, predictions),
availability, and the error budget with its burn rate.

Availability counts what the service did to valid requests: ``completed`` and ``fallback`` are good,
``upstream_error`` and ``rejected_overload`` are bad. Client-side outcomes (invalid, unauthorized,
cancelled) and a tenant's own over-quota 429s spend no budget. The alert rules use the same split.
"""

from __future__ import annotations

from dashboards.grafana import Row, Target, custom_variable, dashboard, scope_variables, stat, timeseries
from dashboards.queries import increase, lane_quantile, per_lane, quantile, rate, ratio, sel, zero_filled

UID = "kvguard-slo"
TENANTS = 'label_values(guard_requests_total{job=~"$job", instance=~"$instance", tenant!="unknown"}, tenant)'
BAD = 'outcome=~"upstream_error|rejected_overload"'
VALID = 'outcome=~"completed|fallback|upstream_error|rejected_overload"'
TTFT, ITL = "guard_time_to_first_token_seconds", "guard_inter_token_latency_seconds"
# Choices are bucket bounds of the guard's histograms, written as the exposition writes them ("1.0").
TTFT_TARGETS = ["0.1", "0.25", "0.5", "1.0", "2.5", "5.0", "10.0"]
ITL_TARGETS = ["0.01", "0.02", "0.05", "0.1", "0.25"]


def build() -> dict:
    bad = rate(sel("guard_requests_total", BAD, tenant=True))
    valid = rate(sel("guard_requests_total", VALID, tenant=True))
    return dashboard(
        UID, "kvguard / SLOs",
        "Client-facing latency per tenant and lane, SLO attainment, availability and the error budget.",
        [*scope_variables(TENANTS),
         custom_variable("ttft_slo", "TTFT target (s)", TTFT_TARGETS, "0.25",
                         "Time-to-first-token target for the attainment panel (a histogram bucket bound)."),
         custom_variable("itl_slo", "ITL target (s)", ITL_TARGETS, "0.05",
                         "Inter-token latency target for the attainment panel (a histogram bucket bound)."),
         custom_variable("availability_slo", "Availability SLO", ["0.99", "0.995", "0.999"], "0.995",
                         "Share of valid requests that must be served; 1 minus it is the error budget.")],
        [
            Row("Latency per tenant and lane", [
                timeseries("Time to first token", "Arrival at the guard to the first streamed token, "
                           "queueing included: p50, p95, p99 per tenant and lane. Reference target for "
                           "interactive lanes: p95 below 200 ms.", "s",
                           *(Target(lane_quantile(q, TTFT), percentile_legend(q))
                             for q in (0.5, 0.95, 0.99))),
                timeseries("Inter-token latency", "Gap between streamed tokens: p50 and p99 per tenant and "
                           "lane. Reference target: p99 below 20 ms; spikes mid-stream are stalls or "
                           "preemptions.", "s",
                           *(Target(lane_quantile(q, ITL), percentile_legend(q)) for q in (0.5, 0.99))),
                timeseries("Queue wait p95", "Arrival to admission per tenant and lane, the guard's share of "
                           "TTFT.", "s", Target(lane_quantile(0.95, "guard_queue_wait_seconds"),
                                                 "{{tenant}} · {{lane}}")),
                timeseries("End-to-end latency (engine)", "Arrival at the engine to the last token of "
                           "finished requests, p50/p95/p99 per engine. Not split per tenant: no "
                           "tenant-labelled end-to-end histogram is exported.", "s",
                           *(Target(quantile(q, "engine_e2e_request_latency_seconds", ("instance",)),
                                    f"p{round(q * 100)} {{{{instance}}}}") for q in (0.5, 0.95, 0.99))),
            ]),
            Row("SLO attainment", [
                timeseries("First tokens within $ttft_slo s", "Share of requests whose first token came "
                           "within the TTFT target, per tenant and lane.", "percentunit",
                           Target(per_lane(within(TTFT, "$ttft_slo")), "{{tenant}} · {{lane}}"),
                           min=0, max=1),
                timeseries("Token gaps within $itl_slo s", "Share of inter-token gaps within the ITL target, "
                           "per tenant and lane.", "percentunit",
                           Target(per_lane(within(ITL, "$itl_slo")), "{{tenant}} · {{lane}}"),
                           min=0, max=1),
                timeseries("Availability", "Good over valid requests per tenant and lane (see the dashboard "
                           "description for what counts).", "percentunit",
                           Target(per_lane(f"1 - {bad_ratio('$__rate_interval', by='tenant')}"),
                                  "{{tenant}} · {{lane}}"), max=1),
            ]),
            Row("Latency objectives", objective_panels()),
            Row("Error budget", [
                stat("Error budget remaining", "1 - (bad / valid) / (1 - SLO) over the dashboard's time "
                     "range: 100 % untouched, 0 % spent, negative overspent.", "percentunit",
                     Target(f"1 - {bad_ratio('$__range')} / (1 - $availability_slo)"),
                     base="red", thresholds=[(0, "orange"), (0.25, "green")]),
                timeseries("Burn rate", "How fast the budget burns: 1 spends it exactly over the SLO "
                           "period. The burn-rate alert pages at 14.4 over 1 h (and 5 m) and 6 over 6 h (and "
                           "30 m).", "none",
                           *(Target(f"{bad_ratio(window)} / (1 - $availability_slo)", f"{window} window")
                             for window in ("5m", "1h", "6h")),
                           thresholds=[(6, "orange"), (14.4, "red")]),
                timeseries("Bad requests", "Requests that spent budget, per tenant and outcome.", "reqps",
                           Target(zero_filled(f"sum by (tenant, outcome) ({bad})",
                                              f"sum by (tenant) ({valid})"), "{{tenant}} {{outcome}}")),
            ]),
        ],
    )


def objective_panels() -> list:
    """The lanes' latency objectives (``slo``, tightened by ``X-SLO-*`` headers): verdicts, goodput, burn and
    the predictions that admission judged by (guard/admission/slo.py)."""
    verdicts = sel("guard_slo_requests_total")
    met = sel("guard_slo_requests_total", 'met="true"')
    on_time = sel("guard_slo_requests_total", 'objective="ttft"', 'met="true"')
    return [
        timeseries("Objective attainment per lane", "Share of verdicts met, per lane and objective: TTFT met "
                   "when the first token reached the client within the request's objective, TPOT when the "
                   "stream's mean gap did; a refusal (slo_unattainable, overload) misses each of its "
                   "objectives.", "percentunit",
                   Target(ratio(f"sum by (lane, objective) ({rate(met)})",
                                f"sum by (lane, objective) ({rate(verdicts)})"), "{{lane}} · {{objective}}"),
                   min=0, max=1),
        timeseries("Goodput per lane", "Requests whose first token came within their TTFT objective, per "
                   "second and lane: the work that counted.", "reqps",
                   Target(f"sum by (lane) ({rate(on_time)})", "{{lane}}")),
        timeseries("Objective burn rate per class", "Missed verdicts over all verdicts per request class, "
                   "over the 99 % attainment objective's budget (0.01): 1 spends it in 30 days. For the "
                   "critical and standard classes SLOBurnRateFast pages at 14.4 over 1 h (and 5 m) and "
                   "SLOBurnRateSlow opens a ticket at 6 over 6 h (and 30 m); the sheddable class is shed by "
                   "design and alerts nobody.", "none",
                   *(Target(f"{miss_ratio(window)} / 0.01", f"{{{{priority_class}}}} {window}")
                     for window in ("5m", "1h")),
                   thresholds=[(6, "orange"), (14.4, "red")]),
        timeseries("Predicted TTFT", "The TTFT admission predicted for requests with an objective (queue "
                   "wait plus the best replica's engine TTFT), p50 and p95 per lane: set against Time to "
                   "first token above.", "s",
                   *(Target(quantile(q, "guard_ttft_predicted_seconds", ("lane",)),
                            f"p{round(q * 100)} {{{{lane}}}}") for q in (0.5, 0.95))),
        timeseries("TTFT prediction error", "|predicted - observed| TTFT of streams with an objective, p50 "
                   "and p95 per lane. Each replica's latency model relearns within ~20 requests; a lasting "
                   "error means its speed keeps changing.", "s",
                   *(Target(quantile(q, "guard_ttft_prediction_error_seconds", ("lane",)),
                            f"p{round(q * 100)} {{{{lane}}}}") for q in (0.5, 0.95))),
    ]


def miss_ratio(window: str) -> str:
    """Missed over all latency-objective verdicts per request class over ``window`` (as the alerts burn it)."""
    missed = rate(sel("guard_slo_requests_total", 'met="false"'), window)
    verdicts = rate(sel("guard_slo_requests_total"), window)
    by = "sum by (priority_class)"
    return f"({ratio(zero_filled(f'{by} ({missed})', f'{by} ({verdicts})'), f'{by} ({verdicts})')})"


def percentile_legend(q: float) -> str:
    return f"p{round(q * 100)} {{{{tenant}}}} · {{{{lane}}}}"


def within(histogram: str, bound: str) -> str:
    """Per tenant: the share of observations at or below ``bound`` (one of the histogram's bucket bounds)."""
    le = f'le="{bound}"'
    below = f"sum by (tenant) ({rate(sel(f'{histogram}_bucket', le, tenant=True))})"
    total = f"sum by (tenant) ({rate(sel(f'{histogram}_count', tenant=True))})"
    return ratio(below, total)


def bad_ratio(window: str, by: str = "") -> str:
    """Bad over valid requests over ``window`` (0 when none was bad), optionally per ``by``."""
    grouping = f" by ({by})" if by else ""
    bad = f"sum{grouping} ({increase(sel('guard_requests_total', BAD, tenant=True), window)})"
    valid = f"sum{grouping} ({increase(sel('guard_requests_total', VALID, tenant=True), window)})"
    return f"({ratio(zero_filled(bad, valid), valid)})"
