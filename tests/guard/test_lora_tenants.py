"""Adapters through the guard (issue 30): a tenant's ``models`` bound what it can run and see, and a model
it may not use is refused exactly as one nobody serves (no existence leak); the ``adapter`` scorer ranks
replicas by where the adapter is; the guard's prompt hashes are keyed by the adapter as the engine's are."""

from __future__ import annotations

import json

import pytest
from support.admission_parts import pool_of, snapshot
from support.engine_server import ServerThread
from support.guard_server import GuardThread, guard_config
from support.lora_adapters import write_adapter
from support.net import request

from engine.model.tiny import tiny_config
from guard.config import Routing
from guard.pool.prefix_index import prompt_block_hashes
from guard.pool.scheduling import Request, profile_for

KEYS = {"acme": "sk-acme", "globex": "sk-globex", "bulk": "sk-bulk"}


@pytest.fixture(scope="module")
def guard(tmp_path_factory: pytest.TempPathFactory):
    directory = tmp_path_factory.mktemp("adapters")
    loras = {name: str(write_adapter(directory / name, tiny_config(), seed=seed))
             for seed, name in enumerate(["acme-support", "bulk-legal"])}
    with ServerThread(num_blocks=64, loras=loras) as engine:
        tenants = [
            {"name": "acme", "api_keys": [KEYS["acme"]], "models": ["tiny", "acme-support"]},
            {"name": "globex", "api_keys": [KEYS["globex"]]},  # no list: every model
            {"name": "bulk", "api_keys": [KEYS["bulk"]], "lane": "batch", "models": ["bulk-legal"]},
        ]
        with GuardThread(guard_config(engine.url, tenants=tenants)) as guard:
            yield guard


def _complete(guard: GuardThread, tenant: str, model: str) -> tuple[int, dict]:
    body = {"model": model, "prompt": "hello", "max_tokens": 3, "temperature": 0}
    status, raw = request(guard.url + "/v1/completions", json.dumps(body).encode(),
                          {"Authorization": f"Bearer {KEYS[tenant]}"})
    return status, json.loads(raw)


def _get(guard: GuardThread, tenant: str, path: str) -> tuple[int, dict]:
    status, raw = request(guard.url + path, headers={"Authorization": f"Bearer {KEYS[tenant]}"})
    return status, json.loads(raw)


def test_a_tenant_runs_its_adapter_and_cannot_reach_anothers(guard: GuardThread) -> None:
    status, answer = _complete(guard, "acme", "acme-support")
    assert status == 200 and answer["model"] == "acme-support"
    assert _complete(guard, "globex", "bulk-legal")[0] == 200
    foreign, unknown = _complete(guard, "bulk", "acme-support"), _complete(guard, "bulk", "no-such-adapter")
    assert foreign[0] == unknown[0] == 404
    assert foreign[1]["error"]["code"] == "model_not_found"
    # The same answer, word for word, as for a name nobody serves: nothing tells that the adapter exists.
    assert json.dumps(foreign[1]).replace("acme-support", "X") == json.dumps(unknown[1]).replace(
        "no-such-adapter", "X")
    assert _complete(guard, "bulk", "tiny")[0] == 404  # its list leaves out the base model too


def test_models_lists_only_the_tenants_models(guard: GuardThread) -> None:
    assert {c["id"] for c in _get(guard, "acme", "/v1/models")[1]["data"]} == {"tiny", "acme-support"}
    assert {c["id"] for c in _get(guard, "globex", "/v1/models")[1]["data"]} == {"tiny", "acme-support",
                                                                                 "bulk-legal"}
    assert _get(guard, "acme", "/v1/models/acme-support")[1]["parent"] == "tiny"
    foreign, unknown = _get(guard, "acme", "/v1/models/bulk-legal"), _get(guard, "acme", "/v1/models/nope")
    assert foreign[0] == unknown[0] == 404
    assert json.dumps(foreign[1]).replace("bulk-legal", "X") == json.dumps(unknown[1]).replace("nope", "X")


def test_the_adapter_scorer_prefers_where_the_adapter_is_resident() -> None:
    pool = pool_of([100, 100, 100])
    served = {"e0": ([], []), "e1": (["a"], ["a"]), "e2": ([], ["a"])}  # name -> (resident, available)
    for replica in pool.replicas:
        resident, available = served[replica.name]
        replica.gate.update(snapshot().model_copy(update={"loras": resident, "loras_available": available}))
    profile = profile_for(Routing.model_validate({"profile": {"scorers": [{"name": "adapter", "weight": 1}]}}))
    ranked = profile.rank(pool.replicas, Request(4, [], lora="a"))
    assert [(c.replica.name, c.scores["adapter"]) for c in ranked] == [("e1", 1.0), ("e2", 0.5), ("e0", 0.0)]
    assert {c.scores["adapter"] for c in profile.rank(pool.replicas, Request(4, []))} == {1.0}


def test_prompt_hashes_are_keyed_by_the_adapter() -> None:
    ids = list(range(40))
    base, adapted = prompt_block_hashes(ids, 16, "salt"), prompt_block_hashes(ids, 16, "salt", "a")
    assert len(base) == len(adapted) == 2 and not set(base) & set(adapted)
    assert prompt_block_hashes(ids, 16, "salt", "a") == adapted
