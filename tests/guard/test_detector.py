"""The Fill-and-Squeeze detector on synthetic event sequences: the attack's phases escalate it, each
benign pattern alone does not, and states come down only after the score stays low."""

from __future__ import annotations

from support.admission_parts import snapshot
from support.detector_script import BUDGET, run

from engine.protocol import TenantUsage
from guard.detect.detector import CLEAR_SUSPECT_AFTER_S, Detector


def test_probe_fill_squeeze_is_confirmed() -> None:
    d = Detector({"attacker": 1, "victim": 1})
    probe = lambda now: d.on_request("attacker", 2, now)
    now, changes = run(d, 5, 0.25, probe, lambda _: {}, set(), lambda _: 0.9)
    assert d.state("attacker") == "normal", "probing alone is not an attack"

    def fill_and_squeeze(t: float) -> None:
        probe(t)
        if int(t * 4) % 8 == 0:
            d.on_request("attacker", 1000, t)  # long generations
        d.on_request("attacker", 8, t)  # micro-requests
    now, changes = run(d, 8, 0.25, fill_and_squeeze, lambda _: {"attacker": 80}, {"victim"}, lambda _: 0.05,
                       start=now)
    assert [c[2] for c in changes][:2] == ["suspect", "confirmed"]
    assert d.state("attacker") == "confirmed" and d.state("victim") == "normal"
    assert d.transitions[-1][4]["switch"] > 0 and d.transitions[-1][4]["share"] > 0


def test_benign_patterns_alone_stay_normal() -> None:
    d = Detector({"chat": 1, "document": 1, "agent": 1})

    def traffic(t: float) -> None:
        d.on_request("chat", 256, t)  # bursty chat: normal output lengths
        if int(t * 4) % 4 == 0:
            d.on_request("document", 512, t)  # big documents holding many blocks
        d.on_request("agent", 32, t)  # many short agent calls
    # The document tenant holds most of the pool while others wait, at the edge: still only one signal.
    _, changes = run(d, 30, 0.25, traffic, lambda _: {"document": 90, "chat": 5, "agent": 3},
                     {"chat", "agent", "document"}, lambda _: 0.05)
    assert not changes and all(d.state(t) == "normal" for t in ("chat", "document", "agent"))


def test_states_come_down_only_after_a_quiet_period() -> None:
    d = Detector({"a": 1, "b": 1})
    d.tenants["a"].state = "suspect"
    _, changes = run(d, CLEAR_SUSPECT_AFTER_S - 1, 0.5, lambda _: None, lambda _: {}, set(), lambda _: 1.0)
    assert d.state("a") == "suspect" and not changes
    _, changes = run(d, 2, 0.5, lambda _: None, lambda _: {}, set(), lambda _: 1.0, start=CLEAR_SUSPECT_AFTER_S)
    assert changes == [("a", "suspect", "normal")]


def test_preemptions_of_others_count_against_the_holder() -> None:
    d = Detector({"holder": 1, "victim": 1})
    for i in range(6):
        snap = snapshot(tenants_usage={"victim": TenantUsage(preemptions_total=i * 2)})
        d.on_telemetry(snap, now=float(i))
    d.evaluate({"holder": 60}, BUDGET, set(), 0.5, now=6.0)
    assert d.tenants["holder"].evidence["victims"] == 1.0
    assert d.tenants["victim"].evidence["victims"] == 0.0


def test_preemptions_from_before_the_guard_came_up_are_history() -> None:
    """The first snapshot is a baseline: a guard (re)started in front of an engine with a past attributes
    none of the engine's old preemptions to whoever holds blocks now."""
    d = Detector({"holder": 1, "victim": 1})
    d.on_telemetry(snapshot(tenants_usage={"victim": TenantUsage(preemptions_total=50)}), now=0.0)
    d.evaluate({"holder": 60}, BUDGET, set(), 0.5, now=0.5)
    assert d.tenants["holder"].evidence["victims"] == 0.0
    d.on_telemetry(snapshot(tenants_usage={"victim": TenantUsage(preemptions_total=55)}), now=1.0)
    d.evaluate({"holder": 60}, BUDGET, set(), 0.5, now=1.5)
    assert d.tenants["holder"].evidence["victims"] == 1.0
