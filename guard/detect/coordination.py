"""Coordination across keys: the same Fill-and-Squeeze split over several API keys.

An attacker with two keys halves each key's probe rate, jitters the probes so that neither stream looks
regular, and lets each key hold half of the fill. What it cannot hide is that the keys act on one clock:
their probing starts when the attack starts, and their fills start when the probes say "room", the same
second for every key. So each tenant's *onsets* are kept (when it began probing, when it began filling,
each after a quiet window), and two tenants are *linked* by every kind of onset they share within
``SYNC_S`` of each other while both are still at it. A tenant's coordination evidence is its strongest
link (0.5 per shared onset kind): it raises the suspicion of every tenant involved, and it is evidence
only next to the others (its weight in the score is below ``suspect`` on its own), since two honest tenants
may start a job in the same second.

Cost: only tenants with an onset in the current window are compared, pairwise; with no attack, none is.
"""

from __future__ import annotations

from dataclasses import dataclass, field

SYNC_S = 2.0  # onsets closer than this count as one
KINDS = ("probe", "fill")


@dataclass(slots=True)
class Onsets:
    """When a tenant last began each activity after ``quiet_s`` without it, and when it last did it."""

    started: dict[str, float] = field(default_factory=dict)  # kind -> when the current run of it began
    last: dict[str, float] = field(default_factory=dict)  # kind -> when it was last seen

    def saw(self, kind: str, now: float, quiet_s: float) -> None:
        last = self.last.get(kind)
        if last is None or now - last > quiet_s:
            self.started[kind] = now
        self.last[kind] = now

    def active(self, kind: str, now: float, window_s: float) -> float | None:
        """The onset of ``kind`` if the tenant is still at it (within ``window_s``), else None."""
        last = self.last.get(kind)
        return self.started[kind] if last is not None and now - last <= window_s else None


def coordination(onsets: dict[str, Onsets], now: float, window_s: float) -> dict[str, float]:
    """Each tenant's strongest link to another (0, 0.5 or 1); tenants with no link are left out."""
    active = {name: {kind: at for kind in KINDS if (at := o.active(kind, now, window_s)) is not None}
              for name, o in onsets.items()}
    active = {name: kinds for name, kinds in active.items() if kinds}
    evidence: dict[str, float] = {}
    names = sorted(active)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            shared = sum(1 for kind in KINDS if kind in active[a] and kind in active[b]
                         and abs(active[a][kind] - active[b][kind]) <= SYNC_S)
            link = shared / len(KINDS)
            for name in (a, b):
                if link > evidence.get(name, 0.0):
                    evidence[name] = link
    return evidence
