"""A replica's latency model, learned online: what TTFT and TPOT a request sent there now would see.

    engine TTFT = base + per_token x (prefill tokens ahead + the request's uncached prompt tokens)

``prefill tokens ahead`` are the uncached prompt tokens of the guard's requests already sent to the replica
that have no first token yet and run at the same engine priority or a higher one (the engine prefills
waiting requests in priority order, engine/sched/scheduler.py); the guard knows them exactly, ``admitted``
and ``started`` keep the count per priority. A unary request's first token is not seen: its prompt counts
until it ends.
``base`` (a step with the running batch's decodes in it, and the relay) and ``per_token`` (the inverse of
the measured prefill rate) are fitted to the guard's own observations, each request's admission-to-first-
token time against the work that was ahead of it, by exponentially weighted least squares: a window of
about ``1 / (1 - DECAY)`` requests, so the fit follows the replica's load as it changes; one fit per
engine priority, since the engine treats them differently. Until the fit has
``MIN_FIT`` observations the engine's telemetry stands in for ``base`` (its mean step time), beside a
nominal ``per_token`` (its token rate is throughput, not speed: an idle engine's says nothing). TPOT is the mean gap between streamed tokens that the guard observed on the
replica (exponentially weighted), before any the engine's mean decode step (``itl_s``).

On top of the fit, a residual correction by load band: the fit is one line through requests that met
different engines, and what it misses most is whether a lower priority's prefill was in flight when the
request was sent (the engine may be in the middle of a step that prefills it: the request waits for that
step, then its own). Per band, ``(engine priority, a lower priority's prefill pending)``, an exponentially
weighted mean of log(actual / fitted) multiplies the fit's prediction.

The guard's queue wait, in front of every replica, is predicted elsewhere (guard/admission/slo.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from engine.protocol import TelemetrySnapshot

DECAY = 0.95  # weight of the past per observation: ~20 requests of memory
MIN_FIT = 4  # observations before the fit replaces the telemetry's estimate
MIN_SPREAD_TOKENS = 16.0  # the work's weighted standard deviation below which the slope is not fitted
FALLBACK_PER_TOKEN_S = 1e-4  # 10k prefill tokens/s: until the fit has a slope
RESIDUAL_DECAY = 0.5  # weight of the past per observation in a band's residual: the load changes within a second
MAX_LOG_RESIDUAL = math.log(10.0)  # one observation moves a band's correction by at most 10x

Band = tuple[int, bool]  # (engine priority, a lower priority's prefill pending)


@dataclass(slots=True)
class LogRatioMean:
    """Per key, an exponentially weighted mean of log(actual / predicted), each observation clamped to
    ``bound`` either way: ``correct`` multiplies a prediction by its exponential (1 for a key not yet
    observed). Callers observe only positive figures. Used for the TTFT fit's residual per band here, and
    for the queue wait's correction (guard/admission/slo.py)."""

    decay: float  # weight of the past per observation
    bound: float  # the most one observation's log ratio counts for, either way
    _means: dict = field(default_factory=dict)

    def correct(self, key: object, predicted: float) -> float:
        return predicted * math.exp(self._means.get(key, 0.0))

    def observe(self, key: object, predicted: float, actual: float) -> None:
        ratio = max(-self.bound, min(self.bound, math.log(actual / predicted)))
        before = self._means.get(key)
        self._means[key] = ratio if before is None else self.decay * before + (1 - self.decay) * ratio


@dataclass(slots=True)
class Fit:
    """TTFT = base + per_token x work, by exponentially weighted least squares (work x in tokens, TTFT y in
    seconds)."""

    w: float = 0.0
    x: float = 0.0
    y: float = 0.0
    xx: float = 0.0
    xy: float = 0.0
    seen: int = 0

    def add(self, work: int, seconds: float) -> None:
        self.w = DECAY * self.w + 1.0
        self.x = DECAY * self.x + work
        self.y = DECAY * self.y + seconds
        self.xx = DECAY * self.xx + work * work
        self.xy = DECAY * self.xy + work * seconds
        self.seen += 1

    def coefficients(self) -> tuple[float, float]:
        mx, my = self.x / self.w, self.y / self.w
        var = self.xx / self.w - mx * mx
        if var < MIN_SPREAD_TOKENS ** 2:  # every request met about the same work: the mean is the prediction
            return max(0.0, my - FALLBACK_PER_TOKEN_S * mx), FALLBACK_PER_TOKEN_S
        slope = max(0.0, (self.xy / self.w - mx * my) / var)
        return max(0.0, my - slope * mx), slope


@dataclass(slots=True)
class LatencyModel:
    # Engine priority -> uncached prompt tokens of requests sent here at it that have no first token yet.
    pending: dict[int, int] = field(default_factory=dict)
    # One fit per engine priority (the engine serves priorities differently: a borrower's prefill waits
    # behind decodes of higher ones), and one over all of them for a priority not seen ``MIN_FIT`` times.
    _fits: dict[int, Fit] = field(default_factory=dict)
    _all: Fit = field(default_factory=Fit)
    _residual: LogRatioMean = field(default_factory=lambda: LogRatioMean(RESIDUAL_DECAY, MAX_LOG_RESIDUAL))
    _step_s: float = 0.0  # the telemetry's mean step time
    _itl_s: float = 0.0  # the telemetry's mean decode step
    _tpot_s: float | None = None  # observed mean gap between tokens, weighted

    def on_snapshot(self, snapshot: TelemetrySnapshot) -> None:
        self._step_s = snapshot.step_time_s
        self._itl_s = snapshot.itl_s

    def ahead(self, priority: int) -> int:
        """Prefill tokens pending at ``priority`` or before it."""
        return sum(tokens for at, tokens in self.pending.items() if at <= priority)

    def band(self, priority: int) -> Band:
        """The load band a request sent now at ``priority`` is in (see the module docstring)."""
        return priority, any(tokens for at, tokens in self.pending.items() if at > priority)

    def admitted(self, priority: int, uncached_tokens: int) -> tuple[int, Band]:
        """A request with ``uncached_tokens`` to prefill was sent here at engine ``priority``; returns the
        work ahead of it (its own included) and its band, which ``observe_ttft`` is given back with its
        first token."""
        band = self.band(priority)
        self.pending[priority] = self.pending.get(priority, 0) + uncached_tokens
        return self.ahead(priority), band

    def started(self, priority: int, uncached_tokens: int) -> None:
        """The request's first token came (or it ended without one): its prefill is no longer ahead of anyone."""
        left = self.pending.get(priority, 0) - uncached_tokens
        if left > 0:
            self.pending[priority] = left
        else:
            self.pending.pop(priority, None)

    def coefficients(self, priority: int) -> tuple[float, float]:
        """(base seconds, seconds per token of work) at engine ``priority``: its own fit, else the fit over
        every priority, else the telemetry's step time and a nominal rate."""
        fit = self._fits.get(priority)
        if fit is not None and fit.seen >= MIN_FIT:
            return fit.coefficients()
        if self._all.seen >= MIN_FIT:
            return self._all.coefficients()
        return self._step_s, FALLBACK_PER_TOKEN_S

    def predict_ttft(self, priority: int, uncached_tokens: int) -> float:
        """Seconds from being sent here at engine ``priority`` to the first token, for a request with
        ``uncached_tokens`` to prefill."""
        base, per_token = self.coefficients(priority)
        fitted = base + per_token * (self.ahead(priority) + uncached_tokens)
        return self._residual.correct(self.band(priority), fitted)

    def observe_ttft(self, priority: int, work: int, seconds: float, band: Band | None = None) -> None:
        """A request sent at engine ``priority`` with ``work`` tokens ahead of it (its own included), in
        ``band``, saw its first token after ``seconds``."""
        base, per_token = self.coefficients(priority)
        fitted = base + per_token * work
        # Before the fit stands (MIN_FIT observations) its residuals say nothing about a band.
        if band is not None and self._all.seen >= MIN_FIT and fitted > 0 and seconds > 0:
            self._residual.observe(band, fitted, seconds)
        self._fits.setdefault(priority, Fit()).add(work, seconds)
        self._all.add(work, seconds)

    def predict_tpot(self) -> float:
        return self._tpot_s if self._tpot_s is not None else self._itl_s

    def observe_tpot(self, seconds: float) -> None:
        """A finished stream's mean gap between tokens."""
        self._tpot_s = seconds if self._tpot_s is None else DECAY * self._tpot_s + (1 - DECAY) * seconds
