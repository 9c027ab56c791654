"""The detector behind a working guard: the attacker's edge is its own block cap, not the engine's pool.

With a ``max_blocks_share`` on every tenant the pool never gets near its edge and nobody else waits, so the
pool-edge and others-wait conditions alone would never fire (bench/attacks/fill_squeeze.py measured it:
the attacker stayed ``normal`` for its whole attack). What the guard does see is the attacker's own
requests queueing at its cap while it probes, fills and squeezes.
"""

from __future__ import annotations

from guard.detect.detector import Detector

BUDGET = 81  # 0.85 x 96 blocks
WEIGHTS = {"attacker": 1, "victim-1": 2, "victim-2": 2}  # the benchmark's tenants: the attacker's fair share is 16


def attack(detector: Detector, waiting: set[str], free_share: float, seconds: float = 8.0) -> list[str]:
    """Probes every 0.25 s, a long generation every 2 s, micro-requests at 20/s; evaluated every 0.5 s while
    the attacker holds its cap (40 blocks). Returns the attacker's states after each evaluation."""
    states = []
    for tick in range(int(seconds * 20)):  # 50 ms ticks
        now = tick * 0.05
        if tick % 5 == 0:
            detector.on_request("attacker", 2, now)  # a probe
        if tick % 40 == 0:
            detector.on_request("attacker", 600, now)  # a long generation
        detector.on_request("attacker", 8, now)  # a micro-request
        if tick % 10 == 0:
            detector.evaluate({"attacker": 40, "victim-1": 6}, BUDGET, waiting, free_share, now=now)
            states.append(detector.state("attacker"))
    return states


def test_an_attacker_pressing_against_its_cap_is_confirmed() -> None:
    detector = Detector(WEIGHTS)
    states = attack(detector, waiting={"attacker"}, free_share=0.5)
    assert states[-1] == "confirmed"
    assert detector.state("victim-1") == detector.state("victim-2") == "normal"
    evidence = detector.transitions[-1][4]
    assert evidence["share"] == 1.0 and evidence["switch"] > 0.9


def test_the_same_requests_admitted_at_once_stay_below_suspect() -> None:
    """Nothing holds the tenant back and the pool is far from its edge: only the probe cadence is left."""
    detector = Detector(WEIGHTS)
    assert set(attack(detector, waiting=set(), free_share=0.5)) == {"normal"}
    assert detector.tenants["attacker"].evidence["share"] == detector.tenants["attacker"].evidence["switch"] == 0

