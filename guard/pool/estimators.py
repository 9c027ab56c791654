"""Online estimators the latency predictions are built from (guard/pool/latency.py, guard/admission/slo.py):
each update is O(1) arithmetic on a few floats, so that learning from every request costs the request path
nothing it would notice.

- ``Fit``: y = base + a x x + b x r by exponentially weighted least squares (two features, slopes never
  negative).
- ``LogRatioMean``: per key, an exponentially weighted mean of log(actual / predicted): a multiplicative
  correction of a point prediction.
- ``Quantile``: a running estimate of one quantile of a stream, by stochastic approximation (the
  "frugal" quantile update, its step scaled by the stream's spread): what turns a point prediction into a
  p90, from the log ratios of what happened to what the point prediction said.
- ``Pace``: units per second over a recent window of *busy* time (a replica's blocks released while it
  held any, the guard queue's blocks leaving it).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

DECAY = 0.95  # the fits' weight of the past per observation: ~20 requests of memory
MIN_SPREAD_X = 16.0  # the first feature's weighted standard deviation below which its slope is not fitted
MIN_SPREAD_R = 1.0  # the same for the second: below it, its slope is 0
FALLBACK_SLOPE_X = 1e-4  # the first feature's slope while it has no spread (TTFT: 10k prefill tokens/s)


def log_ratio(actual: float, predicted: float, bound: float) -> float:
    """log(actual / predicted), clamped to ``bound`` either way (both positive): how far one observation
    may move a correction or a quantile."""
    return max(-bound, min(bound, math.log(actual / predicted)))


@dataclass(slots=True)
class Fit:
    """y = base + a x x + b x r, by exponentially weighted least squares (``decay``: the weight of the past
    per observation). A slope is never negative: where the joint fit gives one, ``a`` is fitted alone and
    ``b`` to what it leaves. A feature without spread (``MIN_SPREAD_*``) gets no fitted slope: ``a`` is
    ``FALLBACK_SLOPE_X``, ``b`` is 0."""

    decay: float = DECAY
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
    _solved: tuple[float, float, float] | None = None  # ``coefficients`` since the last ``add``

    def add(self, x: float, r: float, y: float) -> None:
        self._solved = None
        d = self.decay
        self.w = d * self.w + 1.0
        self.x = d * self.x + x
        self.r = d * self.r + r
        self.y = d * self.y + y
        self.xx = d * self.xx + x * x
        self.rr = d * self.rr + r * r
        self.xr = d * self.xr + x * r
        self.xy = d * self.xy + x * y
        self.ry = d * self.ry + r * y
        self.seen += 1

    def coefficients(self) -> tuple[float, float, float]:
        """(base, a, b), solved once per observation (a request is predicted on several times between two)."""
        if self._solved is None:
            self._solved = self._solve()
        return self._solved

    def _solve(self) -> tuple[float, float, float]:
        w = self.w
        mx, mr, my = self.x / w, self.r / w, self.y / w
        vxx, vrr, vxr = self.xx / w - mx * mx, self.rr / w - mr * mr, self.xr / w - mx * mr
        cxy, cry = self.xy / w - mx * my, self.ry / w - mr * my
        spread_x, spread_r = vxx >= MIN_SPREAD_X ** 2, vrr >= MIN_SPREAD_R ** 2
        a = b = -1.0
        if spread_x and spread_r and (det := vxx * vrr - vxr * vxr) > 1e-6 * vxx * vrr:
            a, b = (cxy * vrr - cry * vxr) / det, (cry * vxx - cxy * vxr) / det
        if a < 0 or b < 0:  # no joint fit, or a negative slope in it: one at a time
            a = max(0.0, cxy / vxx) if spread_x else FALLBACK_SLOPE_X
            b = max(0.0, (cry - a * vxr) / vrr) if spread_r else 0.0
        return max(0.0, my - a * mx - b * mr), a, b


@dataclass(slots=True)
class LogRatioMean:
    """Per key, an exponentially weighted mean of log(actual / predicted), each observation clamped to
    ``bound`` either way: ``correct`` multiplies a prediction by its exponential (1 for a key not yet
    observed). Callers observe only positive figures."""

    decay: float  # weight of the past per observation
    bound: float  # the most one observation's log ratio counts for, either way
    _means: dict = field(default_factory=dict)

    def correct(self, key: object, predicted: float) -> float:
        return predicted * math.exp(self._means.get(key, 0.0))

    def observe(self, key: object, predicted: float, actual: float) -> None:
        ratio = log_ratio(actual, predicted, self.bound)
        before = self._means.get(key)
        self._means[key] = ratio if before is None else self.decay * before + (1 - self.decay) * ratio


GAIN = 0.1  # a quantile's step, in units of the stream's spread: ~10-20 observations to move by one spread
SPREAD_DECAY = 0.9  # the spread's weight of the past per observation
MIN_SPREAD = 0.02  # a floor on the spread (log units: 2%), so that a constant stream still moves its estimate


@dataclass(slots=True)
class Quantile:
    """The ``tau`` quantile of a stream of numbers, tracked online: each observation moves the estimate up
    by ``tau`` steps when it lies above it, down by ``1 - tau`` steps when below, so that it settles where
    a share ``tau`` of the stream lies below it (and follows the stream when that moves). The step is
    ``GAIN`` times the stream's spread (an exponentially weighted mean absolute deviation from the
    estimate), so the estimate is scale-free; the first observations take larger steps (1 / n) to get
    there sooner. ``seen``: observations so far."""

    tau: float
    value: float = 0.0
    spread: float = MIN_SPREAD
    seen: int = 0

    def observe(self, x: float) -> None:
        if self.seen == 0:
            self.value, self.spread = x, max(MIN_SPREAD, abs(x))
        else:
            step = max(GAIN, 1.0 / self.seen) * self.spread
            self.value += step * (self.tau - (1.0 if x < self.value else 0.0))
            self.spread = SPREAD_DECAY * self.spread + (1 - SPREAD_DECAY) * max(MIN_SPREAD, abs(x - self.value))
        self.seen += 1


IDLE_GAP_S = 1.0  # an idle spell shorter than this is counted busy: the pace is to the second anyway


class Pace:
    """Units per second (blocks released, blocks leaving a queue) over the last ``window`` seconds of busy
    time: time in which the owner held something that could end (``busy`` to ``idle``). An idle spell says
    nothing about the pace, and counting it read the pace low after every one: a replica idle for 8 s of
    the last 10 drained at a fifth of its rate by the clock, and a burst that followed was told to wait
    five times as long (refused ``overloaded`` past a lane's timeout, or a long ``Retry-After``). A pace
    starts idle: its owner holds nothing yet.

    Units are counted per whole second of the clock (one entry per second however many events fall in it),
    and idle spells shorter than ``IDLE_GAP_S`` are counted busy, so the window holds a few entries at any
    request rate. Until ``window`` seconds of busy time have passed, the pace divides by the busy time seen
    (at least a second)."""

    __slots__ = ("_busy_since", "_seconds", "_spells", "_units", "window")

    def __init__(self, window: float) -> None:
        self.window = window
        self._seconds: deque[list[int]] = deque()  # [second, units]
        self._units = 0  # their sum, kept as seconds enter and leave the window
        self._spells: deque[tuple[float, float]] = deque()  # busy spells that ended, (start, end), oldest first
        self._busy_since: float | None = None  # when the current busy spell began (None: idle)

    def add(self, units: int, now: float) -> None:
        second = int(now)
        if self._seconds and self._seconds[-1][0] == second:
            self._seconds[-1][1] += units
        else:
            self._seconds.append([second, units])
        self._units += units

    def busy(self, now: float) -> None:
        """The owner holds something again (no effect while busy)."""
        if self._busy_since is None:
            if self._spells and now - self._spells[-1][1] < IDLE_GAP_S:
                self._busy_since = self._spells.pop()[0]  # a short gap: one spell
            else:
                self._busy_since = now

    def idle(self, now: float) -> None:
        """The owner holds nothing (no effect while idle)."""
        if self._busy_since is not None:
            self._spells.append((self._busy_since, now))
            self._busy_since = None

    def rate(self, now: float) -> float:
        """Units per busy second over the window (0 when none were counted)."""
        start = now - self.window
        while self._seconds and now - self._seconds[0][0] > self.window:
            self._units -= self._seconds.popleft()[1]
        while self._spells and self._spells[0][1] <= start:
            self._spells.popleft()
        busy = sum(end - max(begin, start) for begin, end in self._spells)
        if self._busy_since is not None:
            busy += now - max(self._busy_since, start)
        return self._units / max(busy, 1.0)
