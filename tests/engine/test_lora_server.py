"""LoRA adapters over HTTP on the real engine (tiny model): a request names the adapter as its model,
``/v1/models`` lists adapters with their parent, vLLM's load/unload routes work with
``--allow-runtime-lora`` and are refused without it, a bad adapter is a 400 with one line; the adapter
series in telemetry and metrics."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.engine_server import ServerThread
from support.lora_adapters import write_adapter
from support.net import request

from engine.model.tiny import tiny_config


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("adapters")
    for seed, name in enumerate(["support", "later"]):
        write_adapter(directory / name, tiny_config(), seed=seed)
    return directory


@pytest.fixture(scope="module")
def engine(adapters: Path):
    with ServerThread(num_blocks=64, loras={"support": str(adapters / "support")}, allow_runtime_lora=True) as server:
        yield server


def _complete(engine: ServerThread, model: str) -> tuple[int, dict]:
    body = {"model": model, "prompt": "hello adapters", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    status, raw = request(engine.url + "/v1/completions", json.dumps(body).encode())
    return status, json.loads(raw)


def _post(engine: ServerThread, path: str, body: dict) -> tuple[int, bytes]:
    return request(engine.url + path, json.dumps(body).encode())


def test_models_list_adapters_with_their_parent_and_requests_name_them(engine: ServerThread) -> None:
    status, raw = engine.get("/v1/models")
    cards = {card["id"]: card for card in json.loads(raw)["data"]}
    assert status == 200 and cards["tiny"]["parent"] is None and cards["support"]["parent"] == "tiny"
    assert json.loads(engine.get("/v1/models/support")[1])["parent"] == "tiny"
    base, adapted = _complete(engine, "tiny"), _complete(engine, "support")
    assert base[0] == adapted[0] == 200 and adapted[1]["model"] == "support"
    assert base[1]["choices"][0]["text"] != adapted[1]["choices"][0]["text"]
    status, error = _complete(engine, "nope")
    assert status == 404 and error["error"]["code"] == "model_not_found"
    snapshot = engine.wait_idle()
    assert snapshot["loras"] == ["support"] and snapshot["lora_requests_total"] == {"support": 1}
    metrics = engine.get("/metrics")[1].decode()
    assert 'engine_lora_requests_total{lora="support"} 1.0' in metrics
    assert 'engine_lora_resident{lora="support"} 1.0' in metrics


def test_load_and_unload_at_runtime_in_vllms_shapes(engine: ServerThread, adapters: Path) -> None:
    status, text = _post(engine, "/v1/load_lora_adapter", {"lora_name": "later", "lora_path": str(adapters / "later")})
    assert status == 200 and b"later" in text, text
    assert _complete(engine, "later")[0] == 200
    assert "later" in {card["id"] for card in json.loads(engine.get("/v1/models")[1])["data"]}
    status, raw = _post(engine, "/v1/load_lora_adapter", {"lora_name": "later", "lora_path": str(adapters / "later")})
    assert status == 400 and "already loaded" in json.loads(raw)["error"]["message"]
    assert _post(engine, "/v1/unload_lora_adapter", {"lora_name": "later"})[0] == 200
    assert _complete(engine, "later")[0] == 404
    status, raw = _post(engine, "/v1/unload_lora_adapter", {"lora_name": "later"})
    assert status == 404 and json.loads(raw)["error"]["code"] == "lora_not_found"


def test_a_bad_adapter_is_refused_in_one_line_and_nothing_is_loaded(engine: ServerThread, tmp_path: Path) -> None:
    bad = write_adapter(tmp_path / "big", tiny_config(), rank=64)
    status, raw = _post(engine, "/v1/load_lora_adapter", {"lora_name": "big", "lora_path": str(bad)})
    error = json.loads(raw)["error"]
    assert status == 400 and error["code"] == "invalid_lora_adapter"
    assert "rank 64 is over the limit of 16" in error["message"] and "\n" not in error["message"]
    assert "big" not in {card["id"] for card in json.loads(engine.get("/v1/models")[1])["data"]}


def test_runtime_loading_is_refused_without_the_flag(adapters: Path) -> None:
    with ServerThread(num_blocks=16) as engine:
        status, raw = _post(engine, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(adapters / "later")})
        error = json.loads(raw)["error"]
        assert status == 403 and error["code"] == "runtime_lora_disabled" and "--allow-runtime-lora" in error["message"]
        assert _post(engine, "/v1/unload_lora_adapter", {"lora_name": "x"})[0] == 403
