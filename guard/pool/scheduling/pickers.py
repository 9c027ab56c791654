"""Pickers: the order in which the dispatcher tries the candidates' gates (guard/pool/scheduling/plugin.py).
Held-back candidates always come after the others."""

from __future__ import annotations

import random

from guard.pool.scheduling.plugin import Candidate, Context, register_picker


@register_picker("max_score")
class MaxScore:
    """Highest total first. Equal totals (an idle pool, a prompt cached nowhere) go to the replica admitted
    to longest ago, so that new conversations spread; then the rotating order decides (the sort is stable)."""

    def order(self, candidates: list[Candidate], ctx: Context) -> list[Candidate]:
        return sorted(candidates, key=lambda c: (c.filtered_by is not None, -c.total, c.replica.last_admitted))


@register_picker("lexicographic")
class Lexicographic:
    """Highest value of the first scorer first, the next scorer's breaking its ties, and so on (weights play
    no part); exact ties keep the rotating order. The ``least_loaded`` and ``prefix`` presets: a strict order
    of signals, which no choice of weights can state exactly."""

    def order(self, candidates: list[Candidate], ctx: Context) -> list[Candidate]:
        return sorted(candidates, key=lambda c: (c.filtered_by is not None, *[-v for v in c.scores.values()]))


@register_picker("round_robin")
class RoundRobin:
    """The replicas in turn (the candidates come in a rotating order), scores aside."""

    def order(self, candidates: list[Candidate], ctx: Context) -> list[Candidate]:
        return sorted(candidates, key=lambda c: c.filtered_by is not None)


@register_picker("random_weighted")
class RandomWeighted:
    """A random order, each next replica drawn with a probability proportional to its total (uniform where
    every total is 0): load spread by score rather than sent to the best alone."""

    def __init__(self, rng: random.Random | None = None) -> None:
        self.rng = rng or random.Random()

    def order(self, candidates: list[Candidate], ctx: Context) -> list[Candidate]:
        kept = [c for c in candidates if c.filtered_by is None]
        held = [c for c in candidates if c.filtered_by is not None]
        ordered = []
        while kept:
            weights = [max(c.total, 0.0) for c in kept]
            chosen = self.rng.choices(range(len(kept)), weights=weights if sum(weights) > 0 else None)[0]
            ordered.append(kept.pop(chosen))
        return ordered + held
