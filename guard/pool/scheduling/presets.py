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
from guard.config import ConfigError, PluginRef, PluginSpec, Routing, SchedulingProfile
from guard.pool.scheduling.plugin import FILTERS, PICKERS, SCORERS
from guard.pool.scheduling.profile import Profile
from guard.pool.scheduling.profiles import Profiles

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


def profile_for(routing: Routing) -> Profiles:
    """The profiles ``routing`` asks for: the default (its own ``profile``, else its ``policy``'s preset) and
    its named ``profiles``, their plugins looked up among ``plugins`` (named instances with parameters) and
    then the registered types (with their default parameters)."""
    instances = {spec.instance: (i, spec) for i, spec in enumerate(routing.plugins)}
    for name, (i, spec) in instances.items():  # every declared instance is checked, used or not
        _build(instances, {**FILTERS, **SCORERS, **PICKERS}, name, "plugin", f"routing.plugins[{i}]")
    given = routing.profile is not None
    spec = routing.profile if routing.profile is not None else PRESETS[routing.policy]
    default = _profile(spec, instances, "routing.profile" if given else f"routing.policy ({routing.policy})")
    named = {p.name: _profile(p, instances, f"routing.profiles[{i}] ({p.name})")
             for i, p in enumerate(routing.profiles)}
    return Profiles(default, named, routing.select)


def _profile(spec: SchedulingProfile, instances: dict[str, tuple[int, PluginSpec]], where: str) -> Profile:
    return Profile(
        [_build(instances, FILTERS, name, "filter", f"{where}.filters[{i}]") for i, name in enumerate(spec.filters)],
        [(_build(instances, SCORERS, ref.name, "scorer", f"{where}.scorers[{i}].name"), ref.weight)
         for i, ref in enumerate(spec.scorers)],
        _build(instances, PICKERS, spec.picker, "picker", f"{where}.picker"))


def _build(instances: dict[str, tuple[int, PluginSpec]], registry: dict[str, type], name: str, kind: str,
           where: str):
    """A new instance of plugin ``name`` of ``kind``: a declared instance (its type and parameters), or a
    registered type with its defaults. A ``ConfigError`` names what is wrong and where."""
    declared = instances.get(name)
    type_name, parameters = (declared[1].type, declared[1].parameters) if declared else (name, {})
    if declared is not None:
        where = f"routing.plugins[{declared[0]}]"
    if type_name not in registry:
        known = ", ".join(sorted(registry))
        raise ConfigError(f"{where}: unknown {kind} {type_name!r} (known: {known})")
    try:
        plugin = registry[type_name](**parameters)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where}.parameters: {exc}") from None
    plugin.name = name  # what the decision record calls it (an instance's own name)
    return plugin
