"""PromQL building blocks shared by the dashboards, so every query scopes, rates and divides the same way.

- Every selector carries the ``job`` and ``instance`` variables (and ``tenant`` where the series has one).
- Counters are only ever read through ``rate``/``increase`` over ``$__rate_interval`` (or a named window).
- Every ratio filters its denominator with ``> 0``: an idle system shows no data rather than NaN or a
  misleading 0 %.
"""

from __future__ import annotations

SCOPE = ('job=~"$job"', 'instance=~"$instance"')
TENANT = 'tenant=~"$tenant"'
RATE_INTERVAL = "$__rate_interval"


def sel(metric: str, *matchers: str, tenant: bool = False) -> str:
    """``metric{job=~"$job", instance=~"$instance", <matchers>[, tenant=~"$tenant"]}``."""
    parts = [*SCOPE, *matchers, *([TENANT] if tenant else [])]
    return f"{metric}{{{', '.join(parts)}}}"


def rate(series: str, window: str = RATE_INTERVAL) -> str:
    return f"rate({series}[{window}])"


def increase(series: str, window: str) -> str:
    return f"increase({series}[{window}])"


def ratio(numerator: str, denominator: str, matching: str = "") -> str:
    """``numerator / denominator``, with no result where the denominator is zero; ``matching`` is a vector
    matching clause such as ``ignoring (tenant) group_left``."""
    return f"({numerator}) / {matching + ' ' if matching else ''}({denominator} > 0)"


def zero_filled(numerator: str, like: str) -> str:
    """``numerator``, or 0 wherever ``like`` has a series and ``numerator`` has none.

    A counter of rare events (errors, retries) has no series at all until the first event; without this a
    healthy system would show "no data" instead of 0 for it.
    """
    return f"({numerator} or 0 * {like})"


def quantile(q: float, histogram: str, by: tuple[str, ...] = (), *matchers: str, tenant: bool = False) -> str:
    """The ``q`` quantile of a ``prometheus_client`` histogram family, per ``by``."""
    buckets = rate(sel(f"{histogram}_bucket", *matchers, tenant=tenant))
    return f"histogram_quantile({q}, sum by ({', '.join(('le', *by))}) ({buckets}))"


def tenant_lanes(window: str = RATE_INTERVAL) -> str:
    """One series per (tenant, lane) seen in ``window``, of value 1, to join a lane onto per-tenant series.

    The guard's latency histograms carry ``tenant`` only; the lane is the tenant's (one lane per tenant in
    the config), so it is borrowed from ``guard_requests_total``.
    """
    requests = sel("guard_requests_total", 'lane!="none"', tenant=True)  # "none": requests with no valid key
    return f"group by (tenant, lane) ({rate(requests, window)})"


def per_lane(per_tenant: str, window: str = RATE_INTERVAL) -> str:
    """``per_tenant`` (a vector with a ``tenant`` label) with each tenant's ``lane`` added."""
    return f"({per_tenant}) * on (tenant) group_left (lane) {tenant_lanes(window)}"


def lane_quantile(q: float, histogram: str) -> str:
    """The ``q`` quantile of a guard latency histogram per tenant and lane."""
    buckets = per_lane(rate(sel(f"{histogram}_bucket", tenant=True)))
    return f"histogram_quantile({q}, sum by (le, tenant, lane) ({buckets}))"
