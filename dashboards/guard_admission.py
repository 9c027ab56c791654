"""Guard admission & fairness: what happened to each tenant's requests, how much of its rate limits each
tenant uses, how long they queued, how much of the KV budget the guard has committed (and how much of it is
borrowed beyond the tenants' guaranteed shares), whether service follows the weights, whether the guards
share their state (Redis), which mode the guard is in, the guard process itself (client connections and
config reloads), and the Batch API's batches and lines (guard/batch/metrics.py)."""

from __future__ import annotations

from dashboards.grafana import (
    Row,
    Target,
    dashboard,
    scope_variables,
    stat,
    state_timeline,
    table,
    timeseries,
)
from dashboards.queries import increase, quantile, rate, ratio, sel, zero_filled

UID = "kvguard-guard"
TENANTS = 'label_values(guard_requests_total{job=~"$job", instance=~"$instance", tenant!="unknown"}, tenant)'
REJECTED = 'outcome=~"rejected_quota|rejected_overload"'
MODES = {0: ("normal", "green"), 1: ("pressure", "orange"), 2: ("degraded", "red")}
UP_DOWN = {0: ("unhealthy", "red"), 1: ("healthy", "green")}
PRESSURE, DEGRADED = 'mode="pressure"', 'mode="degraded"'
RETRIED = 'status="retried"'  # guard_batch_requests_total's lines that run again
# guard_shared_state_up + (guard_shared_state_guards > 0): a guard without shared_state exports 0 for both.
SHARED = {0: ("alone (no shared_state)", "blue"), 1: ("Redis down: admitting alone", "red"), 2: ("shared", "green")}
REFUSALS = "guard_ratelimit_rejections_total"
RATE_LIMITED = 0.5  # TenantRateLimited's line (alerts/rules/guard.yml)
CONNECTIONS_HIGH = 0.9  # GuardConnectionsNearLimit's line (alerts/rules/guard_process.yml)


def build() -> dict:
    all_requests = rate(sel("guard_requests_total", tenant=True))
    requests = f"sum by (tenant) ({all_requests})"
    rejected = f"sum by (tenant) ({rate(sel('guard_requests_total', REJECTED, tenant=True))})"
    retries = f"sum by (tenant) ({rate(sel('guard_client_retries_total', tenant=True))})"
    service = rate(sel("guard_service_tokens_total", tenant=True))
    transitions = increase(sel("guard_mode_transitions_total"), "$__rate_interval")
    reloads = increase(sel("guard_config_reloads_total"), "$__rate_interval")
    reserved = sel("guard_reserved_blocks")
    budget = f"max by (instance) ({sel('guard_admission_budget_blocks')})"
    refused = f"sum by (tenant) ({rate(sel(REFUSALS, tenant=True))})"
    # Each guard reads a tenant's guarantee against its own reservations (guard/admission/shared_dispatch.py).
    guaranteed = ratio(f"sum by (instance, tenant) ({sel('guard_reserved_blocks', tenant=True)})",
                       f"sum by (instance, tenant) ({sel('guard_guaranteed_blocks', tenant=True)})")
    limit_left = ratio(sel("guard_ratelimit_remaining", tenant=True),
                       sel("guard_ratelimit_limit", tenant=True))
    connections = ratio(f"max by (instance) ({sel('guard_connections_open')})",
                        f"max by (instance) ({sel('guard_connections_limit')})")
    cuts = f"sum by (reason) ({rate(sel('guard_connections_cut_total'))})"
    return dashboard(
        UID, "kvguard / Guard admission & fairness",
        "Outcomes per tenant, rate limits, the guard's queues, KV blocks reserved against the admission "
        "budget and the tenants' guaranteed shares, weighted service and Jain's index, shared state, the "
        "guard's mode and its backends, client connections and config reloads, and the Batch API's batches "
        "and lines.",
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
            Row("Rate limits", [
                timeseries("Rate limit used per tenant",
                           "How much of each tenant's per-minute limit the sliding minute has charged: "
                           "kind requests is rpm, tokens is tpm (prompt plus the output its reservation "
                           "covers). At 100 % the tenant's next request gets 429 with Retry-After until the "
                           "minute slides on. Tenants without rpm/tpm have no line. A tenant that lives at "
                           "100 % needs a higher limit, or a client that paces itself.", "percentunit",
                           Target(f"max by (tenant, kind) (1 - {limit_left})", "{{tenant}} {{kind}}"),
                           width=8, min=0, max=1, thresholds=[(0.8, "orange"), (0.95, "red")]),
                timeseries("Rate-limit refusals per tenant",
                           "Requests refused with 429 by the tenant's own rpm (requests) or tpm (tokens) "
                           "limit, by the limit that refused them. They are the tenant's rejected_quota "
                           "outcome and spend no error budget: the service did what the tenant's plan says.",
                           "reqps",
                           Target(f"sum by (tenant, kind) ({rate(sel(REFUSALS, tenant=True))})",
                                  "{{tenant}} {{kind}}"), width=8),
                timeseries("Rate-limited share per tenant",
                           "Requests refused by a rate limit over all the tenant's requests. A client that "
                           "honours Retry-After keeps this low even at its limit; above "
                           f"{RATE_LIMITED:.0%} for 30 minutes is TenantRateLimited: a client retrying into "
                           "its limit, or a limit too small for the tenant's real load.", "percentunit",
                           Target(ratio(refused, requests), "{{tenant}}"),
                           width=8, min=0, max=1, thresholds=[(RATE_LIMITED, "red")]),
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
                timeseries("Reserved over guaranteed share",
                           "Each tenant's reserved blocks over its guaranteed blocks (weight / total "
                           "weight x the budget), per guard. Up to 100 % the tenant runs within its "
                           "guarantee and is admitted even where others have borrowed the budget full; above "
                           "100 % it borrows idle capacity, fine while the others are idle. A tenant "
                           "below 100 % whose requests queue is not getting its guarantee: look at the "
                           "engines' KV use and the guard's mode.", "percentunit",
                           Target(guaranteed, "{{tenant}} {{instance}}"), width=8, min=0),
                timeseries("Borrowed blocks per tenant",
                           "Reserved blocks beyond each tenant's guaranteed share, lent out of idle "
                           "capacity. Borrowers run at a lower engine priority (the engine preempts them "
                           "first if it runs short) and do not count towards the saturation that sends the "
                           "guard into pressure mode; their blocks come back as their requests end.", "short",
                           Target(f"sum by (tenant) ({sel('guard_borrowed_blocks', tenant=True)})",
                                  "{{tenant}}"), width=8, stacked=True),
                timeseries("Reservation growths",
                           "Requests without max_tokens reserve the output their tenant's requests usually "
                           "produce; one that outgrows it asks for more. Denied: no room, the request runs "
                           "on beyond its reservation and asks again a block later, and the engine may have "
                           "to preempt. Steady denials: clients should send max_tokens, or the KV budget "
                           "has no headroom left (lower safe_utilization or add replicas).", "ops",
                           Target(f"sum by (result) ({rate(sel('guard_reservation_growths_total'))})",
                                  "{{result}}"), width=8),
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
            Row("Connections and config", [
                timeseries("Client connections in use",
                           "Open client connections over the guard's limit (connections.max_connections, by "
                           "default what its descriptor limit affords). At 100 % new connections get 503 at "
                           f"once; above {CONNECTIONS_HIGH:.0%} for 5 minutes is GuardConnectionsNearLimit.",
                           "percentunit", Target(connections, "{{instance}}"),
                           width=8, min=0, max=1, thresholds=[(0.8, "orange"), (CONNECTIONS_HIGH, "red")]),
                timeseries("Connections closed by the guard",
                           "Connections the guard cut: header_timeout and body_timeout (a client too slow to "
                           "send its request: a slow link, or a slowloris), idle (keep-alive past its "
                           "timeout: normal), over_capacity (refused with 503 at the limit).", "cps",
                           Target(cuts, "{{reason}}"), width=8),
                timeseries("Config reloads", "SIGHUP reloads of the config file per interval: ok, or "
                           "invalid (refused: the guard runs on with the config it had, and the log says "
                           "why; GuardConfigReloadFailed).", "short",
                           Target(f"sum by (result) ({reloads})", "{{result}}"), width=8),
                table("Running config per guard", "The hash of the configuration each guard runs (the "
                      "first 12 hex digits of the SHA-256 of its normalized form, as the guard logs it). "
                      "After a reload every guard shows the new hash; guards of one deployment that differ "
                      "run different tenants, keys or limits.",
                      Target(f"max by (instance, hash) ({sel('guard_config_info')})"), width=18, height=5),
                stat("Configs running", "How many different configurations the selected guards run. 1 when "
                     "they agree; more while a reload has reached only some of them, or failed on some.",
                     "none", Target(f"count (count by (hash) ({sel('guard_config_info')}))"),
                     thresholds=[(2, "orange")]),
            ]),
            batch_row(),
        ],
    )


def batch_row() -> Row:
    """The Batch API (guard/batch/metrics.py): batches by status, lines by how their run ended, lines still
    to run. ``guard_batches`` counts the whole store, which guards sharing Redis all see: max, not sum."""
    lines = rate(sel("guard_batch_requests_total", tenant=True))
    all_lines = f"sum by (tenant) ({lines})"
    retried = f"sum by (tenant) ({rate(sel('guard_batch_requests_total', RETRIED, tenant=True))})"
    return Row("Batch API", [
        timeseries("Batches by status",
                   "Batches in the store by status (every guard's, with shared_state). validating and "
                   "in_progress are open: a guard runs each under its lease; one that stays in_progress with no "
                   "lines completing has no capacity left to it (interactive work takes it first) or no guard "
                   "holding its lease.", "short",
                   Target(f"max by (status) ({sel('guard_batches')})", "{{status}}"), width=6, min=0),
        timeseries("Batch lines per tenant and result",
                   "Batch lines run, by how their run ended: completed (an output line), failed (an error "
                   "line: the line's own fault), retried (refused for capacity or time, or a failing engine: "
                   "the line runs again later). Lines run only in capacity other work leaves, so this rate "
                   "falls while interactive load rises.", "reqps",
                   Target(f"sum by (tenant, status) ({lines})", "{{tenant}} {{status}}"), width=6),
        timeseries("Batch lines retried share",
                   "Retried lines over all lines run, per tenant. Near 0 when the pacer starts lines only "
                   "where they fit; a steady climb is capacity taken back under the batch (its blocks are "
                   "lent, and critical work reclaims them) or an engine failing its lines.", "percentunit",
                   Target(ratio(zero_filled(retried, all_lines), all_lines), "{{tenant}}"), width=6, min=0, max=1),
        timeseries("Batch lines pending per tenant",
                   "Lines not yet done of the batches the guards run now. It falls as the batch runs; flat "
                   "while interactive work leaves no room, and the batch's completion_window may expire it "
                   "(partial output).", "short",
                   Target(f"sum by (tenant) ({sel('guard_batch_lines_pending', tenant=True)})", "{{tenant}}"),
                   width=6, stacked=True),
    ])
