"""The Fill-and-Squeeze detector driven on a synthetic clock: ``run`` plays a script of events and evaluates
it every 0.5 s; ``squeeze`` is the attack's squeeze phase as such a script."""

from __future__ import annotations

from guard.detect.detector import Detector

BUDGET = 100


def run(detector: Detector, seconds: float, step: float, act, reserved, waiting, free_share, start: float = 0.0
        ) -> tuple[float, list]:
    """Advance a synthetic clock, letting ``act(now)`` emit events, evaluating every 0.5 s."""
    changes, now, next_eval = [], start, start
    while now < start + seconds:
        act(now)
        if now >= next_eval:
            changes += detector.evaluate(reserved(now), BUDGET, waiting, free_share(now), now=now)
            next_eval += 0.5
        now += step
    return now, changes


def squeeze(detector: Detector, tenant: str) -> callable:
    """Every 0.05 s a micro-request; a probe every 0.25 s; a long generation every 2 s."""
    def act(now: float) -> None:
        tick = round(now / 0.05)
        detector.on_request(tenant, 8, now)
        if tick % 5 == 0:
            detector.on_request(tenant, 2, now)
        if tick % 40 == 0:
            detector.on_request(tenant, 600, now)
    return act
