"""Fill-and-Squeeze verdicts shared by the guards: a tenant confirmed as an attacker on one is refused on all.

Every ``PERIOD_S`` each guard sends the tenants it confirmed itself, which extends their verdicts by
``VERDICT_TTL_S``, and reads back every verdict standing (guard/state/scripts.py ``VERDICTS``); it adopts
those it did not reach itself (guard/detect/escalation.py ``adopt``): refused, queued requests refused,
running ones revoked, as if confirmed here. A verdict stands while a guard that confirmed the tenant still
does, and lapses ``VERDICT_TTL_S`` after the last one forgives it; a guard that only adopted a verdict never
extends it, so guards cannot keep a verdict alive for each other.
"""

from __future__ import annotations

import asyncio

from guard.detect.escalation import Escalation
from guard.state.shared import SharedState

PERIOD_S = 1.0
VERDICT_TTL_S = 5.0


async def share_verdicts(shared: SharedState, escalation: Escalation) -> None:
    """Runs for the guard's lifetime; skips a round while Redis is down (verdicts then stay local)."""
    detector = escalation.detector
    while not shared.stopping:
        await asyncio.sleep(PERIOD_S)
        mine = [name for name, s in detector.tenants.items() if s.state == "confirmed" and not s.adopted]
        standing = await shared.call("VERDICTS", VERDICT_TTL_S, *mine)
        if standing:
            escalation.adopt(name.decode() for name in standing)
