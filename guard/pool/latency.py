"""A replica's latency model, learned online: what TTFT and TPOT a request sent there now would see.

    engine TTFT = base + per_token x (prefill tokens ahead + the request's uncached prompt tokens)
                       + per_running x requests running here (``Replica.in_flight``: the guard's)

``prefill tokens ahead`` are the uncached prompt tokens of the guard's requests already sent to the replica
that have no first token yet and run at the same engine priority or a higher one (the engine prefills
waiting requests in priority order, engine/sched/scheduler.py); the guard knows them exactly, ``admitted``
and ``started`` keep the count per priority. A unary request's first token is not seen: its prompt counts
until it ends.
``running`` is the engine's batch as the guard sees it: each step and each stream's relay costs more per
sequence in it. In bench/slo.py's decision logs the engine part of an interactive TTFT went from ~10 ms
with 0-4 requests running at its admission to ~40 ms with 20, a term the prefill tokens do not carry (an
interactive prompt's are the same at every load, so their slope has no spread to be fitted from).
``base`` (the relay and a step), ``per_token`` (the inverse of the measured prefill rate) and
``per_running`` are fitted to the guard's own observations, each request's admission-to-first-token time
against the work that was ahead of it and the requests already running there, by exponentially weighted
least squares: a window of about ``1 / (1 - DECAY)`` requests, so the fit follows the replica's load as it
changes; one fit per engine priority, since the engine treats them differently. Until the fit has
``MIN_FIT`` observations the engine's telemetry stands in for ``base`` (its mean step time), beside a
nominal ``per_token`` (its token rate is throughput, not speed: an idle engine's says nothing) and no
``per_running``. TPOT is the mean gap between streamed tokens that the guard observed on the replica
(exponentially weighted), before any the engine's mean decode step (``itl_s``).

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
from typing import NamedTuple

from engine.protocol import TelemetrySnapshot

DECAY = 0.95  # weight of the past per observation: ~20 requests of memory
MIN_FIT = 4  # observations before the fit replaces the telemetry's estimate
MIN_SPREAD_TOKENS = 16.0  # the work's weighted standard deviation below which the slope is not fitted
MIN_SPREAD_RUNNING = 1.0  # the same for the requests running: below it, per_running is 0
FALLBACK_PER_TOKEN_S = 1e-4  # 10k prefill tokens/s: until the fit has a slope
RESIDUAL_DECAY = 0.5  # weight of the past per observation in a band's residual: the load changes within a second
MAX_LOG_RESIDUAL = math.log(10.0)  # one observation moves a band's correction by at most 10x

Band = tuple[int, bool]  # (engine priority, a lower priority's prefill pending)


class Sent(NamedTuple):
    """What a request met when it was sent to the replica, beside the work ahead of it: its load band and
    the requests already running there."""

    band: Band
    running: int


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
    """TTFT = base + per_token x work + per_running x running, by exponentially weighted least squares (work
    x in tokens, running r in requests, TTFT y in seconds). A slope is never negative: where the joint fit
    gives one, per_token is fitted alone and per_running to what it leaves. A variable without spread
    (``MIN_SPREAD_*``) gets no fitted slope: the nominal per_token, a per_running of 0."""

    w: float = 0.0
    x: float = 0.0
    r: float = 0.0
    y: float = 0.0
    xx: float = 0.0
    rr: float = 0.0
    xr: float = 0.0
    xy: float = 0.0
    ry: float = 0.0
    seen: int = 0

    def add(self, work: int, running: int, seconds: float) -> None:
        self.w = DECAY * self.w + 1.0
        self.x = DECAY * self.x + work
        self.r = DECAY * self.r + running
        self.y = DECAY * self.y + seconds
        self.xx = DECAY * self.xx + work * work
        self.rr = DECAY * self.rr + running * running
        self.xr = DECAY * self.xr + work * running
        self.xy = DECAY * self.xy + work * seconds
        self.ry = DECAY * self.ry + running * seconds
        self.seen += 1

    def coefficients(self) -> tuple[float, float, float]:
        """(base, per_token, per_running)."""
        w = self.w
        mx, mr, my = self.x / w, self.r / w, self.y / w
        vxx, vrr, vxr = self.xx / w - mx * mx, self.rr / w - mr * mr, self.xr / w - mx * mr
        cxy, cry = self.xy / w - mx * my, self.ry / w - mr * my
        tokens, running = vxx >= MIN_SPREAD_TOKENS ** 2, vrr >= MIN_SPREAD_RUNNING ** 2
        per_token = per_running = -1.0
        if tokens and running and (det := vxx * vrr - vxr * vxr) > 1e-6 * vxx * vrr:
            per_token, per_running = (cxy * vrr - cry * vxr) / det, (cry * vxx - cxy * vxr) / det
        if per_token < 0 or per_running < 0:  # no joint fit, or a negative slope in it: one at a time
            per_token = max(0.0, cxy / vxx) if tokens else FALLBACK_PER_TOKEN_S
            per_running = max(0.0, (cry - per_token * vxr) / vrr) if running else 0.0
        return max(0.0, my - per_token * mx - per_running * mr), per_token, per_running


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

    def admitted(self, priority: int, uncached_tokens: int, running: int) -> tuple[int, Sent]:
        """A request with ``uncached_tokens`` to prefill was sent here at engine ``priority``, beside
        ``running`` other requests of the guard's; returns the work ahead of it (its own included) and what
        else it met, which ``observe_ttft`` is given back with its first token."""
        sent = Sent(self.band(priority), running)
        self.pending[priority] = self.pending.get(priority, 0) + uncached_tokens
        return self.ahead(priority), sent

    def started(self, priority: int, uncached_tokens: int) -> None:
        """The request's first token came (or it ended without one): its prefill is no longer ahead of anyone."""
        left = self.pending.get(priority, 0) - uncached_tokens
        if left > 0:
            self.pending[priority] = left
        else:
            self.pending.pop(priority, None)

    def coefficients(self, priority: int) -> tuple[float, float, float]:
        """(base seconds, seconds per token of work, seconds per request running) at engine ``priority``:
        its own fit, else the fit over every priority, else the telemetry's step time and a nominal rate."""
        fit = self._fits.get(priority)
        if fit is not None and fit.seen >= MIN_FIT:
            return fit.coefficients()
        if self._all.seen >= MIN_FIT:
            return self._all.coefficients()
        return self._step_s, FALLBACK_PER_TOKEN_S, 0.0

    def fitted(self, priority: int, work: int, running: int) -> float:
        base, per_token, per_running = self.coefficients(priority)
        return base + per_token * work + per_running * running

    def predict_ttft(self, priority: int, uncached_tokens: int, running: int) -> float:
        """Seconds from being sent here at engine ``priority`` to the first token, for a request with
        ``uncached_tokens`` to prefill, with what is pending here now and ``running`` requests of the guard's."""
        fitted = self.fitted(priority, self.ahead(priority) + uncached_tokens, running)
        return self._residual.correct(self.band(priority), fitted)

    def observe_ttft(self, priority: int, work: int, seconds: float, sent: Sent | None = None) -> None:
        """A request sent at engine ``priority`` with ``work`` tokens ahead of it (its own included), having
        met ``sent`` (None: not known, taken as nothing running), saw its first token after ``seconds``."""
        running = 0 if sent is None else sent.running
        fitted = self.fitted(priority, work, running)
        # Before the fit stands (MIN_FIT observations) its residuals say nothing about a band.
        if sent is not None and self._all.seen >= MIN_FIT and fitted > 0 and seconds > 0:
            self._residual.observe(sent.band, fitted, seconds)
        self._fits.setdefault(priority, Fit()).add(work, running, seconds)
        self._all.add(work, running, seconds)

    def predict_tpot(self) -> float:
        return self._tpot_s if self._tpot_s is not None else self._itl_s

    def observe_tpot(self, seconds: float) -> None:
        """A finished stream's mean gap between tokens."""
        self._tpot_s = seconds if self._tpot_s is None else DECAY * self._tpot_s + (1 - DECAY) * seconds
