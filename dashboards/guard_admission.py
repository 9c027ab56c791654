"""Guard admission & fairness: what happened to each tenant's requests, how long they queued, how much of the
KV budget the guard has committed, whether service follows the weights, whether the guards share their state
(Redis), and which mode the guard is in."""

from __future__ import annotations

from dashboards.grafana import Row, Target, dashboard, scope_variables, stat, state_timeline, timeseries
from dashboards.queries import increase, quantile, rate, ratio, sel, zero_filled

UID = "kvguard-guard"
TENANTS = 'label_values(guard_requests_total{job=~"$job", instance=~"$instance", tenant!="unknown"}, tenant)'
REJECTED = 'outcome=~"rejected_quota|rejected_overload"'
MODES = {0: ("normal", "green"), 1: ("pressure", "orange"), 2: ("degraded", "red")}
UP_DOWN = {0: ("unhealthy", "red"), 1: ("healthy", "green")}
PRESSURE, DEGRADED = 'mode="pressure"', 'mode="degraded"'
# guard_shared_state_up + (guard_shared_state_guards > 0): a guard without shared_state exports 0 for both.
SHARED = {0: ("alone (no shared_state)", "blue"), 1: ("Redis down: admitting alone", "red"), 2: ("shared", "green")}


def build() -> dict:
    all_requests = rate(sel("guard_requests_total", tenant=True))
    requests = f"sum by (tenant) ({all_requests})"
    rejected = f"sum by (tenant) ({rate(sel('guard_requests_total', REJECTED, tenant=True))})"
    retries = f"sum by (tenant) ({rate(sel('guard_client_retries_total', tenant=True))})"
    service = rate(sel("guard_service_tokens_total", tenant=True))
    transitions = increase(sel("guard_mode_transitions_total"), "$__rate_interval")
    reserved = sel("guard_reserved_blocks")
    budget = f"max by (instance) ({sel('guard_admission_budget_blocks')})"
    return dashboard(
        UID, "kvguard / Guard admission & fairness",
        "Outcomes per tenant, the guard's queues, KV blocks reserved against the admission budget, weighted "
        "service and Jain's index, the guard's mode and its backends.",
        scope_variables(TENANTS),
        [
            Row("Outcomes", [
                timeseries("Requests by outcome",
                           "Every request that passed auth ends in exactly one outcome.", "reqps",
                           Target(f"sum by (outcome) ({all_requests})", "{{outcome}}"), stacked=True),
                timeseries("Requests by tenant and outcome", "The same outcomes, split per tenant.", "reqps",
                           Target(f"sum by (tenant, outcome) ({all_requests})", "{{tenant}} {{outcome}}")),
                timeseries("Rejected share per tenant",
                           "Requests answered 429 (over share or quota) or 503 (overloaded, queue timeout) "
                           "over all requests of the tenant.", "percentunit",
                           Target(ratio(zero_filled(rejected, requests), requests), "{{tenant}}"),
                           min=0, max=1),
            ]),
            Row("Queue", [
                timeseries("Queue depth per tenant",
                           "Requests waiting in the guard's fair queue. Growth that does not drain is a "
                           "queue build-up: arrivals exceed what the engine serves.", "short",
                           Target(f"sum by (tenant) ({sel('guard_queue_depth', tenant=True)})", "{{tenant}}"),
                           stacked=True),
                timeseries("Queue wait p95 per tenant", "Arrival to admission. Target for interactive lanes: "
                           "p95 below 50 ms; batch lanes wait by design.", "s",
                           Target(quantile(0.95, "guard_queue_wait_seconds", ("tenant",), tenant=True),
                                  "{{tenant}}")),
            ]),
            Row("Admission budget", [
                timeseries("Reserved blocks vs budget",
                           "KV blocks reserved by admitted requests, per tenant, against the blocks the "
                           "guard may commit (safe_utilization x the engine's pool).", "short",
                           Target(f"sum by (tenant) ({sel('guard_reserved_blocks', tenant=True)})",
                                  "{{tenant}}"),
                           Target(budget, "budget {{instance}}")),
                stat("Budget committed", "Reserved blocks over the admission budget. Near 100 % the gate "
                     "closes and new work queues.", "percentunit",
                     Target(ratio(f"sum by (instance) ({reserved})", budget), "{{instance}}"),
                     min=0, max=1, thresholds=[(0.8, "orange"), (0.95, "red")]),
                timeseries("Telemetry age", "Age of the newest telemetry the guard holds from each engine "
                           "replica. Stale telemetry (2 s by default) counts as a full replica: admission to "
                           "it stops.", "s",
                           Target(f"max by (instance, backend) ({sel('guard_telemetry_age_seconds')})",
                                  "{{instance}} {{backend}}"),
                           width=6, thresholds=[(2, "orange"), (5, "red")]),
            ]),
            Row("Fairness", [
                timeseries("Weighted service per tenant",
                           "Cost-weighted tokens per second (input + 2 x output): the quantity the Virtual "
                           "Token Counter shares in proportion to tenant weights.", "suffix: tok/s",
                           Target(f"sum by (tenant) ({service})", "{{tenant}}")),
                timeseries("Service share per tenant",
                           "Each tenant's share of the weighted service. Backlogged tenants should get "
                           "shares proportional to their weights.", "percentunit",
                           Target(ratio(f"sum by (tenant) ({service})", f"sum ({service})",
                                        "ignoring (tenant) group_left ()"), "{{tenant}}"),
                           min=0, max=1, stacked=True),
                timeseries("Jain fairness index", "Jain's index of backlogged tenants' service per unit of "
                           "weight: 1 is exactly proportional, 1/n is one tenant getting everything.", "none",
                           Target(f"min by (instance) ({sel('guard_fairness_jain_index')})", "{{instance}}"),
                           min=0, max=1),
            ]),
            Row("Shared state", [
                state_timeline("Shared state (Redis) per guard", "Guards that share fairness, KV budgets, "
                               "limits and verdicts through Redis (shared_state, or --workers N: one instance "
                               "per worker). Redis down: the guard admits alone, to 1/N of each engine "
                               "(GuardSharedStateDown).",
                               Target(f"max by (instance) ({sel('guard_shared_state_up')}) + max by (instance) "
                                      f"({sel('guard_shared_state_guards')} > bool 0)", "{{instance}}"),
                               SHARED),
                timeseries("Guards sharing state", "Live guards each guard saw in Redis (leases not yet "
                           "lapsed); while Redis is down, the number last seen, which sets each guard's "
                           "share. Guards that disagree for long have lost one another.", "short",
                           Target(f"max by (instance) ({sel('guard_shared_state_guards')})", "{{instance}}"),
                           min=0),
                timeseries("Redis round trips (p99)", "How long the guards wait on Redis: a batch is one round "
                           "trip carrying every op a guard queued meanwhile; admit is an admission's wait for "
                           "its answer (the batch before it, and its own). Near shared_state.timeout_s the "
                           "guards start to count Redis as down.", "s",
                           Target(quantile(0.99, "guard_shared_state_round_trip_seconds", ("op",),
                                           'op=~"batch|admit|renew"'), "{{op}}"),
                           min=0),
            ]),
            Row("Mode and backends", [
                state_timeline("Guard mode", "normal: everything to the engine; pressure: sheddable lanes "
                               "and over-share tenants to a fallback; degraded: new requests to the "
                               "fallbacks.",
                               Target(f"max by (instance) ({sel('guard_mode', PRESSURE)}) + 2 * "
                                      f"max by (instance) ({sel('guard_mode', DEGRADED)})", "{{instance}}"),
                               MODES),
                timeseries("Mode transitions", "Mode changes per interval. More than a few an hour is "
                           "flapping at a threshold.", "short",
                           Target(f"sum by (from, to) ({transitions})", "{{from}} -> {{to}}")),
                state_timeline("Backend health", "Each backend's circuit breaker: healthy (closed) or not.",
                               Target(f"min by (backend) ({sel('guard_backend_healthy')})", "{{backend}}"),
                               UP_DOWN),
                timeseries("Upstream responses", "Requests the guard sent upstream, by backend and status "
                           "code ('error' when none came back).", "reqps",
                           Target(f"sum by (backend, code) ({rate(sel('guard_upstream_requests_total'))})",
                                  "{{backend}} {{code}}")),
                timeseries("Client retry share", "Requests marked as retries by their client over all "
                           "requests. Target: below 1 %; a climb is a retry storm feeding on itself.",
                           "percentunit",
                           Target(ratio(zero_filled(retries, requests), requests), "{{tenant}}"), min=0),
            ]),
        ],
    )
