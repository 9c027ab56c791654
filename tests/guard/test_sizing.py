"""Reservation sizing and growth (guard/admission/sizing.py) on a real dispatcher and gate, no engines, and the
sizing step of admission (``size_request``): the bound, the prediction, the detector's verdict."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.admission_parts import make_dispatcher, ticket

from guard.admission.predictor import OutputPredictor
from guard.admission.sizing import Growth, size_request, size_reservation
from guard.admission.ticket import TicketState
from guard.config import Lane, Tenant
from guard.errors import GuardError
from guard.pool.gate import batch_blocks_for


def test_a_declared_bound_is_reserved_whole():
    sizing = size_reservation(16, [100, 30], n=2, bound=64, reserve=64, declared=True, largest_budget=85, lane=Lane())
    assert sizing.blocks == batch_blocks_for(16, [100, 30], 64, 2) and sizing.reserve == 64
    assert sizing.sequences == 4


def test_a_prediction_is_halved_until_it_fits_the_largest_budget():
    sizing = size_reservation(16, [32], n=1, bound=4096, reserve=4096, declared=False, largest_budget=20, lane=Lane())
    assert sizing.reserve == 256  # 4096 -> 2048 -> 1024 -> 512 -> 256: (32 + 256) / 16 = 18 blocks <= 20
    assert sizing.blocks == 18 and sizing.bound == 4096


def test_a_declared_bound_that_never_fits_is_refused_naming_max_tokens():
    with pytest.raises(GuardError) as info:
        size_reservation(16, [32], n=1, bound=4096, reserve=4096, declared=True, largest_budget=20, lane=Lane())
    assert info.value.status == 400 and info.value.param == "max_tokens" and "258 KV blocks" in info.value.message


async def test_growth_doubles_the_reservation_until_the_bound_and_retries_a_block_later(tmp_path: Path):
    dispatcher, config = make_dispatcher(tmp_path, num_blocks=100)  # budget 85 blocks
    sizing = size_reservation(16, [16], n=1, bound=256, reserve=16, declared=False, largest_budget=85, lane=Lane())
    t = ticket(config, 0, sizing.blocks, "grows")
    t.max_tokens = sizing.reserve
    await dispatcher.submit(t)
    growth = Growth(sizing, dispatcher, t)
    assert growth.on_tokens(15) is None  # still covered
    assert growth.on_tokens(16) is True and (t.max_tokens, t.blocks) == (32, sizing.blocks_for(32))
    assert growth.on_tokens(17) is None and growth.grow_at == 32
    hog = ticket(config, 1, 85 - t.blocks, "hog")  # the rest of the budget
    await dispatcher.submit(hog)
    assert growth.on_tokens(32) is False and growth.grow_at == 48 and t.max_tokens == 32
    dispatcher.finish(hog)
    for events, wanted in ((48, 64), (64, 128), (128, 256)):
        assert growth.on_tokens(events) is True and t.max_tokens == wanted
    assert growth.on_tokens(10_000) is None  # at its bound: never more
    assert (growth.granted, growth.denied) == (4, 1)
    dispatcher.finish(t)
    assert t.state is TicketState.DONE and dispatcher.pool.committed() == 0


# -- the sizing step of admission (size_request): the client's bound, a prediction, the detector's verdict --
TENANT = Tenant(name="acme", api_keys=["sk-a"], lane="interactive")
LANE = Lane(priority=1)


def no_verdict(tenant: Tenant, lane: Lane, max_tokens: int) -> tuple[int | None, Lane]:
    return None, lane


def suspect(tenant: Tenant, lane: Lane, max_tokens: int) -> tuple[int | None, Lane]:
    return 64, lane.model_copy(update={"priority": 9})


def confirmed(tenant: Tenant, lane: Lane, max_tokens: int) -> tuple[int | None, Lane]:
    raise GuardError(429, "attack", code="abuse_suspected")


def test_a_declared_bound_is_what_the_request_reserves():
    """(``bound`` is what each sequence may generate: with the client's max_tokens, that bound.)"""
    sizing = size_request(TENANT, LANE, [100], 1, 200, 200, 16, 85, OutputPredictor(), no_verdict)
    assert (sizing.declared, sizing.bound, sizing.reserve, sizing.lane, sizing.capped) == (True, 200, 200, LANE, False)


def test_without_a_bound_the_tenants_usual_output_is_reserved_up_to_the_windows_room():
    predictor = OutputPredictor()
    for _ in range(8):
        predictor.record("acme", "interactive", 100)
    sizing = size_request(TENANT, LANE, [100], 1, 4000, None, 16, 85, predictor, no_verdict)
    assert not sizing.declared and sizing.bound == 4000 and 100 <= sizing.reserve < 4000


def test_a_suspects_output_is_capped_and_its_lane_demoted_and_a_confirmed_attacker_refused():
    sizing = size_request(TENANT, LANE, [100], 1, 500, 500, 16, 85, OutputPredictor(), suspect)
    assert (sizing.bound, sizing.reserve, sizing.capped, sizing.lane.priority) == (64, 64, True, 9)
    with pytest.raises(GuardError) as info:
        size_request(TENANT, LANE, [100], 1, 4000, 500, 16, 85, OutputPredictor(), confirmed)
    assert info.value.code == "abuse_suspected"
