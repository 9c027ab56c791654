"""Scheduling profiles (guard/pool/scheduling/): a custom profile's choices and what each candidate records,
the pickers, named plugin instances with parameters and several profiles chosen per request (by model or
objective), and the config errors of a bad profile, on real gates fed with snapshots (no engines). The
presets' choices are tests/guard/test_pool_picker.py; a profile from YAML routing a live pool is in
tests/guard/test_pool_routing.py."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
from support.admission_parts import pool_of
from support.processes import run_command

from guard.config import ConfigError, Routing, load_config
from guard.pool.scheduling import Candidate, Request, profile_for
from guard.pool.scheduling.pickers import RandomWeighted
from guard.pool.scheduling.plugin import Context


def custom(**profile: object) -> Routing:
    return Routing.model_validate({"profile": profile})


def test_a_custom_profile_scores_filters_and_records_each_candidate():
    profile = profile_for(custom(filters=["saturation"], scorers=[{"name": "free_blocks", "weight": 3},
                                                                  {"name": "idle"}]))
    pool = pool_of([100, 60, 20])  # e2 would be past 80% of its budget: held back
    pool.by_name["e0"].in_flight = 2
    ranked = profile.rank(pool.replicas, Request(4, []))
    assert [c.replica.name for c in ranked] == ["e0", "e1", "e2"]
    e0, e1, e2 = ranked
    assert e2.filtered_by == "saturation" and e0.filtered_by is None and e1.filtered_by is None
    assert e0.scores == {"free_blocks": pytest.approx(81 / 85), "idle": 0.0}
    assert e1.scores == {"free_blocks": pytest.approx(41 / 85), "idle": 1.0}
    assert e0.total == pytest.approx(3 * 81 / 85) and e1.total == pytest.approx(3 * 41 / 85 + 1)
    assert e2.kept() == ("e2", "saturation",  # 1 block left after these 4
                         {"free_blocks": pytest.approx(1 / 85), "idle": 1.0}, pytest.approx(3 / 85 + 1))
    assert not profile.needs_hashes


def test_filters_fail_open_and_a_pool_of_one_is_not_scored():
    profile = profile_for(custom(filters=["saturation"], scorers=[{"name": "free_blocks"}]))
    ranked = profile.rank(pool_of([20, 10, 15]).replicas, Request(4, []))
    assert [c.filtered_by for c in ranked] == [None, None, None]  # all saturated: none held back
    assert ranked[0].replica.name == "e0"  # the only one with a block left after these 4
    single = profile.rank(pool_of([100]).replicas, Request(4, []))
    assert [(c.replica.name, c.scores, c.total) for c in single] == [("e0", {}, 0.0)]


def test_round_robin_picker_takes_turns_whatever_the_scores():
    profile = profile_for(custom(scorers=[{"name": "free_blocks"}], picker="round_robin"))
    pool = pool_of([100, 50, 10])
    assert sorted(profile.rank(pool.replicas, Request(4, []))[0].replica.name for _ in range(3)) == ["e0", "e1", "e2"]


def test_random_weighted_draws_in_proportion_to_the_totals():
    pool = pool_of([100, 100, 100])
    picker = RandomWeighted(random.Random(7))
    candidates = [Candidate(r, 0, total=t) for r, t in zip(pool.replicas, (3.0, 1.0, 0.0))]
    candidates.append(Candidate(pool.replicas[0], 0, filtered_by="overload", total=9.0))
    ctx = Context(Request(4), pool.replicas, {}, 0, 1, 0, {})
    firsts = [picker.order(list(candidates), ctx)[0].replica.name for _ in range(2000)]
    assert firsts.count("e2") == 0 and 0.65 < firsts.count("e0") / 2000 < 0.85  # 3 : 1, held back last
    assert picker.order(list(candidates), ctx)[-1].filtered_by == "overload"


def test_lexicographic_ranks_scorer_by_scorer_and_keeps_the_rotation_on_ties():
    """The ``least_loaded`` and ``prefix`` presets: an exact tie goes round (as the policies always did), not
    to the replica admitted to longest ago as ``max_score`` breaks it; weights play no part in the order."""
    pool = pool_of([100, 100, 100])
    pool.by_name["e0"].last_admitted = -1.0  # max_score's tie-break would send every request to e0
    for policy in ("least_loaded", "prefix"):
        preset = profile_for(Routing(policy=policy))
        assert sorted(preset.rank(pool.replicas, Request(4, []))[0].replica.name for _ in range(3)) == ["e0", "e1", "e2"]
    assert profile_for(Routing(policy="kvguard")).rank(pool.replicas, Request(4, []))[0].replica.name == "e0"
    profile = profile_for(custom(scorers=[{"name": "idle", "weight": 0}, {"name": "free_blocks", "weight": 100}],
                                 picker="lexicographic"))
    pool = pool_of([100, 100, 30])
    pool.by_name["e0"].in_flight = 1
    assert [c.replica.name for c in profile.rank(pool.replicas, Request(4, []))] == ["e1", "e2", "e0"]


@pytest.mark.parametrize(("policy", "hashes"), [("kvguard", True), ("prefix", True), ("least_loaded", False),
                                                ("round_robin", False)])
def test_a_preset_reads_prefix_hits_only_when_a_scorer_does(policy: str, hashes: bool):
    assert profile_for(Routing(policy=policy)).needs_hashes is hashes


@pytest.mark.parametrize(("profile", "message"), [
    ({"scorers": [{"name": "free_blocks"}, {"name": "prefx"}]},
     "routing.profile.scorers[1].name: unknown scorer 'prefx' (known: adapter, free_blocks, idle, prefix)"),
    ({"filters": ["saturated"]}, "routing.profile.filters[0]: unknown filter 'saturated' (known: overload, saturation, slo)"),
    ({"picker": "best"},
     "routing.profile.picker: unknown picker 'best' (known: lexicographic, max_score, random_weighted, round_robin)"),
])
def test_an_unknown_plugin_is_a_config_error_naming_it_and_its_key(profile: dict, message: str):
    with pytest.raises(ConfigError) as info:
        profile_for(custom(**profile))
    assert str(info.value) == message


def test_a_bad_profile_stops_the_guard_at_start_up(tmp_path: Path):
    path = tmp_path / "guard.yaml"
    path.write_text('secret: s\nengine: {url: "http://127.0.0.1:9"}\ntenants: [{name: a, api_keys: [k]}]\n'
                    "routing: {profile: {scorers: [{name: prefix, weight: 2}, {name: prefx}]}}\n")
    result = run_command(sys.executable, "-m", "guard", "--config", str(path))
    assert result.returncode == 2
    assert "routing.profile.scorers[1].name: unknown scorer 'prefx'" in result.stderr


@pytest.mark.parametrize(("routing", "problem"), [
    ('{policy: prefix, profile: {scorers: [{name: prefix}]}}', "routing.policy 'prefix' (a preset) and routing.profile"),
    ('{profile: {scorers: [{name: idle, weight: -1}]}}', "routing.profile.scorers.0.weight"),
    ('{profile: {scorers: [{name: idle, weight: .inf}]}}', "routing.profile.scorers.0.weight"),
])
def test_a_profile_that_does_not_validate_names_the_key(tmp_path: Path, routing: str, problem: str):
    path = tmp_path / "guard.yaml"
    path.write_text(f'secret: s\nengine: {{url: "http://127.0.0.1:9"}}\ntenants: [{{name: a, api_keys: [k]}}]\n'
                    f"routing: {routing}\n")
    with pytest.raises(ConfigError, match=problem.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        load_config(path)


def test_a_profile_replaces_the_default_preset_even_when_it_is_named(tmp_path: Path):
    """DESIGN.md's example names ``policy: kvguard`` beside a profile: the profile is what routes."""
    path = tmp_path / "guard.yaml"
    path.write_text('secret: s\nengine: {url: "http://127.0.0.1:9"}\ntenants: [{name: a, api_keys: [k]}]\n'
                    "routing: {policy: kvguard, profile: {filters: [overload], scorers: [{name: idle}]}}\n")
    profile = profile_for(load_config(path).routing).default
    assert [f.name for f in profile.filters] == ["overload"] and [s.name for s, _ in profile.scorers] == ["idle"]


ROUTING = {
    "plugins": [{"type": "saturation", "name": "tight", "parameters": {"threshold": 0.5}},
                {"type": "saturation", "name": "loose", "parameters": {"threshold": 0.95}}],
    "profile": {"filters": ["tight"], "scorers": [{"name": "free_blocks"}]},
    "profiles": [{"name": "lenient", "filters": ["loose"], "scorers": [{"name": "free_blocks"}]}],
    "select": [{"model": "bulk-model", "profile": "lenient"}, {"objective": "batch", "profile": "lenient"}],
}


def test_one_plugin_type_runs_as_named_instances_with_parameters_in_profiles_chosen_per_request():
    """e1 would hold 48% of its budget free after the reservation, e2 1%: the tight instance (past 50%)
    holds back both, the loose one (past 95%) e2 alone; a request for bulk-model, or with the batch
    objective, is ranked by the lenient profile, any other by the default."""
    profiles = profile_for(Routing.model_validate(ROUTING))
    pool = pool_of([100, 60, 20])

    def held(request: Request) -> dict[str, str | None]:
        return {c.replica.name: c.filtered_by for c in profiles.rank(pool.replicas, request)}

    assert held(Request(4, model="tiny")) == {"e0": None, "e1": "tight", "e2": "tight"}
    assert held(Request(4, model="bulk-model")) == {"e0": None, "e1": None, "e2": "loose"}
    assert held(Request(4, model="tiny", objective="batch")) == {"e0": None, "e1": None, "e2": "loose"}
    assert profiles.default.filters[0].threshold == 0.5 and profiles.named["lenient"].filters[0].threshold == 0.95


@pytest.mark.parametrize(("plugins", "message"), [
    ([{"type": "saturation", "parameters": {"treshold": 0.5}}], "routing.plugins[0].parameters: "),
    ([{"type": "saturation", "parameters": {"threshold": 2}}],
     "routing.plugins[0].parameters: threshold must be in (0, 1], got 2"),
    ([{"type": "saturaton"}], "routing.plugins[0]: unknown plugin 'saturaton'"),
])
def test_a_bad_plugin_instance_is_a_config_error_naming_it(plugins: list, message: str):
    with pytest.raises(ConfigError) as info:
        profile_for(Routing.model_validate({"plugins": plugins}))
    assert str(info.value).startswith(message)
    assert "treshold" in str(info.value) or "treshold" not in str(plugins)


@pytest.mark.parametrize(("routing", "problem"), [
    ({"select": [{"model": "m", "profile": "nowhere"}]}, "no profile named 'nowhere'"),
    ({"profiles": [{"name": "p"}], "select": [{"profile": "p"}]}, "needs a model or an objective"),
    ({"plugins": [{"type": "idle"}, {"type": "idle"}]}, "routing.plugins: a name is given twice"),
])
def test_profiles_and_rules_that_do_not_hold_together_are_refused(routing: dict, problem: str):
    with pytest.raises(ValueError, match=problem):
        Routing.model_validate(routing)
