"""Every guard metric of the contract, on a registry of the guard's own (several guards can share a process
in tests). Names and labels are public: dashboards and alert rules depend on them."""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.registry import Collector
from prometheus_client.utils import INF, floatToGoString

MODES = ("normal", "pressure", "degraded")
# Why the guard closed a client connection (guard/wire/connections.py): a deadline of the request cycle, or
# the connection cap (refused at accept).
CONNECTION_CUTS = ("header_timeout", "body_timeout", "idle", "over_capacity")
# From well under a millisecond (a cached reply) to minutes (a queued batch job).
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


# Why a replica let a request down, as guard/wire/relay.py names it (guard_migrations_total{reason}).
MIGRATION_REASONS = ("reset", "closed", "stream_error", "silent", "drain")

class GuardMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self._request_series(r)
        self._admission_series(r)
        self._mode_series(r)
        self._backend_series(r)
        self._connection_series(r)
        self._slo_series(r)
        self._autoscale_series(r)
        # (metric, label values) -> its child; label values come from the configuration and fixed sets only
        self._children: dict[tuple[MetricWrapperBase, tuple[str, ...]], MetricWrapperBase] = {}
        for mode in MODES:
            self.mode.labels(mode).set(1.0 if mode == "normal" else 0.0)
        # Every transition exists from the start at 0, so rate() and increase() see a series, not nothing,
        # on a guard that has never changed mode.
        for source in MODES:
            for target in MODES:
                if source != target:
                    self.mode_transitions.labels(source, target)
        for result in ("granted", "denied"):
            self.reservation_growths.labels(result)
        for result in ("ok", "invalid"):
            self.config_reloads.labels(result)
        for reason in CONNECTION_CUTS:
            self.connections_cut.labels(reason)

    def _request_series(self, r: CollectorRegistry) -> None:
        """Requests, queues and latencies as clients see them."""
        self.requests = Counter("guard_requests_total", "Requests by final outcome.",
                                ["tenant", "lane", "outcome"], registry=r)
        self.queue_depth = Gauge("guard_queue_depth", "Requests waiting in the guard's queue.", ["tenant"],
                                 registry=r)
        self.queue_wait = LoopHistogram("guard_queue_wait_seconds", "Time from arrival to admission.", ["tenant"],
                                        LATENCY_BUCKETS, r)
        self.ttft = LoopHistogram("guard_time_to_first_token_seconds", "Arrival to first streamed token, as the "
                                  "client sees it.", ["tenant"], LATENCY_BUCKETS, r)
        self.itl = LoopHistogram("guard_inter_token_latency_seconds", "Gap between streamed tokens.", ["tenant"],
                                 ITL_BUCKETS, r)

    def _slo_series(self, r: CollectorRegistry) -> None:
        """Latency objectives (guard/admission/slo.py, guard/http/objectives.py)."""
        self.slo_requests = Counter("guard_slo_requests_total", "Requests with a latency objective, by lane, "
                                    "the request's priority class, objective (ttft, tpot) and whether it was "
                                    "met; refusals miss it.", ["lane", "priority_class", "objective", "met"],
                                    registry=r)
        self.ttft_predicted = LoopHistogram("guard_ttft_predicted_seconds", "Predicted arrival to first token of "
                                            "requests with an objective.", ["lane"], LATENCY_BUCKETS, r)
        self.ttft_prediction_error = LoopHistogram("guard_ttft_prediction_error_seconds", "Absolute error of the "
                                                   "predicted TTFT of streams that got a first token.", ["lane"],
                                                   LATENCY_BUCKETS, r)

    def _autoscale_series(self, r: CollectorRegistry) -> None:
        """The autoscaling signals (guard/plan/live.py, published by guard/server/autoscale.py)."""
        self.desired_replicas = Gauge("guard_desired_replicas", "Engine replicas the pool should have: the "
                                      "planner's queueing model on the measured arrival rate, service time and "
                                      "request size and the lanes' TTFT objectives; falls only after "
                                      "autoscaling.scale_down_delay_s.", ["pool"], registry=r)
        self.pool_saturation = Gauge("guard_saturation", "How full the pool is, 0..1: the fuller of its KV budget "
                                     "(committed and queued blocks) and its stream slots (offered load).", ["pool"],
                                     registry=r)

    def _admission_series(self, r: CollectorRegistry) -> None:
        """The KV budget, fairness, shared state."""
        self.reserved_blocks = Gauge("guard_reserved_blocks", "KV blocks reserved by admitted requests.",
                                     ["tenant"], registry=r)
        self.borrowed_blocks = Gauge("guard_borrowed_blocks", "Of guard_reserved_blocks, those beyond the "
                                     "tenant's guaranteed share: lent from idle capacity, reclaimed on demand.",
                                     ["tenant"], registry=r)
        self.guaranteed_blocks = Gauge("guard_guaranteed_blocks", "KV blocks the tenant is guaranteed: its "
                                       "weighted share of the admission budget.", ["tenant"], registry=r)
        self.shared_up = Gauge("guard_shared_state_up", "1 while the guards' shared state (Redis) answers; 0 "
                               "while this guard admits alone, to its share of each engine.", registry=r)
        self.shared_guards = Gauge("guard_shared_state_guards", "Guards sharing state, as last seen in Redis.",
                                   registry=r)
        self.shared_lost = Counter("guard_shared_state_lost_total", "Times the link to Redis went down, by why: "
                                   "timeout (a round trip past shared_state.timeout_s), error, or stale (Redis "
                                   "had lost this guard).", ["reason"], registry=r)
        self.shared_round_trip = Histogram("guard_shared_state_round_trip_seconds", "Shared state in Redis, by "
                                           "op: a round trip (batch, renew, resync, verdicts), or one op a "
                                           "request sent in a batch (admit, release, backlog, rate_charge, "
                                           "rate_settle), from queued to answered.", ["op"],
                                           buckets=(0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05,
                                                    0.1, 0.25, 0.5), registry=r)
        self.budget_blocks = Gauge("guard_admission_budget_blocks", "KV blocks the guard may commit "
                                   "(safe_utilization x engine blocks).", registry=r)
        self.service_tokens = ServiceTokens()
        r.register(self.service_tokens)
        self.jain = Gauge("guard_fairness_jain_index", "Jain's index of backlogged tenants' weighted service "
                          "(1 = fair).", registry=r)

    def _mode_series(self, r: CollectorRegistry) -> None:
        """Modes and the detector."""
        self.mode = Gauge("guard_mode", "1 for the guard's current mode.", ["mode"], registry=r)
        self.mode_transitions = Counter("guard_mode_transitions_total", "Mode changes.", ["from", "to"],
                                        registry=r)
        self.suspicion = Gauge("guard_fill_squeeze_suspicion", "Fill-and-Squeeze suspicion score (0..1).",
                               ["tenant"], registry=r)
        self.fs_state = Gauge("guard_fill_squeeze_state", "0 normal, 1 suspect, 2 confirmed.", ["tenant"],
                              registry=r)
        self.detections = Counter("guard_detections_total", "Detector state transitions.", ["tenant", "kind"],
                                  registry=r)

    def _backend_series(self, r: CollectorRegistry) -> None:
        """Backends: health, upstream answers, the pool per replica."""
        self.backend_healthy = Gauge("guard_backend_healthy", "1 while a backend is considered healthy.",
                                     ["backend"], registry=r)
        self.upstream_requests = Counter("guard_upstream_requests_total", "Requests sent upstream, by status "
                                         "code (or 'error' when none came back).", ["backend", "code"],
                                         registry=r)
        self.telemetry_age = Gauge("guard_telemetry_age_seconds", "Age of the newest telemetry of each engine "
                                   "replica.", ["backend"], registry=r)
        # The pool, per replica (``backend`` is the replica's configured name).
        self.backend_reserved = Gauge("guard_backend_reserved_blocks", "KV blocks reserved on the replica by "
                                      "admitted requests.", ["backend"], registry=r)
        self.backend_budget = Gauge("guard_backend_budget_blocks", "KV blocks the guard may commit on the replica "
                                    "(safe_utilization x its blocks; 0 without telemetry).", ["backend"], registry=r)
        self.backend_used = Gauge("guard_backend_used_blocks", "KV blocks in use on the replica, as it reports.",
                                  ["backend"], registry=r)
        self.reservation_growths = Counter("guard_reservation_growths_total", "Reservations of requests without "
                                           "max_tokens grown as their output passed the prediction, by result "
                                           "(granted, or denied for want of room).", ["result"], registry=r)
        self.routed = Counter("guard_routed_requests_total", "Requests the picker sent to the replica.",
                              ["backend"], registry=r)
        self.prefix_predicted = Counter("guard_prefix_predicted_hit_tokens_total", "Prompt tokens the guard "
                                        "predicted cached on the replica it picked (from the replica's KV events).",
                                        ["backend"], registry=r)
        self.prefix_reported_hits = Counter("guard_prefix_reported_hit_tokens_total", "Prefix-cache hits in "
                                            "tokens, as the replica's telemetry reports them.", ["backend"],
                                            registry=r)
        self.prefix_reported_queries = Counter("guard_prefix_reported_query_tokens_total", "Prefix-cache "
                                               "lookups in tokens, as the replica's telemetry reports them.",
                                               ["backend"], registry=r)
        self.client_retries = Counter("guard_client_retries_total", "Requests that clients marked as retries "
                                      "(X-Stainless-Retry-Count > 0 or Retry-Attempt).", ["tenant"], registry=r)
        self.migrations = Counter("guard_migrations_total", "Requests moved to another replica mid-answer, by why "
                                  "their replica let them down (reset, closed, stream_error, silent, drain).",
                                  ["reason"], registry=r)
        for reason in MIGRATION_REASONS:  # each at 0 from the start: a dashboard's rate has data before a move
            self.migrations.labels(reason)

    def _connection_series(self, r: CollectorRegistry) -> None:
        """Client connections, rate limits and the config."""
        # Client connections (guard/wire/connections.py).
        self.connections_open = Gauge("guard_connections_open", "Client connections open now.", registry=r)
        self.connections_limit = Gauge("guard_connections_limit", "Client connections the guard holds at "
                                       "most (connections.max_connections); more are refused with 503.",
                                       registry=r)
        self.connections_cut = Counter("guard_connections_cut_total", "Client connections the guard closed "
                                       "or refused, by reason: header_timeout, body_timeout, idle "
                                       "(keep-alive), over_capacity.", ["reason"], registry=r)
        # Rate limits (guard/admission/limits.py), kind = requests (rpm) | tokens (tpm).
        self.ratelimit_levels = RateLimitLevels()
        r.register(self.ratelimit_levels)
        self.ratelimit_rejections = Counter("guard_ratelimit_rejections_total", "Requests refused with 429 by a "
                                            "rate limit, by the limit that refused them (requests: rpm, tokens: "
                                            "tpm).", ["tenant", "kind"], registry=r)
        self.config_reloads = Counter("guard_config_reloads_total", "SIGHUP reloads of the config file, by result "
                                      "(ok; invalid: refused, the running config kept).", ["result"], registry=r)
        self.config_reload_ok = Gauge("guard_config_last_reload_successful", "1 unless the last SIGHUP reload "
                                      "was refused (then 0 until one is applied): the file on disk is not the "
                                      "running config.", registry=r)
        self.config_reload_ok.set(1)
        self.config_info = Gauge("guard_config_info", "1, labelled with the running config's hash (guard/config.py "
                                 "config_hash).", ["hash"], registry=r)

    def show_config(self, config_hash: str) -> None:
        """``guard_config_info`` names the running configuration only (at start and after each reload)."""
        self.config_info.clear()
        self.config_info.labels(config_hash).set(1)

    def child(self, metric: MetricWrapperBase, *labels: str) -> Any:
        """``metric.labels(*labels)``, looked up once: prometheus_client checks the values and takes a lock on
        every ``labels`` call, and the request path resolves half a dozen children per request. A counter's
        child is given a ``LoopCount`` as its value, and that is what is returned: ``inc`` without the lock."""
        key = (metric, labels)
        found = self._children.get(key)
        if found is None:
            found = metric.labels(*labels)
            if isinstance(metric, Counter):
                found._value = found = LoopCount(found._value.get())  # read by the child as before
            self._children[key] = found
        return found


class LoopCount:
    """A counter child's value incremented on the guard's loop: prometheus_client's ``MutexValue`` interface
    (``inc``, ``set``, ``get``, exemplars), which the child reads when scraped and tests read as
    ``labels(...)._value.get()``, without its lock: a locked increment cost 0.74 us against 0.11, four per
    request. Single-threaded by design, as ``LoopHistogram``: increments and scrapes both run on the loop.
    ``inc`` refuses a negative amount, as ``Counter.inc`` does."""

    __slots__ = ("_exemplar", "_value")

    def __init__(self, value: float = 0.0) -> None:
        self._value = value
        self._exemplar: Any = None

    def inc(self, amount: float = 1) -> None:
        if amount < 0:
            raise ValueError("Counters can only be incremented by non-negative amounts.")
        self._value += amount

    def set(self, value: float, timestamp: float | None = None) -> None:
        self._value = value

    def get(self) -> float:
        return self._value

    def set_exemplar(self, exemplar: Any) -> None:
        self._exemplar = exemplar

    def get_exemplar(self) -> Any:
        return self._exemplar


class ServiceTokens(Collector):
    """``guard_service_tokens_total`` read from the fair queue's own per-tenant totals when scraped: the
    queue keeps them anyway, and a counter updated on every charge cost two locked increments per request."""

    def __init__(self) -> None:
        self.read: Callable[[], dict[str, float]] = dict  # tenant -> service so far; set by the app

    @staticmethod
    def family() -> CounterMetricFamily:
        return CounterMetricFamily("guard_service_tokens_total", "Service in cost-weighted tokens (input + 2 x "
                                   "output), the quantity VTC shares by tenant weight.", labels=["tenant"])

    def describe(self) -> Iterator[CounterMetricFamily]:
        yield self.family()

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = self.family()
        for tenant, service in self.read().items():
            family.add_metric([tenant], service)
        yield family


class RateLimitLevels(Collector):
    """``guard_ratelimit_limit`` and ``guard_ratelimit_remaining`` {tenant,kind} of every limited tenant, read
    from the rate limiter's windows when scraped: what remains grows back as the windows slide, with no
    request there to set a gauge."""

    def __init__(self) -> None:
        self.read: Callable[[], Iterable[tuple[str, str, int, int]]] = tuple  # (tenant, kind, limit, remaining)

    @staticmethod
    def families() -> tuple[GaugeMetricFamily, GaugeMetricFamily]:
        return (GaugeMetricFamily("guard_ratelimit_limit", "The tenant's rate limit per minute (requests: rpm, "
                                  "tokens: tpm).", labels=["tenant", "kind"]),
                GaugeMetricFamily("guard_ratelimit_remaining", "What the tenant may still be charged in the "
                                  "sliding minute (requests, or tokens: prompt + max output).",
                                  labels=["tenant", "kind"]))

    def describe(self) -> Iterator[GaugeMetricFamily]:
        yield from self.families()

    def collect(self) -> Iterator[GaugeMetricFamily]:
        limit, remaining = self.families()
        for tenant, kind, value, left in self.read():
            limit.add_metric([tenant, kind], value)
            remaining.add_metric([tenant, kind], left)
        yield limit
        yield remaining


class LoopHistogram(Collector):
    """A histogram observed on the guard's event loop, per request or per streamed token: the series of
    prometheus_client's ``Histogram`` (``_bucket`` by ``le``, ``_sum``, ``_count``; no ``_created``), without
    its cost. That one takes a lock per bucket and per sum on every ``observe``, a tenth of the guard's CPU
    relaying a fast stream; here an observation is one bisection and two additions.

    Single-threaded by design: observations and scrapes both run on the guard's loop, so a scrape never sees
    half an observation. Children are made by ``labels`` as prometheus_client's are (and cached by
    ``GuardMetrics.child``)."""

    def __init__(self, name: str, documentation: str, labelnames: list[str], buckets: Iterable[float],
                 registry: CollectorRegistry) -> None:
        self.name, self.documentation, self.labelnames = name, documentation, list(labelnames)
        self.bounds = (*sorted(float(bound) for bound in buckets if bound != INF), INF)
        self._les = [floatToGoString(bound) for bound in self.bounds]
        self._children: dict[tuple[str, ...], LoopHistogramChild] = {}
        registry.register(self)

    def labels(self, *values: str) -> LoopHistogramChild:
        key = tuple(str(value) for value in values)
        if len(key) != len(self.labelnames):
            raise ValueError(f"{self.name} takes the labels {self.labelnames}, got {values}")
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = LoopHistogramChild(self.bounds)
        return child

    def describe(self) -> Iterator[HistogramMetricFamily]:
        yield HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)

    def collect(self) -> Iterator[HistogramMetricFamily]:
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for values, child in self._children.items():
            cumulative, buckets = 0, []
            for le, count in zip(self._les, child.counts):
                cumulative += count
                buckets.append((le, cumulative))
            family.add_metric(list(values), buckets, child.sum)
        yield family


class LoopHistogramChild:
    """One label set's counts: ``counts[i]`` observations in (bounds[i-1], bounds[i]]."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * len(bounds)
        self.sum = 0.0

    def observe(self, amount: float) -> None:
        self.counts[bisect_left(self.bounds, amount)] += 1  # the first bound >= amount: ``le`` is inclusive
        self.sum += amount
