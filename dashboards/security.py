"""Security: the Fill-and-Squeeze detector's view of each tenant, the raw signals it reads (probe cadence,
request cost, block share, whose sequences get preempted), and what the guard did about it."""

from __future__ import annotations

from dashboards.grafana import Row, Target, dashboard, scope_variables, state_timeline, timeseries
from dashboards.queries import increase, rate, ratio, sel, zero_filled

UID = "kvguard-security"
TENANTS = 'label_values(guard_requests_total{job=~"$job", instance=~"$instance", tenant!="unknown"}, tenant)'
DETECTOR_STATES = {0: ("normal", "green"), 1: ("suspect", "orange"), 2: ("confirmed", "red")}
REJECTED = 'outcome=~"rejected_quota|rejected_overload"'
UNAUTHORIZED = 'outcome="unauthorized"'


def build() -> dict:
    requests = f"sum by (tenant) ({rate(sel('guard_requests_total', tenant=True))})"
    rejected = f"sum by (tenant, outcome) ({rate(sel('guard_requests_total', REJECTED, tenant=True))})"
    service = f"sum by (tenant) ({rate(sel('guard_service_tokens_total', tenant=True))})"
    victims = sel("engine_tenant_preemptions_total", tenant=True)
    detections = increase(sel("guard_detections_total", tenant=True), "$__rate_interval")
    return dashboard(
        UID, "kvguard / Security",
        "Fill-and-Squeeze suspicion and state per tenant, detections, probe and fill signals, and the "
        "guard's actions (clamps, caps, throttling, rejections), plus failed authentication.",
        scope_variables(TENANTS),
        [
            Row("Fill-and-Squeeze detector", [
                timeseries("Suspicion per tenant", "The detector's score (0..1) from probe cadence, "
                           "reserved-block share while others wait, long-to-short switching near the memory "
                           "edge and other tenants' preemptions. Suspect from 0.5, confirmed from 0.75.",
                           "percentunit",
                           Target(f"max by (tenant) ({sel('guard_fill_squeeze_suspicion', tenant=True)})",
                                  "{{tenant}}"), min=0, max=1, thresholds=[(0.5, "orange"), (0.75, "red")]),
                state_timeline("Detector state per tenant", "normal; suspect (max_tokens clamped, blocks "
                               "capped, served last); confirmed (its requests get 429 abuse_suspected).",
                               Target(f"max by (tenant) ({sel('guard_fill_squeeze_state', tenant=True)})",
                                      "{{tenant}}"), DETECTOR_STATES),
                timeseries("Detections and actions", "Detector state changes per interval, by tenant and the "
                           "state entered (kind).",
                           "short", Target(f"sum by (tenant, kind) ({detections})", "{{tenant}} {{kind}}")),
            ]),
            Row("Signals", [
                timeseries("Request rate per tenant", "A probing tenant shows a steady train of requests; "
                           "the weighted cost per request (next panel) tells probes from fills.", "reqps",
                           Target(requests, "{{tenant}}")),
                timeseries("Weighted tokens per request", "Cost-weighted tokens (input + 2 x output) per "
                           "request. Probes are tiny, fills are long; a tenant switching between the two is "
                           "the attack's rhythm.", "short", Target(ratio(service, requests), "{{tenant}}")),
                timeseries("Reserved block share per tenant", "Each tenant's reserved KV blocks over the "
                           "admission budget: the fill phase grabs as much of it as it can.", "percentunit",
                           Target(ratio(f"sum by (tenant) ({sel('guard_reserved_blocks', tenant=True)})",
                                        f"sum ({sel('guard_admission_budget_blocks')})",
                                        "ignoring (tenant) group_left ()"), "{{tenant}}"), min=0, max=1),
                timeseries("Engine preemptions per tenant", "Whose sequences the engine evicts: squeeze "
                           "victims are preempted over and over.", "ops",
                           Target(f"sum by (tenant) ({rate(victims)})", "{{tenant}}")),
            ]),
            Row("Responses", [
                timeseries("Throttled and rejected per tenant", "429 (over its share or quota) and 503 "
                           "answers per tenant: where throttling and rejection land.", "reqps",
                           Target(zero_filled(rejected, requests), "{{tenant}} {{outcome}}")),
                timeseries("Unauthorized requests", "Requests with a missing or unknown API key: key "
                           "guessing or a client with a revoked key.", "reqps",
                           Target(f"sum by (instance) ({rate(sel('guard_requests_total', UNAUTHORIZED))})",
                                  "{{instance}}")),
            ]),
        ],
    )
