"""What the other guards were seen holding on each engine, kept for the moment Redis goes away.

Every answer of the shared ledger with room in it, and every lease renewal, says what each other guard holds
on an engine. While the link is up nothing reads it: the ledger decides. When the link goes down, each guard
keeps to its share less what the others hold beyond theirs (guard/pool/gate.py ``mine``), and what they hold
*at that moment* is unknown: what they were granted since the last sighting is unseen. Taking the last
sighting alone under-counts a guard whose holdings were dipping and refilling as its requests ended and new
ones came (a guard at its plateau, between two grants); ``peak`` is each guard's largest sighting over the last
``PERIODS`` renewal periods (about a second at 0.2 s each) instead. That over-counts a guard that drained
during that second, which only makes the outage's share smaller; what a guard was granted beyond anything it
held in the last second, in the last period before the outage, stays unseen (the one over-commit left).

Invariant: ``peak(engine)[g]`` >= every sighting of guard ``g`` on ``engine`` in the newest ``PERIODS``
periods. ``saw`` is called for every admission answer: it does no allocation once the period has seen the
engine, and no clock reads (a period is a renewal).
"""

from __future__ import annotations

from collections import deque

PERIODS = 5  # renewal periods a sighting counts for (guard/state/shared.py RENEW_S each)

Held = dict[str, int]  # {guard id: blocks}


class Sightings:
    def __init__(self) -> None:
        # Per renewal period, newest last: {engine: {guard: the largest blocks seen}}.
        self.periods: deque[dict[str, Held]] = deque([{}], maxlen=PERIODS)

    def saw(self, engine: str, held: Held) -> None:
        """What the other guards hold on ``engine``, as an answer of the ledger just said."""
        newest = self.periods[-1].setdefault(engine, {})
        for guard, blocks in held.items():
            if blocks > newest.get(guard, 0):
                newest[guard] = blocks

    def renewed(self, held: dict[str, Held]) -> None:
        """A lease renewal's report, {engine: {guard: blocks}}: it opens a new period."""
        self.periods.append({})
        for engine, on_engine in held.items():
            self.saw(engine, on_engine)

    def peak(self, engine: str) -> Held:
        """Each other guard's largest sighting on ``engine`` in the periods kept."""
        merged: Held = {}
        for period in self.periods:
            for guard, blocks in period.get(engine, {}).items():
                if blocks > merged.get(guard, 0):
                    merged[guard] = blocks
        return merged
