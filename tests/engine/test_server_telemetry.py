"""Telemetry over HTTP: the snapshot stream's cadence, heartbeats, and the Prometheus metrics contract."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families
from support.engine_server import ServerThread
from support.wait import wait_for

# Every engine metric of the contract (docs/contract.md, "Engine metrics"), as exposed.
CONTRACT_METRICS = {
    "engine_kv_blocks", "engine_kv_blocks_capacity", "engine_kv_usage_ratio", "engine_swap_blocks",
    "engine_requests", "engine_preemptions", "engine_swap_bytes", "engine_prefix_cache_queries_tokens",
    "engine_prefix_cache_hits_tokens", "engine_prefix_cache_evictions_blocks", "engine_prompt_tokens",
    "engine_generation_tokens", "engine_time_to_first_token_seconds", "engine_inter_token_latency_seconds",
    "engine_e2e_request_latency_seconds", "engine_step_duration_seconds", "engine_bandwidth_utilization_ratio",
    "engine_memory_bandwidth_bytes_per_second", "engine_tenant_kv_blocks", "engine_tenant_preemptions",
    "engine_healthy", "engine_info",
}


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    with ServerThread(num_blocks=256, block_size=16) as running:
        yield running


async def load(session: aiohttp.ClientSession, url: str, count: int, max_tokens: int, tenant: str) -> None:
    async def one(i: int) -> None:
        body = {"model": "tiny", "prompt": f"load {i}", "max_tokens": max_tokens, "ignore_eos": True}
        async with session.post(url + "/v1/completions", json=body, headers={"X-Tenant-Id": tenant}) as answer:
            assert answer.status == 200, await answer.text()

    await asyncio.gather(*(one(i) for i in range(count)))


async def test_stream_is_fast_while_busy_and_quiet_with_heartbeats_while_idle(server: ServerThread) -> None:
    wait_for(server.telemetry, lambda s: s["tokens_per_s"] == 0 and s["num_running"] == 0, 3)
    lines: list[tuple[float, bytes]] = []
    async with aiohttp.ClientSession() as session, session.get(server.url + "/telemetry/stream") as stream:
        assert stream.headers["Content-Type"] == "text/event-stream"

        async def read() -> None:
            async for line in stream.content:
                if line.strip():
                    lines.append((time.monotonic(), line.strip()))

        reader = asyncio.create_task(read())
        await asyncio.sleep(1.3)
        idle = list(lines)
        # 600 tokens each: at 300 the engine, quicker since its host-work pass, was busy for 0.49 s in one run
        await load(session, server.url, count=8, max_tokens=600, tenant="busy")
        reader.cancel()
    idle_snapshots = [line for _, line in idle if line.startswith(b"data:")]
    assert 1 <= len(idle_snapshots) <= 3, "idle: the first snapshot, then a refresh per second"
    assert any(line.startswith(b": heartbeat") for _, line in idle)
    snapshots = [json.loads(line[5:]) for _, line in lines[len(idle):] if line.startswith(b"data:")]
    busy = [s for s in snapshots if s["num_running"] + s["num_waiting"] > 0]
    span = busy[-1]["time"] - busy[0]["time"]
    assert span > 0.5, "the load keeps the engine busy long enough to measure"
    assert len(busy) / span >= 20, f"{len(busy)} snapshots in {span:.2f} s"
    assert busy[-1]["tenants"]["busy"]["running"] > 0
    steps = [s["step"] for s in snapshots]
    assert steps == sorted(steps), "snapshots come in step order"


def test_metrics_expose_the_contract_and_agree_with_the_snapshot(server: ServerThread) -> None:
    async def busy() -> None:
        async with aiohttp.ClientSession() as session:
            await load(session, server.url, count=3, max_tokens=20, tenant="acme")

    asyncio.run(busy())
    snap = server.wait_idle()
    status, body = server.get("/metrics")
    assert status == 200
    families = {f.name: f for f in text_string_to_metric_families(body.decode())}
    assert CONTRACT_METRICS <= set(families), CONTRACT_METRICS - set(families)

    def value(name: str, **labels: str) -> float:
        return next(s.value for s in families[name].samples
                    if s.labels == labels and s.name in (name, name + "_total"))

    assert value("engine_kv_blocks", state="free") == snap["free_blocks"]
    assert value("engine_kv_blocks", state="cached") == snap["cached_blocks"]
    held = snap["num_blocks"] - snap["free_blocks"] - snap["cached_blocks"]
    assert value("engine_kv_blocks", state="used") == held == 0
    assert value("engine_kv_blocks_capacity") == snap["num_blocks"]
    assert value("engine_generation_tokens") == snap["generation_tokens_total"]
    assert value("engine_prompt_tokens") == snap["prompt_tokens_total"]
    assert value("engine_prefix_cache_queries_tokens") == snap["prefix_cache_queries_total"]
    assert value("engine_tenant_kv_blocks", tenant="acme") == 0
    assert value("engine_healthy") == 1
    assert families["engine_info"].samples[0].labels == {"model": "tiny", "block_size": "16", "device": "cpu",
                                                    "dtype": "float32"}
    requests = families["engine_e2e_request_latency_seconds"].samples
    assert next(s.value for s in requests if s.name.endswith("_count")) >= 3
    itl = families["engine_inter_token_latency_seconds"].samples
    assert next(s.value for s in itl if s.name.endswith("_count")) >= 3 * 19
