"""The guard's feed of notable events (mode transitions, detections, reloads, replicas going up or down),
kept for the operator console in a bounded ring buffer.

``record(kind, **fields)`` is the whole API the rest of the guard uses: a one-line call where a transition
happens. Fields must be JSON values and must never carry a secret (an API key, the salt secret, a config
file's text): the feed is shown on the console as is.

Invariants: at most ``EVENTS_KEPT`` events are held (a guard that runs for months holds no history of
them); ``seq`` numbers increase by one per event for the life of the log, so a reader that remembers the
last ``seq`` it saw asks for exactly what is new, even after older events have left the buffer.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

EVENTS_KEPT = 256

Event = dict[str, Any]  # {"seq", "time" (Unix seconds), "kind", **fields}


class EventLog:
    def __init__(self, capacity: int = EVENTS_KEPT) -> None:
        self.events: deque[Event] = deque(maxlen=capacity)
        self.seq = 0  # of the newest event; 0 before any
        self._states: dict[tuple[str, str], str] = {}  # (kind, subject) -> last state tracked

    def record(self, kind: str, **fields: Any) -> Event:
        self.seq += 1
        # Wall-clock time: the console shows it next to other clocks (logs, dashboards), not to measure.
        event = {"seq": self.seq, "time": round(time.time(), 3), "kind": kind, **fields}
        self.events.append(event)
        return event

    def track(self, kind: str, subject: str, state: str, initial: str) -> None:
        """Record ``kind`` for ``subject`` when ``state`` differs from the last one tracked for it
        (``initial`` before any): for states that are polled rather than changed in one place."""
        last = self._states.get((kind, subject), initial)
        self._states[(kind, subject)] = state
        if state != last:
            self.record(kind, subject=subject, state=state, was=last)

    def since(self, seq: int, limit: int = EVENTS_KEPT) -> list[Event]:
        """The events newer than ``seq``, oldest first, at most the newest ``limit`` of them."""
        newer = [event for event in self.events if event["seq"] > seq]
        return newer[-limit:]
