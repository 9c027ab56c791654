"""A replica's latency model, learned online: the TTFT and TPOT a request sent there now would see, as a
median and a p90 (``Prediction``), from the replica's live telemetry and the guard's own bookkeeping.

    engine TTFT = base + per_token x (prefill tokens ahead + the request's uncached prompt tokens)
                       + per_running x sequences on the replica
    TPOT        = decode step at (sequences on the replica + 1)

**What is ahead, and what runs.** The guard knows its own requests exactly and at once: ``admitted`` and
``started`` keep, per engine priority, the uncached prompt tokens of its requests sent here that have no
first token yet (a unary request's count until it ends), and the caller gives the guard's requests in
flight here (``Replica.in_flight``). What other guards and direct clients put on the replica only its
telemetry shows (``TelemetrySnapshot.prefill_tokens`` per priority, and its running, waiting and swapped
sequences): at each snapshot, the engine's figures less the guard's own (its requests' whole prompts, as
the engine counts a waiting one; clamped at 0, since the guard counts its requests before the engine has
them) are *the others'*, added to the guard's own until the next snapshot (every 25 ms while the engine is
busy). Work ahead of a request at engine priority ``p`` is everybody's at ``p`` or before it (the engine
prefills waiting requests in priority order, engine/sched/scheduler.py). KV use is no feature of its own:
the guard's gates keep each replica's reservations under its safe utilisation, so the engine seldom waits
for blocks, and where it does (direct clients filling it), the sequences left waiting and their prefill
show it here.

**The point prediction** (the median). TTFT: ``base``, ``per_token`` and ``per_running`` are fitted to each
request's admission-to-first-token time against the work that was ahead of it and the sequences on the
replica, by exponentially weighted least squares (guard/pool/estimators.py ``Fit``): one fit per engine
priority, and one over all of them for a priority not seen ``MIN_FIT`` times; before any, the telemetry's
mean step time and a nominal prefill rate. On top of the fit, a residual correction by load band,
``(engine priority, a lower priority's prefill pending)``: what the one line misses most is whether a
lower priority's prefill is in flight (the request then waits for that step, then its own); per band an
exponentially weighted mean of log(actual / fitted), fast (``RESIDUAL_DECAY``: the load moves within a
second), multiplies the fit. TPOT: the engine's decode step as a line in the batch size, fitted to the
telemetry's (``itl_batch``, ``itl_s``) at every snapshot (``num_running`` in place of ``itl_batch`` for an
engine without it; each replica its own: heterogeneous replicas get their own lines), corrected by the
mean log ratio of the TPOT the guard's streams saw to the line's figure for the batch they joined (the
relay, and prefill chunks between decode steps).

**The p90.** Per band (TTFT; the replica-wide figure until a band has ``MIN_SPREAD_SEEN`` observations) and
per replica (TPOT), the 0.9 quantile of log(actual / the median predicted when the request was sent),
tracked online (``Quantile``), gives p90 = median x exp(that quantile), never below the median. Until it is
known the p90 is the median: nothing learned, nothing added.

**What is learned from.** Every request whose prediction is read anyway (one with an objective: its
decision and its verdict are scored on it), and besides them a sample: the first request sent
``SAMPLE_INTERVAL_S`` or more after the last one the model sampled (``sample``). Learning is a few
microseconds a request in isolation and several times that inside a loaded guard (its objects are cold);
at a real engine's rates (tens of first tokens a second) the sample is nearly every request, and at
hundreds to thousands a second the model learns from 1/``SAMPLE_INTERVAL_S`` a second: its fits remember
~20 observations, 0.2 s of them, well within the second in which a load changes, at a cost that grows
with time, not with the rate (at 500 a second it took ~2 % of bench/guard_ab.py's unary requests). The
choice is made as the request is sent, before anything about its latency is known, so the sample is not
biased by it.

**Only while predictions are read** (guard/admission/dispatch.py ``predicting_until``): where the config
sets an objective (a lane's ``slo``, a tenant's named objective), always; else from the first request whose
X-SLO-* headers give it one until ``PREDICTING_S`` (guard/admission/slo.py) after the last such. A guard
without objectives keeps nothing here but the telemetry's figures: at bench/guard_ab.py's unary rate the
prefill bookkeeping alone was ~1.7 % of a request. When it starts, the guard's requests already in
flight are not in ``pending``; the next snapshot counts their prefill among the others'.

The guard's queue wait, in front of every replica, is predicted elsewhere (guard/admission/slo.py).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import NamedTuple

from engine.protocol import TelemetrySnapshot
from guard.pool.estimators import FALLBACK_SLOPE_X, Fit, LogRatioMean, Quantile, log_ratio

MIN_FIT = 4  # observations before a fit replaces the telemetry's estimate
RESIDUAL_DECAY = 0.5  # weight of the past per observation in a band's residual: the load changes within a second
MAX_LOG_RESIDUAL = math.log(10.0)  # one observation moves a correction or a quantile by at most 10x
P90 = 0.9
MIN_SPREAD_SEEN = 8  # observations before a band's own p90 replaces the replica-wide one
STEP_DECAY = 0.99  # the decode step's fit, per snapshot (one every 25 ms while busy): ~2.5 s of steps
TPOT_DECAY = 0.8  # weight of the past per finished stream in the TPOT correction
SAMPLE_INTERVAL_S = 0.01  # at most 100 sampled requests a second per replica (see "What is learned from")

Band = tuple[int, bool]  # (engine priority, a lower priority's prefill pending)


class Prediction(NamedTuple):
    """Seconds: the point prediction (a median) and the p90 (nine in ten should come within it)."""

    median: float
    p90: float


UNKNOWN = Prediction(0.0, 0.0)  # nothing to predict from yet (an idle replica's TPOT, before any stream)


class Sent(NamedTuple):
    """What a request met when it was sent to the replica, beside the work ahead of it: its load band, the
    sequences already there (the guard's and others'), and what was predicted for it then (``UNKNOWN``:
    nothing), which its first token and its stream's end are scored against."""

    band: Band
    running: int
    ttft: Prediction = UNKNOWN
    tpot: Prediction = UNKNOWN


def _bump(counts: dict[int, int], key: int, by: int) -> None:
    left = counts.get(key, 0) + by
    if left > 0:
        counts[key] = left
    else:
        counts.pop(key, None)


@dataclass(slots=True)
class LatencyModel:
    # Engine priority -> uncached prompt tokens of the guard's requests sent here at it without a first token.
    pending: dict[int, int] = field(default_factory=dict)
    _prompts: dict[int, int] = field(default_factory=dict)  # the same requests' whole prompts (the engine's count)
    _others: dict[int, int] = field(default_factory=dict)  # per priority, the telemetry's prefill beyond the guard's
    _others_running: int = 0  # the telemetry's sequences beyond the guard's requests in flight
    # One fit per engine priority (the engine serves priorities differently: a borrower's prefill waits
    # behind decodes of higher ones), and one over all of them for a priority not seen ``MIN_FIT`` times.
    # While one priority alone was seen, its fit is the one over all (the same object: one ``add``).
    _fits: dict[int, Fit] = field(default_factory=dict)
    _all: Fit = field(default_factory=Fit)
    _residual: LogRatioMean = field(default_factory=lambda: LogRatioMean(RESIDUAL_DECAY, MAX_LOG_RESIDUAL))
    _spread: dict[Band | None, Quantile] = field(default_factory=dict)  # None: the replica-wide one
    _step: Fit = field(default_factory=lambda: Fit(STEP_DECAY))  # decode step (s) against the batch (r)
    _tpot_residual: LogRatioMean = field(default_factory=lambda: LogRatioMean(TPOT_DECAY, MAX_LOG_RESIDUAL))
    _tpot_spread: Quantile = field(default_factory=lambda: Quantile(P90))
    _step_s: float = 0.0  # the telemetry's mean step time
    _itl_s: float = 0.0  # the telemetry's mean decode step
    _next_sample: float = 0.0  # time.monotonic() from which the next request sent is sampled

    def on_snapshot(self, snapshot: TelemetrySnapshot, in_flight: int) -> None:
        """The replica's telemetry, with ``in_flight`` of the guard's requests there as it arrives."""
        self._step_s, self._itl_s = snapshot.step_time_s, snapshot.itl_s
        own = self._prompts
        self._others = {p: tokens - own.get(p, 0) for p, tokens in snapshot.prefill_tokens.items()
                        if tokens > own.get(p, 0)}
        self._others_running = max(0, snapshot.num_running + snapshot.num_waiting + snapshot.num_swapped - in_flight)
        # The window's own batch (itl_batch) is itl_s's pair; the instant's num_running lags it while the batch
        # grows or shrinks, which flattened the fitted line (an engine before itl_batch sends 0).
        batch = snapshot.itl_batch or snapshot.num_running
        if snapshot.itl_s > 0 and batch > 0:
            self._step.add(0.0, batch, snapshot.itl_s)

    def ahead(self, priority: int) -> int:
        """Prefill tokens pending at ``priority`` or before it: the guard's and the others'."""
        return self._load(priority)[0]

    def band(self, priority: int) -> Band:
        """The load band a request sent now at ``priority`` is in (see the module docstring)."""
        return self._load(priority)[1]

    def _load(self, priority: int) -> tuple[int, Band]:
        """``ahead`` and ``band`` in one pass over the pending prefill (asked for every request sent)."""
        ahead, lower = 0, False
        for counts in (self.pending, self._others):
            for at, tokens in counts.items():
                if at <= priority:
                    ahead += tokens
                else:
                    lower = True
        return ahead, (priority, lower)

    def running(self, in_flight: int) -> int:
        """Sequences on the replica: ``in_flight`` of the guard's and the others' the telemetry showed."""
        return in_flight + self._others_running

    def sample(self, now: float) -> bool:
        """Whether a request sent at ``now`` is in the sample learned from (see "What is learned from")."""
        if now < self._next_sample:
            return False
        self._next_sample = now + SAMPLE_INTERVAL_S
        return True

    def admitted(self, priority: int, uncached_tokens: int, prompt_tokens: int, in_flight: int,
                 tpot: bool = True, predict: bool = True) -> tuple[int, Sent | None]:
        """A request with ``uncached_tokens`` to prefill (of ``prompt_tokens``) was sent here at engine
        ``priority``, beside ``in_flight`` other requests of the guard's; returns the work ahead of it (its
        own included) and what it met and was predicted, which ``observe_ttft`` and ``observe_tpot`` are
        given back. ``tpot``: its TPOT is predicted too (``UNKNOWN`` otherwise: a unary answer without an
        objective has no stream to score it against). ``predict`` False: a request neither read nor learned
        from, whose prefill is only counted ahead of others: (0, None)."""
        if uncached_tokens > 0:  # ``_bump`` inlined: twice per request each way
            pending = self.pending
            pending[priority] = pending.get(priority, 0) + uncached_tokens
        if prompt_tokens > 0:
            prompts = self._prompts
            prompts[priority] = prompts.get(priority, 0) + prompt_tokens
        if not predict:
            return 0, None
        ahead, band = self._load(priority)  # its own prefill now pending: the work ahead includes it
        running, work = in_flight + self._others_running, ahead
        return work, Sent(band, running, self._predict(priority, band, work, running),
                          self._tpot(running + 1) if tpot else UNKNOWN)

    def started(self, priority: int, uncached_tokens: int, prompt_tokens: int) -> None:
        """The request's first token came (or it ended without one): its prefill is no longer ahead of anyone."""
        if uncached_tokens > 0:
            _bump(self.pending, priority, -uncached_tokens)
        if prompt_tokens > 0:
            _bump(self._prompts, priority, -prompt_tokens)

    def coefficients(self, priority: int) -> tuple[float, float, float]:
        """(base seconds, seconds per token of work, seconds per sequence running) at engine ``priority``:
        its own fit, else the fit over every priority, else the telemetry's step time and a nominal rate."""
        fit = self._fits.get(priority)
        if fit is not None and fit.seen >= MIN_FIT:
            return fit.coefficients()
        if self._all.seen >= MIN_FIT:
            return self._all.coefficients()
        return self._step_s, FALLBACK_SLOPE_X, 0.0

    def fitted(self, priority: int, work: int, running: int) -> float:
        base, per_token, per_running = self.coefficients(priority)
        return base + per_token * work + per_running * running

    def predict_ttft(self, priority: int, uncached_tokens: int, in_flight: int) -> Prediction:
        """Seconds from being sent here at engine ``priority`` to the first token, for a request with
        ``uncached_tokens`` to prefill, with what is pending here now and ``in_flight`` requests of the guard's."""
        ahead, band = self._load(priority)
        return self._predict(priority, band, ahead + uncached_tokens, self.running(in_flight))

    def _predict(self, priority: int, band: Band, work: int, running: int) -> Prediction:
        median = self._residual.correct(band, self.fitted(priority, work, running))
        spread = self._spread.get(band)
        if spread is None or spread.seen < MIN_SPREAD_SEEN:
            spread = self._spread.get(None)
        return Prediction(median, median * math.exp(max(0.0, spread.value)) if spread is not None else median)

    def observe_ttft(self, priority: int, work: int, seconds: float, sent: Sent | None = None) -> None:
        """A request sent at engine ``priority`` with ``work`` tokens ahead of it (its own included), having
        met ``sent`` (None: not known, taken as nothing running), saw its first token after ``seconds``."""
        running = 0 if sent is None else sent.running
        fitted = self.fitted(priority, work, running)
        # Before the fit stands (MIN_FIT observations) its residuals say nothing about a band.
        if sent is not None and self._all.seen >= MIN_FIT and fitted > 0 and seconds > 0:
            if sent.ttft.median > 0:
                error = log_ratio(seconds, sent.ttft.median, MAX_LOG_RESIDUAL)
                for key in (sent.band, None):
                    if (spread := self._spread.get(key)) is None:  # not setdefault: a Quantile made every time
                        spread = self._spread[key] = Quantile(P90)
                    spread.observe(error)
            self._residual.observe(sent.band, fitted, seconds)
        fits, every = self._fits, self._all
        if (fit := fits.get(priority)) is None:
            if len(fits) == 1:  # a second priority: the first one's fit, until now the one over all, is copied
                (first,) = fits
                fits[first] = copy.copy(every)
            fit = fits[priority] = Fit() if fits else every
        fit.add(work, running, seconds)
        if fit is not every:
            every.add(work, running, seconds)

    def decode_step(self, batch: int) -> float:
        """The engine's decode step with ``batch`` sequences: the telemetry's line once fitted, else its
        latest mean decode step (0 when idle and never fitted)."""
        if self._step.seen >= MIN_FIT:
            base, _, per_sequence = self._step.coefficients()
            return base + per_sequence * batch
        return self._itl_s

    def predict_tpot(self, in_flight: int) -> Prediction:
        """Seconds per output token for a stream that joins the replica now, beside ``in_flight`` requests of
        the guard's (its decode batch is the sequences there, plus its own); ``UNKNOWN`` before any step
        was seen."""
        return self._tpot(self.running(in_flight) + 1)

    def _tpot(self, batch: int) -> Prediction:
        """``predict_tpot`` for a decode batch of ``batch`` sequences, its own included."""
        step = self.decode_step(batch)
        if step <= 0:
            return UNKNOWN
        median = self._tpot_residual.correct(None, step)
        spread = self._tpot_spread
        return Prediction(median, median * math.exp(max(0.0, spread.value)) if spread.seen else median)

    def observe_tpot(self, seconds: float, sent: Sent | None) -> None:
        """A finished stream's mean gap between tokens, sent having met ``sent``."""
        if sent is None or seconds <= 0 or sent.tpot.median <= 0:
            return
        self._tpot_spread.observe(log_ratio(seconds, sent.tpot.median, MAX_LOG_RESIDUAL))
        if (step := self.decode_step(sent.running + 1)) > 0:
            self._tpot_residual.observe(None, step, seconds)
