"""Latency objectives: what a request was promised, what it is predicted to get, and refusing it early.

A request's ``Objective`` is its lane's ``slo`` (guard/config.py), or the tenant's named objective it
selected (guard/admission/classes.py), tightened (never loosened) by the headers ``X-SLO-TTFT-Ms`` and
``X-SLO-TPOT-Ms``, with the request's class (its lane's unless it picked another: classes.py).

Its TTFT is predicted when it reaches the dispatcher, as

    predicted TTFT = time since arrival + guard queue wait + the best replica's engine TTFT
                                                              (guard/pool/latency.py, at its engine priority)

The queue wait counts the blocks queued to be admitted before it: a critical request's are the critical
requests queued (they go first, guard/admission/dispatch.py), a standard one's those and its own tenant's
lanes before its own (VTC serves other tenants by their counters, not before it). With blocks ahead, the
wait is them over the pace at which blocks leave the queue (``Departures``); with none, it is the blocks it
needs past the pool's budget over the replicas' drain rate (none when it fits now; what others borrowed
counts as room for a request that does not borrow itself).

A sheddable request's wait is the sheddable blocks queued before it, and its own, over the pace at which
the queue *admits* sheddable blocks: critical work that arrives after it still goes first, and that pace,
measured while it does, has it in already; a sheddable ticket that leaves the queue unadmitted frees
nothing on a replica, so it does not count in the pace. The pace is the lower of the last
``SHEDDABLE_WINDOW_S`` of backlog's and the last ``RECENT_ADMISSIONS``' (with the backlog since, the
oldest queued ticket's wait so far included): a drop shows within a few admissions, a rise only as the long
window sees it (``BacklogPace``).

Every figure is a median and a p90 (``Prediction``). The engine's part and the TPOT come from each
replica's latency model (guard/pool/latency.py). The queue wait's median is the pace's or the drain's
figure times ``WaitCorrection``'s learned ratio (how the waits that queued tickets really had compared with
their predictions); its p90 is that median times the 0.9 quantile of actual / corrected wait, learned per
class, way of predicting and whether the wait is *decisive* (its median at least ``DECISIVE_SHARE`` of the
ticket's TTFT objective), once ``MIN_MARGIN_SEEN`` tickets have taught it (until then,
``PRIOR_P90_RATIO``: twice the median, the 50% margin issue 31 settled on, under which the pace may halve
with the ticket still on time). The decisive spread is the queue margin, learned: what the objective would
have to leave above the median wait for nine in ten tickets near the refusal line to be admitted in time
(it decided sheddable refusals until they took the median, below; it is the p90 that records and the
bench's p90 error report). It is learned apart because a short wait's ratio spreads far wider than
a long one's (a few departures early or late double it): in one run of bench/slo.py, the batch lane's
actual / predicted wait had a p90 of 3.0-4.4 for predicted waits under 0.5 s, and 1.2-1.5 over 3 s;
learned over every ticket, the margin came out at 2.5x and refused the batch lane's work that the 2x prior
served in time (13 -> 32 refusals, none of the served late either way). The TTFT's p90 adds the
queue's and the engine's excesses over their medians in quadrature (two parts that vary apart:
``combine``). When the request is placed, its engine part and TPOT are predicted again for the replica it
is placed on, with the prefix hits and the batch it meets there: what its decision record shows.

A sheddable request that would be late even at the soonest of nine in ten such waits (the 0.1 quantile of
actual over predicted wait, learned from the same tickets as the p90: ``WaitCorrection.soonest``; until
then half the median), or whose p90 TPOT on every replica is past its TPOT objective (the decode batch it
would join there is too large), is refused at once (``slo_unattainable``, with ``Retry-After`` from the
predicted wait): waiting would only make it late and hold blocks that requests still on time need. One that
is queued is served while it can still be on time: once what is left of its TTFT objective is no more than
the engine's predicted part (its median), or its turn comes when no usable replica's would fit in it
(``too_late``), it leaves the queue unadmitted (503 ``queue_timeout``, as a lane timeout set to the
objective drops it: ``queue_limit``), since served then it would more likely than not be late, on room that
work still on time needs. (Queued, it is held to the median where other classes are held to the p90: it
is lent whole and takes nothing from work that must be on time; the ``slo`` filter places it so too.) So a
hopeful prediction costs only the wait of a ticket that then leaves, where a fearful one loses work and
leaves the engine's room for it unused: bench/slo.py S2 at L = 2, refused on the median, the guard served
71-105 batch requests a block where B2 (lane timeouts at the objectives) served 92-125, on an engine idle
for the difference; refused only past the soonest wait, it matches B2 (request goodput 1.000 of the better
of B1 and B2, on-time batch 0.92 of B1's batch completions, none served late; docs/benchmarks/slo.md).
What it costs: the queue then stands at its deadline, so the served batch requests' TTFT says little of
what was predicted for them (median predicted / actual 1.3-1.8). (Judging queued tickets again and
refusing those predicted late answered some refusals 4-8 s after arrival, once the sheddable pace halved
under tickets queued on it: the deadline is the objective itself, not a prediction.)
Critical and standard requests are never refused for their objective: they are served and counted
(``guard_slo_requests_total``); placement holds back the replicas predicted to break either objective (the
``slo`` filter, guard/pool/scheduling/filters.py). But a queued one that can no longer be on time (``late``:
its wait so far and the engine's predicted part, its p90, past its TTFT objective) yields to those of its
class that still can: within its tenant it goes behind them, and across tenants the critical band serves
tenants whose next critical ticket is on time first (guard/admission/dispatch.py). Served first come first,
a queue that outgrows the replicas makes every ticket in it late: in bench/slo.py's S1 with the interactive
(critical) lane offered at twice the capacity, the guard with objectives kept 8-25 % of it on time where
B2, whose lane timeout drops a ticket at the objective, kept 49-72 %; yielding, it keeps 72-86 % (B2 49-64 %
in the same runs; at 120 s blocks 77-85 % against B2's 70-84 %), and the late ones are served with what the on-time ones leave, until their lane's
timeout. Before anything has drained there is no pace to predict a wait from, and nothing is refused for
its TTFT; before a replica has stepped, nothing for its TPOT.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from multidict import istr

from guard.config import GuardConfig, Lane, Slo
from guard.errors import GuardError, Outcome
from guard.pool.estimators import Pace, Quantile, log_ratio
from guard.pool.gate import engine_priority
from guard.pool.latency import P90, Prediction, Sent
from guard.pool.pool import ReplicaPool

HEADERS = {"ttft": "X-SLO-TTFT-Ms", "tpot": "X-SLO-TPOT-Ms"}
# As looked up on every request: istr, so that a multidict does not lower-case the name again each time.
TTFT_HEADER, TPOT_HEADER = istr(HEADERS["ttft"]), istr(HEADERS["tpot"])
CRITICAL, STANDARD, SHEDDABLE = "critical", "standard", "sheddable"
ORDER = {CRITICAL: 0, STANDARD: 1, SHEDDABLE: 2}  # the order classes are served in, inside a tenant
DEPARTURE_WINDOW_S = 5.0
# The queue wait's p90 over its median until ``MIN_MARGIN_SEEN`` queued tickets have taught it (see the
# module docstring): a sheddable ticket queued then stays on time while the pace falls to half.
PRIOR_P90_RATIO = 2.0
# The soonest of nine in ten such waits (its 0.1 quantile) over the median, until learned as the p90 is: the
# pace may double. A sheddable ticket is refused only when even that wait would make it late.
P10 = 0.1
PRIOR_P10_RATIO = 0.5
MIN_MARGIN_SEEN = 8
DECISIVE_SHARE = 0.3  # a queued ticket whose predicted wait was this share of its TTFT objective teaches the margin
SHEDDABLE_WINDOW_S = 10.0
RECENT_ADMISSIONS = 6  # the short sheddable pace: over this many admissions from the queue, and the backlog since
BACKLOG_GAP_S = 1.0  # a sheddable backlog that begins this long after the last one ended is a new one
MIN_BACKLOG_WAIT_S = 0.5  # a sheddable ticket admitted sooner found room: it says nothing of the pace
MIN_LEARNED_WAIT_S = 0.05  # predicted waits below this teach the correction nothing
MAX_LOG_RATIO = math.log(30.0)  # a ticket's ratio counts as at most 30x either way
# Where no lane and no named objective sets one, the replicas' latency models are kept this long after the
# last request whose X-SLO-* headers gave it an objective (guard/pool/latency.py, "What is learned from").
PREDICTING_S = 300.0


@dataclass(slots=True, frozen=True)
class Objective:
    ttft_s: float | None
    tpot_s: float | None
    priority_class: str
    name: str | None = None  # the tenant's named objective it came from (None: its lane's)

    def as_record(self) -> dict:
        return {"ttft_ms": None if self.ttft_s is None else round(1e3 * self.ttft_s, 3),
                "tpot_ms": None if self.tpot_s is None else round(1e3 * self.tpot_s, 3),
                "priority_class": self.priority_class}


def configured(config: GuardConfig) -> bool:
    """Whether a lane or a tenant's named objective sets a latency objective: then requests are predicted
    from the start, not only once their headers ask for one."""
    return (any(lane.slo is not None for lane in config.lanes.values())
            or any(named.slo is not None for tenant in config.tenants for named in tenant.objectives.values()))


def objective_for(lane: Lane, headers: Mapping[str, str],
                  selected: tuple[str, str | None, Slo | None] | None = None) -> Objective | None:
    """The lane's objective, or the request's ``selected`` (class, objective name, slo:
    guard/admission/classes.py), tightened by the request's headers; None when neither sets one. A header
    that is not a positive number of milliseconds is a 400 naming it; one looser than the objective is ignored."""
    priority_class, name, slo = selected if selected is not None else (lane.priority_class, None, lane.slo)
    ttft = slo.ttft_ms if slo is not None else None
    tpot = slo.tpot_ms if slo is not None else None
    ttft, tpot = _tighten(ttft, headers, TTFT_HEADER), _tighten(tpot, headers, TPOT_HEADER)
    if ttft is None and tpot is None:
        return None
    return Objective(None if ttft is None else ttft / 1e3, None if tpot is None else tpot / 1e3,
                     priority_class, name)


def _tighten(lane_ms: float | None, headers: Mapping[str, str], name: istr) -> float | None:
    raw = headers.get(name)
    if raw is None:
        return lane_ms
    try:
        asked = float(raw)
    except ValueError:
        asked = math.nan
    if not math.isfinite(asked) or asked <= 0:
        raise GuardError(400, f"header {name}: expected a positive number of milliseconds, got {raw[:32]!r}",
                         param=str(name), code="invalid_slo_header", outcome=Outcome.REJECTED_INVALID)
    return asked if lane_ms is None else min(lane_ms, asked)


class Judged(Protocol):
    """What judging reads of a ticket (guard/admission/dispatch.py) and writes into it."""

    lane: Lane
    priority_class: str
    objective: Objective | None
    blocks: int
    prompt_tokens: int
    arrived: float
    predicted_ttft: float | None
    predicted_ttft_p90: float | None
    predicted_tpot: float | None
    predicted_tpot_p90: float | None
    predicted_wait: float | None
    corrected_wait: float | None
    predicted_queue: float | None
    predicted_queue_p90: float | None
    predicted_engine: float | None
    predicted_engine_p90: float | None
    wait_key: tuple[str, bool] | None
    sent: Sent | None


class Backlog(NamedTuple):
    """What is queued to be admitted before a ticket: ``blocks``, by its class (see the module docstring),
    and for a sheddable one ``since``: when the oldest sheddable ticket queued now was queued (None: none is)."""

    blocks: int
    since: float | None = None


class BacklogPace:
    """Sheddable blocks admitted from the queue per second *of backlog* (while sheddable tickets waited):
    what the replicas give sheddable work while it waits for them. Not per second of the clock: refusals
    keep the queue short, and the pace they allow would predict ever longer waits and refuse more (in a
    trial, a third of the batch lane's throughput). A backlog second is one some sheddable ticket spent
    queued, counted when it leaves the queue. A ticket admitted within ``MIN_BACKLOG_WAIT_S`` of queueing
    found room rather than waited for it: it counts neither its blocks nor its wait (as the queue forms, a
    few such tickets made the pace look several times what it was).

    ``rate`` is the lower of two paces, so that a drop shows at once and a rise only as it lasts:
    - over the last ``SHEDDABLE_WINDOW_S`` of backlog;
    - over the last ``RECENT_ADMISSIONS`` admissions of the current backlog, with the backlog since the
      one before them (or since the backlog began) up to now, the wait so far of the oldest ticket queued
      now included: a stall lowers it before anything leaves. A backlog that begins after
      ``BACKLOG_GAP_S`` without one is new (the load that set the pace before may be gone: a burst of
      critical work arrives, or it stopped and the queue drained fast); until its first admission its pace
      is one admission's blocks over its wait so far.
    A queued ticket is served whatever the pace does after, so it is judged by a pace that a drop under way
    has already lowered: with the long window alone, tickets queued as a new load began were judged by the
    last one's pace and waited 2-5 times what was predicted."""

    def __init__(self) -> None:
        self._busy = 0.0  # seconds of backlog so far
        self._covered = 0.0  # time.monotonic() up to which backlog is counted
        self._events: deque[tuple[float, int]] = deque()  # (``_busy`` when admitted, blocks)
        self._blocks = 0
        self._recent: deque[tuple[float, int]] = deque(maxlen=RECENT_ADMISSIONS)  # the current backlog's
        self._recent_from = 0.0  # ``_busy`` where the recent span starts

    def left(self, enqueued_at: float, blocks: int) -> None:
        """A sheddable ticket queued at ``enqueued_at`` left the queue now: admitted with ``blocks``, or
        gone (0)."""
        now = time.monotonic()
        if blocks and now - enqueued_at < MIN_BACKLOG_WAIT_S:
            return
        if enqueued_at - self._covered > BACKLOG_GAP_S:  # a new backlog
            self._recent.clear()
            self._recent_from = self._busy
        self._busy += max(0.0, now - max(enqueued_at, self._covered))
        self._covered = max(self._covered, now)
        if blocks:
            self._events.append((self._busy, blocks))
            self._blocks += blocks
            if len(self._recent) == self._recent.maxlen:
                self._recent_from = self._recent[0][0]
            self._recent.append((self._busy, blocks))

    def rate(self, since: float | None = None) -> float:
        """Blocks per second of backlog (0: none admitted after a wait yet); ``since``: when the oldest
        sheddable ticket queued now was queued (None: none is)."""
        while self._events and self._busy - self._events[0][0] > SHEDDABLE_WINDOW_S:
            self._blocks -= self._events.popleft()[1]
        long = self._blocks / min(SHEDDABLE_WINDOW_S, max(self._busy, 1.0))
        now = time.monotonic()
        waited = since is not None and now - since >= MIN_BACKLOG_WAIT_S  # (once it counts as backlog)
        if waited and since - self._covered > BACKLOG_GAP_S and self._events:  # a new backlog, none admitted
            return min(long, self._blocks / len(self._events) / (now - since))
        if not self._recent:
            return long
        stall = now - max(since, self._covered) if waited else 0.0
        span = self._busy + max(0.0, stall) - self._recent_from
        return min(long, sum(blocks for _, blocks in self._recent) / max(span, 1.0))


class Departures:
    """Blocks leaving the guard's queue per second. ``rate()``: every way they leave (admitted from it, or
    gone: a deadline, a client that left): a ticket that finds others queued reaches the head when the
    blocks ahead of it have left, whichever way they leave, so their pace, not the replicas' drain,
    predicts its wait (critical work that never queued, and tickets that leave early, are both in it).
    ``rate(SHEDDABLE)``: the sheddable ``BacklogPace`` (see the module docstring)."""

    def __init__(self) -> None:
        # Per second in which tickets were queued (guard/pool/estimators.py): the queue's idle spells, when
        # nothing could leave it, would read the pace low after each.
        self._all, self.sheddable = Pace(DEPARTURE_WINDOW_S), BacklogPace()

    def queued(self) -> None:
        """A ticket was queued."""
        self._all.busy(time.monotonic())

    def add(self, blocks: int, emptied: bool) -> None:
        """``blocks`` left the queue, whichever way (``emptied``: the queue is empty now)."""
        now = time.monotonic()
        self._all.add(blocks, now)
        if emptied:
            self._all.idle(now)

    def rate(self, priority_class: str | None = None, since: float | None = None) -> float:
        """``since``: the sheddable backlog's start (``Backlog.since``), for ``rate(SHEDDABLE)``."""
        return self.sheddable.rate(since) if priority_class == SHEDDABLE else self._all.rate(time.monotonic())


class WaitCorrection:
    """How the waits that queued tickets really had compare with their predictions: the pace of the queue
    is measured before the ticket arrives, critical work that arrives after it still goes first, and a
    large reservation that must fit whole waits for a gap that small critical ones keep filling. Per class
    and way of predicting (from the queue's pace, with blocks ahead; from the replicas' drain, without),
    over the tickets admitted from the queue: the running median of log(actual / predicted) multiplies
    later predictions (the median), and the 0.9 quantile of log(actual / that median) gives the p90 (see
    the module docstring).

    A median, not a mean: with several sheddable tenants, VTC admits the ticket of a tenant behind on
    service at once while the others wait their turn, so a few tickets wait a hundredth of their
    prediction; a weighted mean of the logs followed them (each moved it by up to 30^0.1) and, in
    bench/slo.py's S1 (six batch tenants), held the batch lane's predicted waits at a fifteenth of the
    actual ones (median predicted / actual TTFT 0.15). Replayed through the same logs, the median's queue
    part errs 51 % where the mean's erred 87 % (S1), and 24-37 % where it erred 29-44 % on five runs with one
    batch tenant."""

    def __init__(self) -> None:
        self._ratio: dict[tuple[str, bool], Quantile] = {}  # (class, way) -> median of log(actual / predicted)
        self._spread: dict[tuple[str, bool, bool], Quantile] = {}  # (class, way, decisive) -> its 0.9 quantile
        self._soon: dict[tuple[str, bool, bool], Quantile] = {}  # the same keys -> its 0.1 quantile

    def correct(self, key: tuple[str, bool], predicted: float) -> float:
        ratio = self._ratio.get(key)
        return predicted * math.exp(ratio.value) if ratio is not None else predicted

    def predict(self, key: tuple[str, bool], predicted: float, objective_s: float | None = None) -> Prediction:
        """The wait of a ticket predicted to wait ``predicted`` before the correction, with a TTFT objective
        of ``objective_s`` (None: none): its p90 from the decisive tickets' spread when its own median is
        decisive, else from the others'."""
        median = self.correct(key, predicted)
        spread = self._spread.get(self._spread_key(key, median, objective_s))
        learned = spread is not None and spread.seen >= MIN_MARGIN_SEEN
        return Prediction(median, median * (math.exp(max(0.0, spread.value)) if learned else PRIOR_P90_RATIO))

    def soonest(self, key: tuple[str, bool], predicted: float, objective_s: float | None = None) -> float:
        """``predict``'s other side: the wait nine in ten such tickets had at least (the 0.1 quantile of actual
        over the median, from the same tickets as its p90)."""
        median = self.correct(key, predicted)
        soon = self._soon.get(self._spread_key(key, median, objective_s))
        learned = soon is not None and soon.seen >= MIN_MARGIN_SEEN
        return median * (math.exp(min(0.0, soon.value)) if learned else PRIOR_P10_RATIO)

    @staticmethod
    def _spread_key(key: tuple[str, bool], median: float, objective_s: float | None) -> tuple[str, bool, bool]:
        return (*key, objective_s is not None and median >= DECISIVE_SHARE * objective_s)

    def observe(self, key: tuple[str, bool] | None, predicted: float | None, actual: float,
                median: float | None = None, decisive: bool = False) -> None:
        """A ticket predicted to wait ``predicted`` before the correction, ``median`` after it (as judged,
        None: as the correction says now), was admitted after ``actual``; ``decisive``: its predicted wait
        was a share of its objective that a refusal is decided on (see the module docstring): it teaches
        that spread, the others theirs. The spread is of the error the judgement made: against the median
        the ticket was judged by, not the one the correction has moved to since (a correction that lags a
        pace falling under the queue would otherwise hide the very error the margin is for)."""
        if key is None or predicted is None or predicted < MIN_LEARNED_WAIT_S or actual <= 0:
            return  # predicted to be admitted at once: says nothing about the queue's pace
        if median is None or median <= 0:
            median = self.correct(key, predicted)
        error = log_ratio(actual, median, MAX_LOG_RATIO)
        self._spread.setdefault((*key, decisive), Quantile(P90)).observe(error)
        self._soon.setdefault((*key, decisive), Quantile(P10)).observe(error)
        self._ratio.setdefault(key, Quantile(0.5)).observe(log_ratio(actual, predicted, MAX_LOG_RATIO))


def decisive(ticket: Judged) -> bool:
    """Whether the ticket's predicted wait (its median as judged, as ``WaitCorrection.predict`` keys its
    spread: not capped by ``if_served``) was at least ``DECISIVE_SHARE`` of its TTFT objective."""
    objective = ticket.objective
    return (objective is not None and objective.ttft_s is not None and ticket.corrected_wait is not None
            and ticket.corrected_wait >= DECISIVE_SHARE * objective.ttft_s)


def queue_wait(pool: ReplicaPool, departures: Departures, ticket: Judged, ahead: Backlog) -> float | None:
    """The ticket's queue wait as the pace or the drain predicts it, before the correction (None: nothing
    measured to predict it from), with ``ahead`` queued to be admitted before it; sets its ``wait_key``."""
    sheddable = ticket.priority_class == SHEDDABLE
    rate = departures.rate(ticket.priority_class, ahead.since) if ahead.blocks else 0.0
    ticket.wait_key = (ticket.priority_class, rate > 0)
    if rate > 0:  # a sheddable ticket at the head still waits for its own blocks to be free
        return (ahead.blocks + (ticket.blocks if sheddable else 0)) / rate
    # What others borrowed is reclaimed by a ticket that does not borrow itself (guard/pool/gate.py).
    held = pool.committed() - (0 if sheddable else pool.borrowed())
    short = max(0, held + ahead.blocks + ticket.blocks - pool.budget())
    wait = pool.expected_wait(short)
    if sheddable and short and (pace := departures.rate(SHEDDABLE)) > 0:
        # The replicas' drain feeds critical work first: a sheddable ticket that must wait for room waits at
        # least for its own blocks at the pace sheddable work is admitted. One that fits now is admitted at
        # once: that pace, measured only while sheddable tickets queue, stands still while none does, and
        # a stale one refused every sheddable ticket for as long as none was admitted (a refusal that
        # sustained itself for minutes in bench/slo.py's S1: nothing queued, so nothing updated it).
        wait = max(wait or 0.0, ticket.blocks / pace)
    return wait


def combine(queue: Prediction, engine: Prediction) -> Prediction:
    """A TTFT from its queue part and its engine part: the medians add; the excesses of the p90s over them
    add in quadrature, as two parts that vary apart do (the plain sum, as if the two were always late
    together, would hold back every request the margin of both)."""
    median = queue.median + engine.median
    return Prediction(median, median + math.hypot(queue.p90 - queue.median, engine.p90 - engine.median))


def predicted_ttft(pool: ReplicaPool, departures: Departures, ticket: Judged, ahead: Backlog,
                   correction: WaitCorrection) -> tuple[Prediction, float | None]:
    """(predicted TTFT from the ticket's arrival, the queue wait in it before the correction; None when
    nothing has been measured to predict a wait from), with ``ahead`` queued to be admitted before it, the
    engine part on the best replica. Sets the ticket's ``predicted_wait`` (before the correction),
    ``corrected_wait`` (its median after it), ``predicted_queue`` and ``predicted_engine`` and their p90s."""
    ticket.predicted_wait = wait = queue_wait(pool, departures, ticket, ahead)
    elapsed = time.monotonic() - ticket.arrived
    queue = Prediction(elapsed, elapsed)
    if wait is not None:
        objective = ticket.objective
        corrected = correction.predict(ticket.wait_key, wait, None if objective is None else objective.ttft_s)
        ticket.corrected_wait = corrected.median
        queue = Prediction(elapsed + corrected.median, elapsed + corrected.p90)
    engines = engine_ttfts(pool, ticket)
    engine = Prediction(min((e.median for e in engines), default=0.0), min((e.p90 for e in engines), default=0.0))
    ticket.predicted_queue, ticket.predicted_queue_p90 = queue
    ticket.predicted_engine, ticket.predicted_engine_p90 = engine
    return combine(queue, engine), wait


def engine_ttfts(pool: ReplicaPool, ticket: Judged) -> list[Prediction]:
    """The engine's part of the ticket's TTFT on each usable replica, at the engine priority its class runs at."""
    priority = engine_priority(ticket.lane.priority, ticket.priority_class == SHEDDABLE)
    return [r.latency.predict_ttft(priority, ticket.prompt_tokens, r.in_flight) for r in pool.replicas if r.usable()]


def best_tpot(pool: ReplicaPool) -> Prediction | None:
    """The lowest TPOT a stream sent now would see on a usable replica (None: no replica's is known, or
    one that is usable has not stepped yet, so nothing says it would be slow)."""
    predictions = [r.latency.predict_tpot(r.in_flight) for r in pool.replicas if r.usable()]
    tpot = Prediction(min((p.median for p in predictions), default=0.0), min((p.p90 for p in predictions), default=0.0))
    return tpot if tpot.median > 0 else None


def judge(pool: ReplicaPool, departures: Departures, correction: WaitCorrection, ticket: Judged,
          ahead: Backlog) -> None:
    """Predict the ticket's TTFT and TPOT into it; refuse a sheddable one whose TTFT (median) is past its
    TTFT objective, or whose p90 TPOT is past its TPOT objective on every replica. ``ahead``: what is queued
    to be admitted before it, by its class (see the module docstring). The only time a ticket is judged:
    once queued, it is served or leaves at its limit (``queue_limit``): what it is told and recorded it is
    predicted, once it passes, is its TTFT if served (``if_served``)."""
    objective = ticket.objective
    assert objective is not None
    ttft, wait = predicted_ttft(pool, departures, ticket, ahead, correction)
    ticket.predicted_ttft, ticket.predicted_ttft_p90 = ttft
    tpot = best_tpot(pool)
    ticket.predicted_tpot, ticket.predicted_tpot_p90 = tpot if tpot is not None else (None, None)
    if objective.priority_class == SHEDDABLE:
        refuse_unattainable(correction, ticket, ttft, wait, tpot)
    if_served(ticket)


def refuse_unattainable(correction: WaitCorrection, ticket: Judged, ttft: Prediction, wait: float | None,
                        tpot: Prediction | None) -> None:
    """``judge``'s refusal of a sheddable ticket, on its prediction as the wait model gives it."""
    objective = ticket.objective
    assert objective is not None
    # Refused only where nine in ten such waits would make it late: a ticket queued on a hopeful prediction
    # leaves once it can no longer be on time (``queue_limit``) having cost only its wait, where one refused
    # on a fearful one is work lost, and the engine's room for it unused.
    if objective.ttft_s is not None and wait is not None and ttft.median > objective.ttft_s:
        assert ticket.wait_key is not None and ticket.corrected_wait is not None  # set with the wait
        soonest = ttft.median - ticket.corrected_wait + correction.soonest(ticket.wait_key, wait, objective.ttft_s)
        if soonest > objective.ttft_s:
            raise unattainable(f"predicted time to first token {ttft.median:.2f} s (median; {soonest:.2f} s at "
                               "the soonest of nine in ten such waits)", f"{objective.ttft_s:g} s", wait)
    if objective.tpot_s is not None and tpot is not None and tpot.p90 > objective.tpot_s:
        raise unattainable(f"predicted time per output token {1e3 * tpot.p90:.0f} ms (p90) on every replica",
                           f"{1e3 * objective.tpot_s:g} ms", 1.0)


def if_served(ticket: Judged) -> None:
    """Cap the ticket's predicted queue part, and so its TTFT, where it would leave the queue unserved: its
    queue limit (``queue_limit``) from now. A ticket is served within it or not at all, so a served one's
    TTFT is no later; the wait model's figures are of the waits it would have without a limit. Where it
    matters: in bench/slo.py's S2 (L = 2), 180 of 414 served batch requests were predicted to wait past it
    (medians 11-15 s against a 10 s objective) and had waited 8-10 s; capped, the batch lane's median
    |error| 0.31 -> 0.17 over the same decision log. Judging (the refusal, the spreads learned) reads the
    uncapped figures: the cap says when it would be served, not whether."""
    if ticket.predicted_queue is None or ticket.predicted_queue_p90 is None:
        return
    now = time.monotonic()
    bound = now - ticket.arrived + queue_limit(ticket, ticket.arrived, now)
    queue = Prediction(min(ticket.predicted_queue, bound), min(ticket.predicted_queue_p90, bound))
    engine = Prediction(ticket.predicted_engine or 0.0, ticket.predicted_engine_p90 or 0.0)
    ticket.predicted_queue, ticket.predicted_queue_p90 = queue
    ticket.predicted_ttft, ticket.predicted_ttft_p90 = combine(queue, engine)


def queue_limit(ticket: Judged, arrived: float, now: float) -> float:
    """How long the ticket may wait in the queue from ``now``: its lane's timeout, or for a sheddable ticket
    with a TTFT objective what is left of that objective since it ``arrived`` less the engine's predicted
    part (its median, as judged), if sooner (once it passes, the ticket would more likely than not be
    served late, on room that work still on time needs)."""
    timeout, objective = ticket.lane.timeout, ticket.objective
    if objective is None or objective.priority_class != SHEDDABLE or objective.ttft_s is None:
        return timeout
    return min(timeout, max(0.0, objective.ttft_s - (now - arrived) - (ticket.predicted_engine or 0.0)))


def too_late(pool: ReplicaPool, ticket: Judged, now: float) -> bool:
    """Whether a queued sheddable ticket, its turn come, would more likely than not be late on every usable
    replica (their median TTFT past what is left of its objective): the ``slo`` filter's test for the
    sheddable class, failing closed. Its deadline (``queue_limit``) took the engine's part as judged at
    arrival, on the replica best then; the replica it would go to now may be slower (a heterogeneous pool)
    or busier."""
    objective = ticket.objective
    if objective is None or objective.priority_class != SHEDDABLE or objective.ttft_s is None:
        return False
    left = objective.ttft_s - (now - ticket.arrived)
    engines = engine_ttfts(pool, ticket)
    return bool(engines) and all(engine.median > left for engine in engines)


def late(ticket: Judged, now: float) -> bool:
    """Whether a queued critical or standard ticket can no longer be on time: its wait so far and the
    engine's part (its p90, as judged) past its TTFT objective. It then yields to those of its class that
    still can (see the module docstring); a sheddable one leaves the queue instead (``queue_limit``)."""
    objective = ticket.objective
    if objective is None or objective.ttft_s is None or objective.priority_class == SHEDDABLE:
        return False
    engine = ticket.predicted_engine_p90 or ticket.predicted_engine or 0.0
    return now - ticket.arrived + engine > objective.ttft_s


def queue_bound(ticket: Judged, limit: float) -> str:
    """What ``limit`` (``queue_limit``'s) stood for, as a ticket that waited it out is told."""
    if limit < ticket.lane.timeout and ticket.objective is not None and ticket.objective.ttft_s is not None:
        return f"its {ticket.objective.ttft_s:g} s time-to-first-token objective (sheddable: never served late)"
    return f"this lane's {ticket.lane.timeout:g} s queueing timeout"


def placed(ticket: Judged) -> None:
    """The judged ticket is placed (``ticket.sent``: what its replica's latency model predicted for it
    there): its engine part and TPOT are that replica's, its TTFT its queue part plus that engine part."""
    sent = ticket.sent
    if sent is None or ticket.predicted_queue is None or ticket.predicted_queue_p90 is None:
        return
    ticket.predicted_engine, ticket.predicted_engine_p90 = sent.ttft
    ticket.predicted_ttft, ticket.predicted_ttft_p90 = combine(
        Prediction(ticket.predicted_queue, ticket.predicted_queue_p90), sent.ttft)
    if sent.tpot.median > 0:
        ticket.predicted_tpot, ticket.predicted_tpot_p90 = sent.tpot


def unattainable(predicted: str, objective: str, wait: float) -> GuardError:
    return GuardError(503, f"{predicted} exceeds this request's objective ({objective}); the lane is sheddable",
                      code="slo_unattainable", retry_after=max(1, min(60, math.ceil(wait))),
                      outcome=Outcome.REJECTED_OVERLOAD)
