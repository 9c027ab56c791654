"""The replica picker: in which order a request's reservation is tried on the pool's replicas.

The dispatcher tries the replicas in the order ``rank`` gives and reserves on the first whose gate admits
(guard/admission/dispatch.py): a policy only orders, the gates decide what fits, so no policy can overfill
a replica. Only usable replicas are ranked (circuit closed, current telemetry). ``routing.policy``:

- ``round_robin``: the replicas in turn.
- ``least_loaded``: the fewest guard requests in flight, then the most budget left.
- ``prefix``: the most cached leading prompt blocks, then the least loaded, whatever the load: cache
  affinity alone, the baseline that shows the hot spot.
- ``kvguard`` (the default): three normalised signals weighed as llm-d's EPP weighs its scorers::

      score = 2 * hit + free + idle
      hit   = cached leading prompt blocks on the replica / the prompt's full blocks   (prefill saved)
      free  = budget left after this reservation / budget                             (room)
      idle  = 1 - in flight on the replica / the most in flight on any candidate      (queue and decode)

  ``hit`` is exact, not guessed: each replica's prefix index follows the engine's own KV-cache events
  (guard/pool/prefix_index.py). A saturation filter ranks a replica that would be past ``SATURATED`` of its
  budget after this reservation behind every replica that would not, so a nearly full replica never wins on
  locality alone (the "death spiral" of cache affinity); when every replica is past it, all stay in the
  running (fail open). An overload filter does the same for a replica with ``OVERLOAD_ABS`` more requests in
  flight than the least loaded candidate and ``OVERLOAD_REL`` times as many (SGLang's cache-aware router
  balances the same way): cached system prompts would otherwise pull every conversation of the tenants
  that started on one replica there, long before its blocks run short. Ties (an idle pool, a prompt cached
  nowhere) go to the replica admitted to longest ago, so new conversations, and with them new tenants'
  cached system prompts, spread over the pool instead of meeting on one replica by chance.
"""

from __future__ import annotations

from collections.abc import Sequence

from guard.pool.replica import Replica

SATURATED = 0.8  # share of a replica's budget past which its cached blocks no longer attract requests
OVERLOAD_ABS, OVERLOAD_REL = 3, 1.5  # in flight beyond the least loaded's: past both, locality waits
HIT_WEIGHT, FREE_WEIGHT, IDLE_WEIGHT = 2.0, 1.0, 1.0


class Picker:
    def __init__(self, policy: str) -> None:
        self.policy = policy
        self._turn = 0  # rotates the tie order (and is the whole of round_robin)

    @property
    def needs_hashes(self) -> bool:
        """Whether the policy reads prefix hits (the guard then hashes each prompt's blocks)."""
        return self.policy in ("kvguard", "prefix")

    def rank(self, replicas: Sequence[Replica], blocks: int, hashes: Sequence[Sequence[bytes]]
             ) -> list[tuple[Replica, int]]:
        """The usable replicas in the order to try, each with its cached leading blocks of the request's
        prompts (``hashes``: each prompt's full-block hashes, empty when not computed)."""
        candidates = [r for r in replicas if r.usable()]
        if len(candidates) > 1:
            self._turn = (self._turn + 1) % len(candidates)
            candidates = candidates[self._turn:] + candidates[:self._turn]
        hits = {r: sum(r.index.leading_cached(h) for h in hashes) if self.needs_hashes else 0 for r in candidates}
        if self.policy == "round_robin" or len(candidates) < 2:
            order = candidates
        elif self.policy == "least_loaded":
            order = sorted(candidates, key=lambda r: (r.in_flight, -_free(r, blocks)))
        elif self.policy == "prefix":
            order = sorted(candidates, key=lambda r: (-hits[r], r.in_flight, -_free(r, blocks)))
        else:
            prompt_blocks = sum(len(h) for h in hashes)
            busiest = max(r.in_flight for r in candidates) or 1
            least = min(r.in_flight for r in candidates)

            def held_back(r: Replica) -> bool:
                overloaded = r.in_flight >= least + OVERLOAD_ABS and r.in_flight >= OVERLOAD_REL * least
                return overloaded or _free(r, blocks) < 1 - SATURATED

            def score(r: Replica) -> float:
                hit = hits[r] / prompt_blocks if prompt_blocks else 0.0
                return HIT_WEIGHT * hit + FREE_WEIGHT * _free(r, blocks) + IDLE_WEIGHT * (1 - r.in_flight / busiest)

            # Equal scores (an idle pool, a prompt cached nowhere) go to the replica admitted to longest ago,
            # so that new conversations spread; sorted() is stable, so the rotated order decides the rest.
            order = sorted(candidates, key=lambda r: (held_back(r), -score(r), r.last_admitted))
        return [(r, hits[r]) for r in order]


def _free(replica: Replica, blocks: int) -> float:
    """The share of the replica's budget left after reserving ``blocks`` there (0 when it would not fit)."""
    budget = replica.gate.budget
    return max(0.0, (budget - replica.gate.committed() - blocks) / budget) if budget else 0.0
