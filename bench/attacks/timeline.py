"""What the engine and the guard show over a run, sampled at a fixed interval.

Each sample reads the engine's ``/telemetry`` (free blocks, preemptions, the attacker's blocks) and, when a
guard is in front, its ``/metrics`` (the attacker's Fill-and-Squeeze state and suspicion, its reserved
blocks, the guard's queues, and the highest state any victim reached), as an operator's scraper would: the
harness never looks inside either process. An attacker with several keys is summed over its keys (blocks,
queues) or read at its least flagged key (state, suspicion: "confirmed" once every key is), and each key's
state is kept too.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import astuple, dataclass, fields

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

INTERVAL_S = 0.25
GUARD_GAUGES = {"guard_fill_squeeze_state", "guard_fill_squeeze_suspicion", "guard_reserved_blocks",
                "guard_queue_depth"}


@dataclass(slots=True)
class Sample:
    at: float  # monotonic
    reclaimable_blocks: int  # free or cached: what a new request can take
    num_blocks: int
    preemptions_total: int
    num_running: int
    num_waiting: int
    attacker_blocks: int  # held in the engine
    state: int | None = None  # guard_fill_squeeze_state of the attacker: 0 normal, 1 suspect, 2 confirmed
    suspicion: float | None = None  # guard_fill_squeeze_suspicion of the attacker
    attacker_reserved: float | None = None  # guard_reserved_blocks of the attacker
    attacker_queued: float | None = None  # guard_queue_depth of the attacker
    others_queued: float | None = None  # guard_queue_depth of every other tenant, summed
    key_states: list[int] | None = None  # guard_fill_squeeze_state of each attacker key
    victims_state: int | None = None  # the highest guard_fill_squeeze_state of any other tenant

    def as_row(self, origin: float) -> list:
        """The sample as a row of ``table``, its time in seconds since ``origin``."""
        values = astuple(self)[1:]
        return [round(self.at - origin, 3), *(round(v, 3) if isinstance(v, float) else v for v in values)]


def table(samples: list[Sample], origin: float) -> dict:
    """``{"columns": [...], "rows": [[...], ...]}``: compact enough to keep in a committed report."""
    return {"columns": [f.name for f in fields(Sample)], "rows": [s.as_row(origin) for s in samples]}


async def telemetry(session: aiohttp.ClientSession, engine_url: str) -> dict:
    async with session.get(engine_url + "/telemetry") as answer:
        return await answer.json()


async def guard_readings(session: aiohttp.ClientSession, guard_url: str, attackers: list[str]) -> dict:
    """The attacker keys' values of ``GUARD_GAUGES`` (name -> {key: value}), ``others_queued`` and
    ``victims_state``."""
    async with session.get(guard_url + "/metrics") as answer:
        text = await answer.text()
    readings: dict = {"others_queued": 0.0, "victims_state": 0}
    for family in text_string_to_metric_families(text):
        for sample in family.samples if family.name in GUARD_GAUGES else ():
            tenant = sample.labels.get("tenant")
            if tenant in attackers:
                readings.setdefault(sample.name, {})[tenant] = sample.value
            elif sample.name == "guard_queue_depth":
                readings["others_queued"] += sample.value
            elif sample.name == "guard_fill_squeeze_state":
                readings["victims_state"] = max(readings["victims_state"], int(sample.value))
    return readings


async def sample_until(stop: asyncio.Event, engine_url: str, guard_url: str | None, attackers: list[str],
                       samples: list[Sample]) -> None:
    """Append a sample every ``INTERVAL_S`` until ``stop`` is set (a failed read skips that tick)."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2.0)) as session:
        tick = time.monotonic()
        while not stop.is_set():
            try:
                snap = await telemetry(session, engine_url)
                guard = await guard_readings(session, guard_url, attackers) if guard_url else {}
            except (aiohttp.ClientError, TimeoutError, ValueError):
                snap = None
            if snap is not None:
                states = guard.get("guard_fill_squeeze_state", {})
                samples.append(Sample(
                    at=time.monotonic(), reclaimable_blocks=snap["free_blocks"] + snap["cached_blocks"],
                    num_blocks=snap["num_blocks"],
                    preemptions_total=snap["preemptions_total"], num_running=snap["num_running"],
                    num_waiting=snap["num_waiting"],
                    attacker_blocks=sum(snap["tenants"].get(key, {}).get("blocks", 0) for key in attackers),
                    state=int(min(states.values())) if states else None,
                    suspicion=_least(guard.get("guard_fill_squeeze_suspicion")),
                    attacker_reserved=_total(guard.get("guard_reserved_blocks")),
                    attacker_queued=_total(guard.get("guard_queue_depth")),
                    others_queued=guard.get("others_queued"),
                    key_states=[int(states[key]) for key in attackers if key in states] or None,
                    victims_state=guard.get("victims_state")))
            tick += INTERVAL_S
            try:
                await asyncio.wait_for(stop.wait(), max(0.0, tick - time.monotonic()))
            except TimeoutError:
                pass


def _least(by_key: dict[str, float] | None) -> float | None:
    return min(by_key.values()) if by_key else None


def _total(by_key: dict[str, float] | None) -> float | None:
    return sum(by_key.values()) if by_key else None
