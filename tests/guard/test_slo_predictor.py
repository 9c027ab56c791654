"""The p90 latency predictor (guard/pool/latency.py, guard/pool/estimators.py, guard/admission/slo.py): it
converges to the p90 of what it observes, each replica learns its own (heterogeneous replicas differ), work
that other guards and direct clients put on a replica raises its prediction through the telemetry (and the
guard's own is not counted twice), the queue margin is learned; and live, in front of a real tiny engine,
direct clients' requests show in the guard's prediction. The TPOT filter and refusal on both state backends:
tests/guard/test_admission_backends.py."""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import Iterator

import aiohttp
import pytest
from support.admission_parts import pool_of, snapshot
from support.guard_server import GuardThread, guard_config
from support.processes import EngineProcess, Processes
from support.wait import until

from engine.protocol import TelemetrySnapshot
from guard.admission.fairness import TenantQueue, served_before
from guard.admission.slo import MIN_MARGIN_SEEN, PRIOR_P10_RATIO, PRIOR_P90_RATIO, WaitCorrection
from guard.config import Routing
from guard.pool.estimators import IDLE_GAP_S, Pace, Quantile
from guard.pool.latency import LatencyModel
from guard.pool.scheduling import Request, profile_for

SIGMA = 0.3  # the spread of log(actual TTFT) around the line: p90 / median = exp(1.2816 x SIGMA) = 1.47


def busy(num_running: int = 0, num_waiting: int = 0, itl_s: float = 0.0, **prefill: int) -> TelemetrySnapshot:
    """An engine's snapshot with ``num_running`` sequences decoding at ``itl_s`` a step, ``num_waiting``
    waiting, and ``prefill`` tokens to prefill per priority (``p0=...``)."""
    return snapshot().model_copy(update={
        "num_running": num_running, "num_waiting": num_waiting, "itl_s": itl_s,
        "prefill_tokens": {int(key[1:]): tokens for key, tokens in prefill.items()}})


def serve(model: LatencyModel, rng: random.Random, requests: int, base: float, per_token: float) -> list[tuple]:
    """``requests`` requests sent one at a time at priority 1, each seeing TTFT = (base + per_token x its
    prompt) x a lognormal factor; returns (actual, predicted median, predicted p90) as predicted when sent."""
    seen = []
    for _ in range(requests):
        prompt = rng.randint(20, 800)
        work, sent = model.admitted(1, prompt, prompt, 0)
        actual = (base + per_token * prompt) * math.exp(rng.gauss(0.0, SIGMA))
        model.started(1, prompt, prompt)
        model.observe_ttft(1, work, actual, sent)
        seen.append((actual, sent.ttft.median, sent.ttft.p90))
    return seen


def test_a_quantile_settles_where_nine_in_ten_observations_lie_below_it() -> None:
    rng = random.Random(7)
    q = Quantile(0.9)
    estimates = []
    for _ in range(2000):
        q.observe(rng.gauss(0.0, SIGMA))
        estimates.append(q.value)
    late = estimates[500:]
    assert sum(late) / len(late) == pytest.approx(1.2816 * SIGMA, rel=0.1)
    fresh = [rng.gauss(0.0, SIGMA) for _ in range(1000)]
    coverage = sum(sum(x < e for x in fresh) / len(fresh) for e in late[::50]) / len(late[::50])
    assert 0.85 <= coverage <= 0.95, coverage


def test_a_pace_counts_busy_seconds_so_an_idle_spell_does_not_lower_it() -> None:
    """A replica idle for 8 s of the last 10 drains at its rate while it held something, not a fifth of it
    (the drain rate that refused a burst after an idle spell ``overloaded``)."""
    pace = Pace(10.0)
    assert pace.rate(50.0) == 0.0
    pace.busy(100.0)
    for t in range(100, 102):  # busy 2 s, 10 blocks released a second
        pace.add(10, t + 0.5)
    pace.idle(102.0)
    assert pace.rate(110.0) == 10.0  # 20 blocks over 2 busy seconds, 8 idle ones aside
    assert pace.rate(112.5) == 0.0  # the busy spell left the window
    # An idle gap shorter than IDLE_GAP_S is one spell with what surrounds it (a few entries at any rate).
    pace.busy(200.0)
    for t in range(200, 205):
        pace.idle(t + 0.9)
        pace.add(5, t + 0.9)
        pace.busy(t + 0.9 + IDLE_GAP_S / 2)
    assert pace.rate(205.4) == pytest.approx(25 / 5.4)  # busy from 200 on, the short gaps included


def test_the_ttft_predictor_converges_to_the_p90_of_what_it_observes() -> None:
    """Scored as the bench scores it: each request against what was predicted when it was sent."""
    model = LatencyModel()
    seen = serve(model, random.Random(11), 600, 0.02, 2e-4)[200:]
    below_p90 = sum(actual <= p90 for actual, _, p90 in seen) / len(seen)
    below_median = sum(actual <= median for actual, median, _ in seen) / len(seen)
    assert 0.84 <= below_p90 <= 0.96, below_p90
    assert 0.35 <= below_median <= 0.65, below_median
    ratios = sorted(p90 / median for _, median, p90 in seen)
    assert ratios[len(ratios) // 2] == pytest.approx(math.exp(1.2816 * SIGMA), rel=0.15), "p90 over median"
    errors = sorted(abs(median - actual) / actual for actual, median, _ in seen)
    assert errors[len(errors) // 2] < 0.25, "the median's error is the noise's own (~20% at SIGMA 0.3)"


def test_before_anything_is_learned_the_p90_is_the_median() -> None:
    model = LatencyModel()
    prediction = model.predict_ttft(1, 100, 0)
    assert prediction.p90 == prediction.median > 0
    assert tuple(model.predict_tpot(0)) == (0.0, 0.0), "an engine never seen stepping: TPOT unknown"


def test_heterogeneous_replicas_get_their_own_predictions() -> None:
    """Two replicas, one a third the other's speed: each one's TTFT and decode step are its own."""
    fast, slow = LatencyModel(), LatencyModel()
    serve(fast, random.Random(1), 100, 0.01, 1e-4)
    serve(slow, random.Random(2), 100, 0.03, 3e-4)
    quick, late = fast.predict_ttft(1, 400, 0), slow.predict_ttft(1, 400, 0)
    assert late.median > 2 * quick.median, (quick, late)  # 3x, give or take the noise the band residual follows
    for batch in range(1, 9):  # decode step: 2 ms + 1 ms a sequence here, 6 ms + 3 ms there
        fast.on_snapshot(busy(batch, itl_s=0.002 + 0.001 * batch), 0)
        slow.on_snapshot(busy(batch, itl_s=0.006 + 0.003 * batch), 0)
    fast.on_snapshot(busy(3, itl_s=0.005), 0)
    slow.on_snapshot(busy(3, itl_s=0.015), 0)
    assert fast.predict_tpot(0).median == pytest.approx(0.002 + 0.001 * 4, rel=0.02), "its batch: 3 + itself"
    assert slow.predict_tpot(0).median == pytest.approx(0.006 + 0.003 * 4, rel=0.02)
    assert slow.predict_tpot(2).median == pytest.approx(0.006 + 0.003 * 6, rel=0.02), "2 more of the guard's"


def test_the_decode_step_is_fitted_to_the_batch_of_the_steps_it_averages() -> None:
    """The step line pairs ``itl_s`` with ``itl_batch`` (the mean batch of the steps it averages), not with
    the instant's ``num_running``: a batch growing by 4 a snapshot shows each step with the batch before."""
    paired, lagged = LatencyModel(), LatencyModel()
    for batch in range(1, 13):  # 2 ms + 1 ms a sequence; the snapshot's instant already has 4 more running
        reading = busy(batch + 4, itl_s=0.002 + 0.001 * batch)
        paired.on_snapshot(reading.model_copy(update={"itl_batch": float(batch)}), 0)
        lagged.on_snapshot(reading, 0)  # an engine without itl_batch: the instant's count, as before
    assert paired.decode_step(20) == pytest.approx(0.002 + 0.001 * 20, rel=0.02)
    assert lagged.decode_step(20) < 0.95 * paired.decode_step(20)  # the lag shifts the line down


def test_a_stream_slower_than_the_decode_step_teaches_the_tpot_correction_and_its_p90() -> None:
    model = LatencyModel()
    rng = random.Random(3)
    for batch in range(1, 9):
        model.on_snapshot(busy(batch, itl_s=0.004 + 0.001 * batch), 0)
    for _ in range(200):  # the relay and prefill chunks: streams see 1.5x the decode step, give or take 20%
        _, sent = model.admitted(1, 10, 10, 0)
        model.started(1, 10, 10)
        model.observe_tpot(model.decode_step(sent.running + 1) * 1.5 * math.exp(rng.gauss(0.0, 0.2)), sent)
    step = 0.004 + 0.001 * (8 + 1)  # the last snapshot's 8 running, plus the stream
    tpot = model.predict_tpot(0)
    assert tpot.median == pytest.approx(1.5 * step, rel=0.15)
    assert tpot.p90 / tpot.median == pytest.approx(math.exp(1.2816 * 0.2), rel=0.15)


def test_other_guards_and_direct_clients_work_raises_the_prediction_and_the_guards_own_counts_once() -> None:
    model = LatencyModel()
    serve(model, random.Random(5), 50, 0.01, 2e-4)
    model.on_snapshot(busy(), 0)
    alone = model.predict_ttft(1, 100, 0).median
    # Another guard's (or a direct client's) 3000 tokens waiting at priority 1, and sequences running.
    model.on_snapshot(busy(num_running=3, num_waiting=2, p1=3000), 0)
    assert model.ahead(1) == 3000 and model.running(0) == 5
    crowded = model.predict_ttft(1, 100, 0).median
    assert crowded > alone + 3000 * 1e-4, (alone, crowded)
    assert model.ahead(0) == 0, "work at a lower priority is not ahead of a higher one's"
    assert model.band(0) == (0, True), "but it is in flight: another band"
    # The guard's own request, as the engine reports it: counted once, by the guard.
    model.on_snapshot(busy(), 0)
    model.admitted(1, 600, 1000, 0)  # 400 of its 1000 prompt tokens are cached there
    model.on_snapshot(busy(num_waiting=1, p1=1000), 1)
    assert model.ahead(1) == 600 and model.running(1) == 1, "the engine's figures less the guard's own"
    assert model.predict_ttft(1, 100, 1).median == pytest.approx(model.fitted(1, 700, 1), rel=0.5)
    model.started(1, 600, 1000)
    assert model.ahead(1) == 0 and model.pending == {}


def test_the_slo_filter_sees_a_replica_crowded_by_traffic_the_guard_did_not_send() -> None:
    profile = profile_for(Routing())  # the kvguard preset: its filters include slo
    pool = pool_of([100, 100, 100])
    pool.by_name["e1"].on_snapshot(busy(num_waiting=40, p1=50_000).model_copy(update={"free_blocks": 100}))
    ranked = profile.rank(pool.replicas, Request(4, [], prompt_tokens=100, ttft_left_s=1.0, priority=1))
    assert ranked[-1].replica.name == "e1" and ranked[-1].filtered_by == "slo"


def test_the_queue_margin_is_learned_from_the_waits_queued_tickets_had() -> None:
    correction = WaitCorrection()
    key = ("sheddable", True)
    assert correction.predict(key, 2.0, 5.0).p90 == pytest.approx(2.0 * PRIOR_P90_RATIO), "before: the prior"
    assert correction.soonest(key, 2.0, 5.0) == pytest.approx(2.0 * PRIOR_P10_RATIO), "its other side too"
    rng = random.Random(9)
    for _ in range(400):  # long waits run 1.3x the pace's figure, give or take 10%; short ones anything
        correction.observe(key, 2.0, 2.0 * 1.3 * math.exp(rng.gauss(0.0, 0.1)), decisive=True)
        correction.observe(key, 0.1, 0.1 * 1.3 * math.exp(rng.gauss(0.0, 1.0)))
    wait = correction.predict(key, 2.0, objective_s=5.0)
    assert wait.median == pytest.approx(2.6, rel=0.35), "the median correction learns from every ticket"
    assert wait.p90 / wait.median == pytest.approx(math.exp(1.2816 * 0.1), rel=0.1), \
        "a margin of ~12%, learned from the decisive tickets alone (short waits' spread would make it ~3.6x)"
    assert correction.soonest(key, 2.0, objective_s=5.0) / wait.median == pytest.approx(
        math.exp(-1.2816 * 0.1), rel=0.1), "the soonest of nine in ten: the 0.1 quantile, from the same tickets"
    short = correction.predict(key, 0.1, objective_s=5.0)
    assert short.p90 / short.median == pytest.approx(math.exp(1.2816 * 1.0), rel=0.3), "short waits: their own"
    assert correction.predict(("critical", True), 2.0, 5.0).p90 == pytest.approx(2.0 * PRIOR_P90_RATIO), \
        f"each class and way of predicting learns its own (after {MIN_MARGIN_SEEN})"


# -- live: direct clients' requests to a real tiny engine show in the guard's prediction ---------------------

@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineProcess]:
    with Processes(tmp_path_factory.mktemp("predictor")) as processes:
        yield processes.engine("--num-blocks", "256", "--max-num-seqs", "1")  # one at a time: the rest wait


async def test_live_direct_clients_work_on_the_engine_raises_the_guards_prediction(engine: EngineProcess) -> None:
    config = guard_config(engine.url)
    body = {"model": "tiny", "prompt": "tell me everything " * 20, "max_tokens": 1500, "ignore_eos": True,
            "stream": True}
    with GuardThread(config) as guard:
        replica = guard.state.pool.replicas[0]

        def predicted() -> tuple[float, int, int]:
            return guard.call(lambda: (replica.latency.predict_ttft(0, 32, replica.in_flight).median,
                                       replica.latency.ahead(0), replica.latency.running(replica.in_flight)))

        idle, _, _ = await until(predicted, lambda p: p[0] > 0 and p[2] == 0, 10.0)
        async with aiohttp.ClientSession() as session:
            async def direct() -> None:  # straight to the engine: the guard never sees the request
                async with session.post(engine.url + "/v1/completions", json=body) as answer:
                    async for _ in answer.content:
                        pass

            clients = [asyncio.create_task(direct()) for _ in range(3)]
            try:  # one decodes, two wait with their prompts: the telemetry shows them
                crowded, ahead, running = await until(predicted, lambda p: p[1] > 0 and p[2] >= 3, 20.0)
            finally:
                for client in clients:
                    client.cancel()
                await asyncio.gather(*clients, return_exceptions=True)
    assert ahead >= 2 * 20 and running >= 3
    assert crowded > idle, (idle, crowded)


def test_the_wait_correction_follows_the_typical_ticket_not_the_ones_vtc_lets_through_at_once() -> None:
    """Several sheddable tenants: one behind on service is admitted at once while the rest wait 1.5x the
    pace's figure; a fifth of the tickets wait a hundredth of it. A mean of the logs would predict 0.7x."""
    correction = WaitCorrection()
    key = ("sheddable", True)
    rng = random.Random(4)
    for i in range(300):
        factor = 0.01 if i % 5 == 0 else 1.5 * math.exp(rng.gauss(0.0, 0.1))
        correction.observe(key, 2.0, 2.0 * factor)
    assert correction.predict(key, 2.0).median == pytest.approx(3.0, rel=0.15)


def test_a_sheddable_wait_counts_what_vtc_admits_before_it_by_each_tenants_counter() -> None:
    """Three sheddable tenants, 10 blocks of 100 tokens of service each queued by b and c; a is 1,000
    tokens of service ahead of b, c is level with a. A newcomer of a's waits for its own and for what b and
    c are admitted until they reach a's counter; b's newcomer waits for little else."""
    a, b, c = (TenantQueue(name, 1.0) for name in "abc")
    a.counter, b.counter, c.counter = 5000.0, 4000.0, 5000.0
    a_new = served_before(a, 10, 100.0, [(b, 10), (c, 10)], backlogged=False)
    assert a_new == pytest.approx(10 + 10 + 10), "b's 10 blocks (all under a's level) and c's 10 at a level"
    b_new = served_before(b, 10 + 1, 100.0, [(c, 10)], backlogged=True)
    assert b_new == pytest.approx(11 + 1), "b is behind: its own 11, and c's one block once b passes c's counter"
    alone = served_before(a, 10, 100.0, [], backlogged=True)
    assert alone == 10, "one tenant: its own queue, as a FIFO"
    idle = TenantQueue("idle", 1.0)  # never served: lifted to the lowest backlogged counter, b's
    assert served_before(idle, 1, 100.0, [(b, 10), (c, 10)], backlogged=False) == pytest.approx(1 + 1)
