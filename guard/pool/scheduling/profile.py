"""A scheduling profile: filters, weighted scorers and a picker (guard/pool/scheduling/__init__.py)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from guard.pool.scheduling.plugin import Candidate, Context, Filter, Picker, Request, Scorer, free_share

if TYPE_CHECKING:
    from guard.pool.replica import Replica


class Profile:
    """Ranks the usable replicas for one request. Only usable replicas are ranked (circuit closed, current
    telemetry); they enter in an order rotated by one per request, so that a picker's ties, and round-robin,
    take turns."""

    def __init__(self, filters: Sequence[Filter], scorers: Sequence[tuple[Scorer, float]], picker: Picker) -> None:
        self.filters = tuple(filters)
        self.scorers = tuple(scorers)
        self.picker = picker
        # Whether a scorer reads prefix hits (the guard then hashes each prompt's blocks).
        self.needs_hashes = any(scorer.reads_prefix for scorer, _ in self.scorers)
        self._turn = 0

    def rank(self, replicas: Sequence[Replica], request: Request) -> list[Candidate]:
        """The usable replicas in the order to try for ``request``."""
        usable = [r for r in replicas if r.usable()]
        hashes = request.hashes
        if len(usable) < 2:  # nothing to choose between (and a pool of one follows no KV events)
            return [Candidate(r, sum(map(r.index.leading_cached, hashes)) if self.needs_hashes else 0)
                    for r in usable]
        self._turn = (self._turn + 1) % len(usable)
        usable = usable[self._turn:] + usable[:self._turn]
        read = self.needs_hashes and hashes
        hits = {r: sum(map(r.index.leading_cached, hashes)) if read else 0 for r in usable}
        candidates = [Candidate(r, hits[r]) for r in usable]
        loads = [r.in_flight for r in usable]
        ctx = Context(request, usable, hits, sum(len(h) for h in hashes), max(loads) or 1, min(loads),
                      {r: free_share(r, request.blocks) for r in usable})
        self._filter(candidates, ctx)
        for candidate in candidates:
            scores = candidate.scores
            for scorer, weight in self.scorers:
                value = scores[scorer.name] = scorer.score(candidate.replica, ctx)
                candidate.total += weight * value
        return self.picker.order(candidates, ctx)

    def _filter(self, candidates: list[Candidate], ctx: Context) -> None:
        passed = False
        for candidate in candidates:
            for check in self.filters:
                if check.holds_back(candidate.replica, ctx):
                    candidate.filtered_by = check.name
                    break
            else:
                passed = True
        if not passed:  # every replica held back: fail open
            for candidate in candidates:
                candidate.filtered_by = None
