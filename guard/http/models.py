"""Which models a tenant may use: the tenant key ``models`` (base ids and LoRA adapter names; absent: all).

A model outside the list is refused exactly as a model no engine serves (404 ``model_not_found``, the one
wording of engine/prompting/prompts.py ``model_not_found``), so a tenant cannot tell another tenant's adapter
from a name nobody serves; ``GET /v1/models`` lists only the tenant's models. The adapters the replicas serve
(``TelemetrySnapshot.loras_available``) join the guard's prompt counter, so that a request naming one is
counted locally, as one naming the base model is.
"""

from __future__ import annotations

import json
from collections.abc import Iterable

from engine.prompting.prompts import model_not_found
from engine.protocol import ErrorResponse, TelemetrySnapshot
from guard.config import Tenant
from guard.errors import GuardError
from guard.http.tokens import TokenCounter
from guard.pool.pool import ReplicaPool


def check_model(tenant: Tenant, model: str, pool: ReplicaPool) -> None:
    """``GuardError`` 404 when ``tenant`` may not use ``model``, worded as for a model nobody serves."""
    if tenant.models is not None and model not in tenant.models:
        refusal = model_not_found(model, served_model(pool))
        raise GuardError(refusal.status, str(refusal), param=refusal.param, code=refusal.code)


def adapter_of(model: str, pool: ReplicaPool) -> str | None:
    """The LoRA adapter a request's ``model`` names: None for the base model (its KV is hashed without one)."""
    served = served_model(pool)
    return None if not served or model == served else model


def served_model(replicas: Iterable) -> str:
    """The base model the replicas serve (all serve the same), as their telemetry names it. (A loop, not
    ``next`` over a generator: asked twice on every request.)"""
    for replica in replicas:
        if (snapshot := replica.gate.snapshot) is not None:
            return snapshot.model
    return ""


def visible_models(tenant: Tenant, path: str, status: int, body: bytes, pool: ReplicaPool) -> tuple[int, bytes]:
    """An engine's ``/v1/models`` (or ``/v1/models/{id}``) answer as ``tenant`` may see it."""
    if tenant.models is None or status != 200:
        return status, body
    answer = json.loads(body)
    if path.rstrip("/") == "/v1/models":
        answer["data"] = [card for card in answer.get("data", []) if card.get("id") in tenant.models]
        return status, json.dumps(answer).encode()
    if answer.get("id") in tenant.models:
        return status, body
    refusal = model_not_found(answer.get("id", ""), served_model(pool))
    error = ErrorResponse.of(refusal.status, str(refusal), param=refusal.param, code=refusal.code)
    return refusal.status, error.model_dump_json().encode()


def learn_adapters(counter: TokenCounter, snapshot: TelemetrySnapshot) -> None:
    """Let the prompt counter accept the adapters a replica serves (they share the base's tokenizer). Names
    are only added: one a replica unloads is refused by the engine itself (404), as any unknown model."""
    if snapshot.loras_available and not counter.adapters.issuperset(snapshot.loras_available):
        counter.adapters = counter.adapters.union(snapshot.loras_available)
        if counter.local is not None:
            counter.local.adapters = counter.adapters
