"""Fill-and-Squeeze detection: per-tenant signals over sliding windows, a suspicion score, and states with
hysteresis that drive escalation.

The attack (reference 001): probe inter-token latency with tiny requests, *fill* the free blocks with long
generations when the probes say there is room, then *squeeze* with a stream of micro-requests at the memory
edge so the scheduler thrashes. Behind the guard the edge an attacker can reach is its own: a tenant's block
cap keeps the pool away from the engine's edge, so its requests queue at the cap, and that queueing is what
its probes read as "full". Each phase leaves a trace the guard can see:

- ``probe``: tiny requests (``max_tokens <= probe_max_tokens``) at a high, regular rate;
- ``share``: the tenant holds more than its weighted share of reserved blocks while others wait, or while
  its own requests wait for more (1 at twice its share);
- ``switch``: long generations held, then a burst of short requests at the edge: the pool's (little of it
  uncommitted), or the tenant's own (its requests wait in the guard's queue);
- ``victims``: other tenants get preempted while this tenant holds a large part of the pool;
- ``coordination``: its probing or its fill began in the same seconds as another tenant's, which is still
  at it too: one attacker behind several keys (guard/detect/coordination.py). Every key involved gets it.

``suspicion = min(1, 0.3 probe + 0.3 share + 0.3 switch + 0.2 victims + 0.2 coordination)``: no single
signal reaches ``suspect`` (0.5) on its own, so a bursty chat, a long-document tenant or a chatty agent
stay ``normal``; the combination of phases does. States move up when the score crosses a threshold and down
only after it stays low for a while::

    normal --(>= 0.5)--> suspect --(>= 0.75)--> confirmed
       ^   (< 0.3 for 10 s)  |  ^  (< 0.4 for 30 s, the pattern stopped)  |
       +---------------------+  +-----------------------------------------+

A confirmed tenant is refused, so it soon holds nothing and its score falls to what its probes alone give;
it stays confirmed while it keeps up the pattern (probes or short requests at 0.5/s, or long ones, within
the window) and is forgiven only once it has stopped for the clear time.

Escalation by state: ``suspect`` clamps ``max_tokens``, caps the tenant's reserved blocks and lowers its
priority; ``confirmed`` rejects with 429 ``abuse_suspected``.
"""

from __future__ import annotations

import itertools
import logging
import statistics
import time
from collections import deque
from dataclasses import dataclass, field

from engine.protocol import TelemetrySnapshot
from guard.detect.coordination import Onsets, coordination

log = logging.getLogger("guard.detect.detector")

WINDOW_S = 10.0
PROBE_MAX_TOKENS = 4
SHORT_MAX_TOKENS = 16
LONG_MAX_TOKENS = 256
RATE_SATURATES_AT = 2.0 * WINDOW_S  # probe and short-request rates count fully from 2 per second
ARRIVAL_HISTORY = 64  # arrival times kept per kind: more than RATE_SATURATES_AT, enough gaps for regularity
EDGE_FREE_SHARE = 0.2  # "near the edge": less of the pool uncommitted than this share
STATES = ("normal", "suspect", "confirmed")
SUSPECT_AT, CONFIRM_AT = 0.5, 0.75
CLEAR_SUSPECT_BELOW, CLEAR_SUSPECT_AFTER_S = 0.3, 10.0
CLEAR_CONFIRMED_BELOW, CLEAR_CONFIRMED_AFTER_S = 0.4, 30.0
PATTERN_MIN_REQUESTS = 5  # probes or short requests in the window that keep a confirmed tenant confirmed
TRANSITIONS_KEPT = 256  # the newest state changes with their evidence, for reports and tests; older ones go


@dataclass(slots=True)
class TenantSignals:
    # Arrival times by kind, newest last. Each signal saturates at RATE_SATURATES_AT arrivals per window, so
    # older ones can never change a score: keeping a bounded tail keeps a busy tenant's memory (and what the
    # collector walks) constant instead of one entry per request.
    probes: deque[float] = field(default_factory=lambda: deque(maxlen=ARRIVAL_HISTORY))
    shorts: deque[float] = field(default_factory=lambda: deque(maxlen=ARRIVAL_HISTORY))
    last_long: float | None = None
    # None until the first snapshot: an engine that ran before the guard came up (or before a restart of the
    # guard) reports its whole history, and none of it is news to attribute to anyone.
    last_preemptions: int | None = None
    victim_events: deque[tuple[float, int]] = field(default_factory=deque)  # (time, others' new preemptions)
    state: str = "normal"
    score: float = 0.0
    low_since: float | None = None  # when the score last dropped below the current state's clear level
    onsets: Onsets = field(default_factory=Onsets)  # when its probing and its fill began, for coordination
    adopted: bool = False  # confirmed on another guard's verdict (guard/state/verdicts.py), not this one's
    evidence: dict[str, float] = field(default_factory=dict)


class Detector:
    def __init__(self, weights: dict[str, float]) -> None:
        self.weights = weights  # tenant -> weight, for fair shares
        self.tenants = {name: TenantSignals() for name in weights}
        # (time, tenant, from, to, evidence), bounded: a guard that runs for months keeps no history of them.
        self.transitions: deque[tuple[float, str, str, str, dict[str, float]]] = deque(maxlen=TRANSITIONS_KEPT)

    def reconfigure(self, weights: dict[str, float]) -> None:
        """Take a reloaded set of tenants: a kept one keeps its signals and state (a reload launders no
        verdict), a new one starts normal, a removed one is forgotten, and the few requests it still has
        on their way to admission are not scored."""
        self.weights = weights
        self.tenants = {name: self.tenants[name] if name in self.tenants else TenantSignals() for name in weights}

    def state(self, tenant: str) -> str:
        signals = self.tenants.get(tenant)
        return signals.state if signals is not None else "normal"

    def on_request(self, tenant: str, max_tokens: int, now: float | None = None) -> None:
        if SHORT_MAX_TOKENS < max_tokens < LONG_MAX_TOKENS:
            return  # an ordinary request: no signal looks at it
        signals = self.tenants.get(tenant)
        if signals is None:  # its tenant removed by a reload since it was authenticated
            return
        now = now if now is not None else time.monotonic()
        if max_tokens >= LONG_MAX_TOKENS:
            signals.last_long = now
            signals.onsets.saw("fill", now, WINDOW_S)
            return
        signals.shorts.append(now)
        if max_tokens <= PROBE_MAX_TOKENS:
            signals.probes.append(now)
            signals.onsets.saw("probe", now, WINDOW_S)

    def on_telemetry(self, snapshot: TelemetrySnapshot, now: float | None = None) -> None:
        """Attribute new preemptions of each tenant to everyone else holding blocks at the time."""
        now = now if now is not None else time.monotonic()
        new = {}
        for name, signals in self.tenants.items():
            usage = snapshot.tenants.get(name)
            total = usage.preemptions_total if usage else 0
            new[name] = 0 if signals.last_preemptions is None else max(0, total - signals.last_preemptions)
            signals.last_preemptions = total
        for name, signals in self.tenants.items():
            others = sum(count for other, count in new.items() if other != name)
            if others:
                signals.victim_events.append((now, others))

    def evaluate(self, reserved: dict[str, int], budget: int, waiting: set[str], free_share: float,
                 now: float | None = None) -> list[tuple[str, str, str]]:
        """Recompute every tenant's score and state; returns the transitions ``(tenant, from, to)``."""
        now = now if now is not None else time.monotonic()
        total_weight = sum(self.weights.values())
        links = coordination({name: signals.onsets for name, signals in self.tenants.items()}, now, WINDOW_S)
        changes = []
        for name, signals in self.tenants.items():
            for events in (signals.probes, signals.shorts):
                while events and now - events[0] > WINDOW_S:
                    events.popleft()
            if signals.last_long is not None and now - signals.last_long > WINDOW_S:
                signals.last_long = None
            while signals.victim_events and now - signals.victim_events[0][0] > WINDOW_S:
                signals.victim_events.popleft()
            fair = self.weights[name] / total_weight * budget if budget else 0.0
            held = reserved.get(name, 0)
            others_wait = bool(waiting - {name})
            pressing = name in waiting  # at its own edge: its cap (or a full pool) holds its requests back
            at_edge = free_share <= EDGE_FREE_SHARE or pressing
            evidence = {
                "probe": _probe_signal(signals.probes),
                "share": min(1.0, max(0.0, held / fair - 1.0)) if fair and (others_wait or pressing) else 0.0,
                "switch": _switch_signal(signals, held, budget, at_edge),
                "victims": min(1.0, sum(c for _, c in signals.victim_events) / 5.0) if held > 0.3 * budget else 0.0,
                "coordination": links.get(name, 0.0),
            }
            score = min(1.0, 0.3 * evidence["probe"] + 0.3 * evidence["share"] + 0.3 * evidence["switch"]
                        + 0.2 * evidence["victims"] + 0.2 * evidence["coordination"])
            signals.score, signals.evidence = score, evidence
            persisting = (len(signals.shorts) >= PATTERN_MIN_REQUESTS or signals.last_long is not None)
            new_state = self._next_state(signals, score, now, persisting)
            if new_state != signals.state:
                changes.append((name, signals.state, new_state))
                self.transitions.append((now, name, signals.state, new_state, evidence))
                log.warning("tenant %s: %s -> %s (suspicion %.2f; evidence %s)", name, signals.state, new_state,
                            score, {k: round(v, 2) for k, v in evidence.items()})
                signals.state, signals.low_since, signals.adopted = new_state, None, False
        return changes

    def adopt(self, tenant: str, now: float | None = None) -> bool:
        """Another guard confirmed ``tenant`` (guard/state/): it is confirmed here too, and comes down as if
        confirmed here. False if it already was, or is no tenant of this guard."""
        signals = self.tenants.get(tenant)
        if signals is None or signals.state == "confirmed":
            return False
        now = now if now is not None else time.monotonic()
        evidence = {"another_guard": 1.0}
        self.transitions.append((now, tenant, signals.state, "confirmed", evidence))
        log.warning("tenant %s: %s -> confirmed (confirmed by another guard)", tenant, signals.state)
        signals.state, signals.low_since, signals.evidence, signals.adopted = "confirmed", None, evidence, True
        return True

    @staticmethod
    def _next_state(signals: TenantSignals, score: float, now: float, persisting: bool) -> str:
        """``persisting``: the tenant keeps sending what makes up the pattern (short or long requests)."""
        state = signals.state
        if score >= CONFIRM_AT and state != "confirmed":
            return "confirmed" if state == "suspect" else "suspect"
        if score >= SUSPECT_AT and state == "normal":
            return "suspect"
        clear_below, clear_after = ((CLEAR_CONFIRMED_BELOW, CLEAR_CONFIRMED_AFTER_S) if state == "confirmed"
                                    else (CLEAR_SUSPECT_BELOW, CLEAR_SUSPECT_AFTER_S))
        if state == "normal" or score >= clear_below or (state == "confirmed" and persisting):
            signals.low_since = None
            return state
        if signals.low_since is None:
            signals.low_since = now
        if now - signals.low_since >= clear_after:
            return STATES[STATES.index(state) - 1]
        return state


def _probe_signal(probes: deque[float]) -> float:
    """High for tiny requests arriving often and regularly (a latency probe), 0 below one per 2 s."""
    if len(probes) < 5:
        return 0.0
    rate = min(1.0, len(probes) / RATE_SATURATES_AT)
    gaps = [b - a for a, b in itertools.pairwise(probes)]
    mean = statistics.fmean(gaps)
    regular = 1.0 if mean <= 0 else max(0.0, 1.0 - statistics.pstdev(gaps) / mean)  # 1 - coefficient of variation
    return rate * (0.5 + 0.5 * regular)


def _switch_signal(signals: TenantSignals, held: int, budget: int, at_edge: bool) -> float:
    """Long generations held, then short requests at a rate, at the edge (the pool's or the tenant's own)."""
    if not budget or held < 0.3 * budget or not at_edge:
        return 0.0
    shorts, last_long = signals.shorts, signals.last_long
    if last_long is None or len(shorts) < 5 or shorts[-1] < last_long:
        return 0.0
    return min(1.0, len(shorts) / RATE_SATURATES_AT)
