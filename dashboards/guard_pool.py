"""Pool & routing: how the guard spreads requests over its engine replicas, and, in one row per replica, the
KV blocks it reserved there against that replica's budget and use, and whether the prefix-cache hits it
predicted when it picked the replica are the hits the replica reports.

The ``backend`` variable lists the replicas (the backends with a budget: fallbacks have none); the tenant
variable is the convention's, kept so that the links between dashboards carry it.
"""

from __future__ import annotations

from dashboards.grafana import (
    Row,
    Target,
    dashboard,
    query_variable,
    scope_variables,
    state_timeline,
    timeseries,
)
from dashboards.queries import rate, ratio, sel

UID = "kvguard-pool"
TENANTS = 'label_values(guard_requests_total{job=~"$job", instance=~"$instance", tenant!="unknown"}, tenant)'
REPLICAS = 'label_values(guard_backend_budget_blocks{job=~"$job", instance=~"$instance"}, backend)'
BACKEND = 'backend=~"$backend"'
UP_DOWN = {0: ("unhealthy", "red"), 1: ("healthy", "green")}
IMBALANCE = 1.5  # GuardPoolImbalance's line (alerts/rules/pool.yml)


def build() -> dict:
    routed = f"sum by (backend) ({rate(sel('guard_routed_requests_total', BACKEND))})"
    predicted = f"sum by (backend) ({rate(sel('guard_prefix_predicted_hit_tokens_total', BACKEND))})"
    reported = f"sum by (backend) ({rate(sel('guard_prefix_reported_hit_tokens_total', BACKEND))})"
    queried = f"sum by (backend) ({rate(sel('guard_prefix_reported_query_tokens_total', BACKEND))})"
    healthy = f"min by (backend) ({sel('guard_backend_healthy', BACKEND)})"
    return dashboard(
        UID, "kvguard / Pool & routing",
        "The guard's engine replicas: requests routed to each, load against the pool's mean, KV blocks "
        "reserved against each replica's budget, and predicted against reported prefix-cache hits.",
        [*scope_variables(TENANTS), query_variable("backend", "Replica", REPLICAS)],
        [
            Row("Pool", [
                timeseries("Routed requests per replica",
                           "Requests the guard's picker sent to each replica. Conversations stay where their "
                           "prefix is cached and new ones spread; a replica at 0 is down or full.", "reqps",
                           Target(routed, "{{backend}}"), stacked=True),
                timeseries("Load against the pool's mean",
                           f"Each replica's routed request rate over the mean of the healthy replicas. 1 is "
                           f"an even share; above {IMBALANCE} for 10 minutes is GuardPoolImbalance, the hot "
                           "spot of cache-affinity routing.", "suffix: x",
                           Target(ratio(f"sum by (instance, backend) "
                                        f"({rate(sel('guard_routed_requests_total', BACKEND))})",
                                        mean_healthy_rate(), "on (instance) group_left ()"), "{{backend}}"),
                           min=0, thresholds=[(IMBALANCE, "red")]),
                timeseries("Budget committed per replica",
                           "Blocks reserved on each replica over the blocks the guard may commit there. Near "
                           "100 % the replica admits nothing more and the picker looks elsewhere.",
                           "percentunit",
                           Target(ratio(f"max by (backend) ({sel('guard_backend_reserved_blocks', BACKEND)})",
                                        f"max by (backend) ({sel('guard_backend_budget_blocks', BACKEND)})"),
                                  "{{backend}}"),
                           min=0, max=1, thresholds=[(0.8, "orange"), (0.95, "red")]),
                timeseries("Prefix hits reported over predicted",
                           "Prompt tokens each replica reports served from its prefix cache, over those the "
                           "guard predicted cached there when it picked it. Near 1 the guard's block index "
                           "matches the engine's cache; below 0.5 for 15 minutes is "
                           "GuardPrefixRoutingNotPaying.", "percentunit",
                           Target(ratio(reported, predicted), "{{backend}}"),
                           min=0, base="red", thresholds=[(0.5, "orange"), (0.8, "green")]),
                timeseries("Migrations by reason",
                           "Requests moved to another replica mid-answer, by why their replica let them down: "
                           "reset or closed (it died), stream_error, silent (nothing past its deadline), "
                           "drain. A burst is one replica's requests moving once; moves that go on at more "
                           "than 5 % of the routed requests for 10 minutes are GuardMigrationStorm.", "reqps",
                           Target(f"sum by (reason) ({rate(sel('guard_migrations_total'))})", "{{reason}}"),
                           stacked=True, width=24),
                state_timeline("Replica health", "Each replica's circuit breaker: healthy (closed) or not. "
                               "The pool serves while one replica is healthy.",
                               Target(healthy, "{{backend}}"), UP_DOWN, width=24, height=5),
            ]),
            Row("Replica $backend", [
                timeseries("KV blocks: reserved, used, budget",
                           "Blocks the guard reserved on the replica for admitted requests, blocks the "
                           "replica reports in use, and the blocks the guard may commit there "
                           "(safe_utilization x its pool; 0 without telemetry). Reserved stays within the "
                           "budget; used follows reserved as requests run.", "short",
                           Target(f"max by (backend) ({sel('guard_backend_reserved_blocks', BACKEND)})",
                                  "reserved"),
                           Target(f"max by (backend) ({sel('guard_backend_used_blocks', BACKEND)})", "used"),
                           Target(f"max by (backend) ({sel('guard_backend_budget_blocks', BACKEND)})",
                                  "budget"), width=8),
                timeseries("Prefix-hit tokens: predicted and reported",
                           "Prompt tokens per second the guard predicted cached on the replica when it "
                           "picked it, against the hits and lookups the replica reports. Reported hits follow "
                           "the prediction; lookups are every prompt token the replica looked up.",
                           "suffix: tok/s", Target(predicted, "predicted hits"),
                           Target(reported, "reported hits"), Target(queried, "reported lookups"), width=8),
                timeseries("Routed requests", "Requests the picker sent to the replica.", "reqps",
                           Target(routed, "{{backend}}"), width=8),
                timeseries("Telemetry age", "Age of the replica's newest telemetry in the guard. Stale "
                           "telemetry (2 s by default) counts as a full replica: nothing is admitted to it.",
                           "s", Target(f"max by (backend) ({sel('guard_telemetry_age_seconds', BACKEND)})",
                                       "{{backend}}"), thresholds=[(2, "orange"), (5, "red")]),
                state_timeline("Healthy", "The replica's circuit breaker: healthy (closed) or not.",
                               Target(healthy, "{{backend}}"), UP_DOWN),
            ], repeat="backend"),
        ],
    )


def mean_healthy_rate() -> str:
    """Per guard: the mean routed request rate of its healthy replicas, as GuardPoolImbalance reads it."""
    per_replica = f"sum by (instance, backend) ({rate(sel('guard_routed_requests_total'))})"
    return f"avg by (instance) ({per_replica} and on (instance, backend) {sel('guard_backend_healthy')} == 1)"
