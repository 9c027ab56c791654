"""Filters: a replica they hold back is ranked behind every one they do not (guard/pool/scheduling/plugin.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from guard.pool.scheduling.plugin import Context, predicted_ttft, register_filter

if TYPE_CHECKING:
    from guard.pool.replica import Replica

SATURATED = 0.8  # share of a replica's budget past which its cached blocks no longer attract requests
OVERLOAD_ABS, OVERLOAD_REL = 3, 1.5  # in flight beyond the least loaded's: past both, locality waits


@register_filter("saturation")
class Saturation:
    """A replica that would be past ``threshold`` (default ``SATURATED``) of its budget after this
    reservation: a nearly full replica never wins on locality alone (the "death spiral" of cache affinity)."""

    def __init__(self, threshold: float = SATURATED) -> None:
        if not 0 < threshold <= 1:
            raise ValueError(f"threshold must be in (0, 1], got {threshold!r}")
        self.threshold = threshold

    def holds_back(self, replica: Replica, ctx: Context) -> bool:
        return ctx.free[replica] < 1 - self.threshold


@register_filter("overload")
class Overload:
    """A replica with ``absolute`` more requests in flight than the least loaded candidate and ``relative``
    times as many (SGLang's cache-aware router balances the same way): cached system prompts would otherwise
    pull every conversation of the tenants that started on one replica there, long before its blocks run
    short."""

    def __init__(self, absolute: int = OVERLOAD_ABS, relative: float = OVERLOAD_REL) -> None:
        if absolute < 0 or relative < 1:
            raise ValueError(f"need absolute >= 0 and relative >= 1, got {absolute!r} and {relative!r}")
        self.absolute, self.relative = absolute, relative

    def holds_back(self, replica: Replica, ctx: Context) -> bool:
        return replica.in_flight >= ctx.least + self.absolute and replica.in_flight >= self.relative * ctx.least


@register_filter("slo")
class SloFilter:
    """A replica predicted to break the request's objectives: its p90 TTFT past what the TTFT objective
    leaves after queueing, or its p90 TPOT with the request added to its decode batch past the TPOT
    objective (guard/pool/latency.py). A sheddable request's are held to the median instead: it is lent
    whole and takes nothing from work that must be on time, so a replica on which it is more likely on time
    than not is one to serve it on (held to the p90, a slower replica of a heterogeneous pool sat idle
    while the sheddable requests waited for the faster one and ran out of time: bench/slo.py S3 at
    683c8b3, 402 batch requests on time against 502 without the filter). Requests without objectives pass.
    Failing open as every filter does, a request that no replica can serve in time still goes to the best
    of them; refusing it instead is admission's call (guard/admission/slo.py)."""

    def holds_back(self, replica: Replica, ctx: Context) -> bool:
        request = ctx.request
        if (ttft_left := request.ttft_left_s) is not None:
            ttft = predicted_ttft(replica, ctx)
            if (ttft.median if request.sheddable else ttft.p90) > ttft_left:
                return True
        if (tpot_s := request.tpot_s) is None:
            return False
        tpot = replica.latency.predict_tpot(replica.in_flight)
        return (tpot.median if request.sheddable else tpot.p90) > tpot_s
