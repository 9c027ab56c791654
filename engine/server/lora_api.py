"""Loading and unloading LoRA adapters while the engine runs, in vLLM's shapes:
``POST /v1/load_lora_adapter {"lora_name", "lora_path"}`` and ``POST /v1/unload_lora_adapter {"lora_name"}``.

Both are refused (403 ``runtime_lora_disabled``) unless the engine runs with ``--allow-runtime-lora``: an
adapter is code-like input (it changes every answer of its name), so an operator opts in. A bad adapter is a
400 with the loader's one-line error, and nothing is loaded. The adapter is read off the event loop; the
registry is safe to change while the engine steps (engine/model/lora.py), and a request already running
with an adapter keeps it through an unload.
"""

from __future__ import annotations

import asyncio
from typing import TypeVar

from aiohttp import web
from pydantic import BaseModel, ConfigDict, ValidationError

from engine.model.lora import LoraError, LoraRegistry
from engine.server.async_engine import AsyncEngine
from engine.server.errors import ApiError

Body = TypeVar("Body", bound=BaseModel)


class LoadLoraRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: str
    lora_path: str


class UnloadLoraRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: str


class LoraHandlers:
    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine

    async def load(self, http: web.Request) -> web.Response:
        body = await _parse(http, LoadLoraRequest)
        registry, base = self._registry()
        try:
            await asyncio.to_thread(registry.load, body.lora_name, body.lora_path, {base})
        except LoraError as exc:
            raise ApiError(400, str(exc), param="lora_path", code="invalid_lora_adapter") from None
        return web.Response(text=f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    async def unload(self, http: web.Request) -> web.Response:
        body = await _parse(http, UnloadLoraRequest)
        registry, _ = self._registry()
        try:
            registry.unload(body.lora_name)
        except LoraError as exc:
            raise ApiError(404, str(exc), param="lora_name", code="lora_not_found") from None
        return web.Response(text=f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    def _registry(self) -> tuple[LoraRegistry, str]:
        core = self.engine.core  # EngineUnavailable (503) while loading
        if not core.config.allow_runtime_lora or core.loras is None:
            raise ApiError(403, "runtime LoRA loading is disabled: start the engine with --allow-runtime-lora",
                           code="runtime_lora_disabled")
        return core.loras, core.model_name


async def _parse(http: web.Request, model: type[Body]) -> Body:
    try:
        return model.model_validate_json(await http.read())
    except ValidationError as exc:
        raise ApiError.from_validation(exc) from None
