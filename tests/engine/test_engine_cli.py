"""``python -m engine``: its flags, and one real server process driven until its KV pool runs out."""

from __future__ import annotations

import asyncio
import json
import signal
from dataclasses import fields

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families
from support.engine_server import ServerThread
from support.net import request
from support.processes import Processes
from support.wait import wait_for

from engine.__main__ import main
from engine.config import EngineConfig

NUM_BLOCKS = 64
COUNTERS = {  # /metrics sample -> snapshot field
    ("engine_preemptions_total", "recompute"): "preemptions_recompute_total",
    ("engine_preemptions_total", "swap"): "preemptions_swap_total",
    ("engine_prompt_tokens_total", None): "prompt_tokens_total",
    ("engine_generation_tokens_total", None): "generation_tokens_total",
    ("engine_prefix_cache_queries_tokens_total", None): "prefix_cache_queries_total",
    ("engine_prefix_cache_hits_tokens_total", None): "prefix_cache_hits_total",
}


def test_help_explains_a_flag_for_every_engine_option(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for option in fields(EngineConfig):
        # loras: one --lora NAME=PATH per adapter, as docs/contract.md names the flag
        assert ("--lora" if option.name == "loras" else "--" + option.name.replace("_", "-")) in text
    assert "--host" in text and "127.0.0.1" in text and "--no-enable-prefix-caching" in text


@pytest.mark.parametrize(("argv", "field"), [(["--block-size", "12"], "block_size"),
                                             (["--num-blocks", "0"], "num_blocks"),
                                             (["--preemption-mode", "drop"], "--preemption-mode"),
                                             (["--served-model-name", " "], "served_model_name"),
                                             (["--lora", "no-path"], "--lora"),
                                             (["--lora", "a=/x", "--lora", "a=/y"], "--lora"),
                                             (["--max-lora-rank", "0"], "max_lora_rank"),
                                             (["--responses-ttl", "0"], "--responses-ttl"),
                                             (["--max-stored-responses", "0"], "--max-stored-responses")])
def test_invalid_flags_exit_2_naming_the_option(capsys: pytest.CaptureFixture[str], argv: list[str],
                                                field: str) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert field in capsys.readouterr().err


def metric_values(text: str) -> dict[tuple[str, str | None], float]:
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            label = next(iter(sample.labels.values()), None) if len(sample.labels) == 1 else None
            values[(sample.name, label)] = sample.value
    return values


def test_served_model_name_is_the_id_clients_see_and_send() -> None:
    with ServerThread(served_model_name="kvguard-demo", num_blocks=16) as server:
        assert [card["id"] for card in json.loads(server.get("/v1/models")[1])["data"]] == ["kvguard-demo"]
        assert server.telemetry()["model"] == "kvguard-demo"
        for model, status in (("kvguard-demo", 200), ("tiny", 404)):
            body = json.dumps({"model": model, "prompt": "hi", "max_tokens": 2}).encode()
            answer = request(server.url + "/v1/completions", body)
            assert answer[0] == status, answer
            if status == 200:
                assert json.loads(answer[1])["model"] == "kvguard-demo"


async def get_json(session: aiohttp.ClientSession, url: str) -> dict:
    async with session.get(url) as answer:
        return await answer.json()


async def scrape(session: aiohttp.ClientSession, url: str) -> dict[tuple[str, str | None], float]:
    async with session.get(url + "/metrics") as answer:
        return metric_values(await answer.text())


async def test_a_pool_that_runs_out_shows_in_the_stream_and_in_metrics(processes: Processes) -> None:
    # --port 0: the engine picks its port and says which on its "engine: listening on" line.
    engine = processes.engine("--device", "cpu", "--num-blocks", str(NUM_BLOCKS), "--block-size", "16",
                              "--preemption-mode", "swap", "--swap-blocks", "16", "--max-num-batched-tokens", "256",
                              port=0)
    url = engine.url
    wait_for(engine.log_text, lambda log: "engine: ready" in log, 5)
    snapshots: list[dict] = []
    try:
        async with aiohttp.ClientSession() as session, session.get(url + "/telemetry/stream") as stream:

            async def subscribe() -> None:
                async for line in stream.content:
                    if line.startswith(b"data:"):
                        snapshots.append(json.loads(line[5:]))

            subscriber = asyncio.create_task(subscribe())

            async def generate(i: int) -> int:
                body = {"model": "tiny", "prompt": f"request {i}: fill the pool", "max_tokens": 100,
                        "ignore_eos": True, "temperature": 0.0}
                async with session.post(url + "/v1/completions", json=body) as answer:
                    return (await answer.json())["usage"]["completion_tokens"]

            load = asyncio.gather(*(generate(i) for i in range(12)))
            # While the pool is contended, a scrape lies between the snapshots taken around it.
            await asyncio.sleep(0.3)
            before = await get_json(session, url + "/telemetry")
            during = await scrape(session, url)
            after = await get_json(session, url + "/telemetry")
            assert await load == [100] * 12
            idle = await get_json(session, url + "/telemetry")
            final = await scrape(session, url)
            await asyncio.sleep(0.1)
            subscriber.cancel()
        for (name, label), field in COUNTERS.items():
            assert before[field] <= during[(name, label)] <= after[field], name
            assert final[(name, label)] == idle[field], name

        reclaimable = [s["free_blocks"] + s["cached_blocks"] for s in snapshots]
        preemptions = [s["preemptions_total"] for s in snapshots]
        assert reclaimable[0] == NUM_BLOCKS and min(reclaimable) <= NUM_BLOCKS // 8, reclaimable
        assert preemptions == sorted(preemptions) and preemptions[-1] > preemptions[0] == 0, preemptions
        assert idle["preemptions_swap_total"] > 0 and final[("engine_swap_bytes_total", "out")] > 0
        assert idle["free_blocks"] + idle["cached_blocks"] == NUM_BLOCKS and idle["swap_used_blocks"] == 0
        assert final[("engine_kv_blocks", "used")] == 0
        assert final[("engine_kv_blocks", "free")] + final[("engine_kv_blocks", "cached")] == NUM_BLOCKS
        assert final[("engine_requests", "running")] == final[("engine_requests", "swapped")] == 0
    finally:
        code = await asyncio.to_thread(engine.stop, signal.SIGINT)
        assert code == 0, engine.log_tail()
        assert "engine: stopped" in engine.log_text()
