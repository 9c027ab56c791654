"""``routing.policy`` presets as profiles, and the profile a config asks for (names checked here, where the
plugins live: an unknown one is a ``ConfigError`` naming it and its key path).

- ``kvguard`` (the default): filters saturation, overload and slo (only requests with a TTFT objective);
  scores 2 x prefix + free_blocks + idle.
- ``round_robin``: the replicas in turn.
- ``least_loaded``: the fewest guard requests in flight, then the most budget left.
- ``prefix``: the most cached leading prompt blocks, then the least loaded, whatever the load: cache
  affinity alone, the baseline that shows the hot spot.

The last two rank their scorers lexicographically, as the policies always did; their small weights only make
a decision record's totals order the replicas as the picker does.
"""

from __future__ import annotations

import guard.pool.scheduling.filters
import guard.pool.scheduling.pickers
import guard.pool.scheduling.scorers  # noqa: F401
from guard.config import ConfigError, PluginRef, Routing, SchedulingProfile
from guard.pool.scheduling.plugin import FILTERS, PICKERS, SCORERS
from guard.pool.scheduling.profile import Profile

PRESETS: dict[str, SchedulingProfile] = {
    "kvguard": SchedulingProfile(
        filters=["saturation", "overload", "slo"],
        scorers=[PluginRef(name="prefix", weight=2), PluginRef(name="free_blocks"), PluginRef(name="idle")]),
    "round_robin": SchedulingProfile(picker="round_robin"),
    "least_loaded": SchedulingProfile(
        scorers=[PluginRef(name="idle"), PluginRef(name="free_blocks", weight=1e-6)], picker="lexicographic"),
    "prefix": SchedulingProfile(
        scorers=[PluginRef(name="prefix"), PluginRef(name="idle", weight=1e-5), PluginRef(name="free_blocks", weight=1e-10)],
        picker="lexicographic"),
}


def profile_for(routing: Routing) -> Profile:
    """The profile ``routing`` asks for: its own ``profile``, else its ``policy``'s preset."""
    given = routing.profile is not None
    spec = routing.profile if routing.profile is not None else PRESETS[routing.policy]
    where = "routing.profile" if given else f"routing.policy ({routing.policy})"
    return Profile(
        [_lookup(FILTERS, name, "filter", f"{where}.filters[{i}]")() for i, name in enumerate(spec.filters)],
        [(_lookup(SCORERS, ref.name, "scorer", f"{where}.scorers[{i}].name")(), ref.weight)
         for i, ref in enumerate(spec.scorers)],
        _lookup(PICKERS, spec.picker, "picker", f"{where}.picker")())


def _lookup(registry: dict[str, type], name: str, kind: str, where: str) -> type:
    if name not in registry:
        raise ConfigError(f"{where}: unknown {kind} {name!r} (known: {', '.join(sorted(registry))})")
    return registry[name]
