"""The engine's HTTP server: the aiohttp app, its telemetry endpoints, and its lifecycle.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``POST /tokenize``, ``GET /tokenizer`` (``openai_api``),
``POST /v1/responses``, ``GET|DELETE /v1/responses/{id}`` (``responses``, tenant-scoped stored responses; and
``GET /v1/responses/{id}/conversation``, what the guard continues a stored response with),
``GET /v1/models``, ``GET /v1/models/{id}`` (404 ``model_not_found`` for any id but the served one), ``GET /health`` (200 ready, 503 loading/draining/degraded/failed/stopped), ``GET /telemetry``
(one snapshot), ``GET /telemetry/stream`` (SSE snapshots), ``GET /kv/events`` (SSE of the prefix cache's block
hashes, ``kv_events``) and ``GET /metrics`` (Prometheus). ``/telemetry`` and ``/metrics`` answer within
``SCRAPE_WAIT_S`` even during a long step, with the newest published reading.

``/telemetry/stream`` sends snapshots as its only events (until an ``error`` event ends it when the engine
stops), with heartbeat comments between them, and never waits for a step to end to send either:

- ``data: <TelemetrySnapshot JSON>``: one at the first step boundary after connecting, then each one the
  engine publishes (every ``PUBLISH_INTERVAL_S`` while busy, see async_engine), and a refresh every
  ``REFRESH_S`` when nothing was published, so that an idle engine is never taken for a stale one.
- ``: busy {"step": N, "step_running_s": S}``, a busy heartbeat: every ``HEARTBEAT_S`` while one step runs
  and no snapshot can be had (a long prefill). ``S`` is how long the running step has run; ``N`` is the
  ``step`` of the last snapshot sent on this stream (null before the first), the state the engine is still
  in (give or take the steps of one ``PUBLISH_INTERVAL_S``): no later step boundary has been published.
  A subscriber tells a busy engine (``S`` growing) from a hung one (``S`` past its limit) and from a dead
  one (nothing at all).
- ``: heartbeat`` every ``HEARTBEAT_S`` while idle.

Heartbeats are SSE comments, which SSE clients skip, so that every subscriber that reads ``data:`` lines as
snapshots still may; they keep the connection (and proxies on its way) open, and the guard reads the busy ones.

The server listens while the model loads (``/health`` answers 503 ``loading`` meanwhile) and runs with
``handler_cancellation``: a client that disconnects cancels its handler, which aborts its request. On
shutdown the engine stops first, so every open stream ends with an error event instead of holding the
server up.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from engine.config import EngineConfig
from engine.protocol import ModelCard, ModelList, StepProgress
from engine.request_stream import EngineUnavailable
from engine.server import tracing
from engine.server.async_engine import AsyncEngine
from engine.server.errors import ApiError, openai_errors
from engine.server.kv_events import KVEventsHandler
from engine.server.lora_api import LoraHandlers
from engine.server.metrics import EngineReading
from engine.server.openai_api import OpenAIHandlers
from engine.server.response_store import ResponseStore
from engine.server.responses import ResponsesHandlers
from engine.server.sse import open_stream, send_comment, send_data, send_error

# The telemetry stream's cadence (see the module docstring): something every HEARTBEAT_S at most, a snapshot
# every REFRESH_S at most.
HEARTBEAT_S = 0.5
REFRESH_S = 1.0
# /telemetry and /metrics wait this long for the next step boundary, then answer with the newest published
# reading: a scrape must not outlast Prometheus's timeout (and read as a dead engine) during a long step.
SCRAPE_WAIT_S = 1.0
SHUTDOWN_TIMEOUT_S = 5.0


def create_app(engine: AsyncEngine, store: ResponseStore | None = None) -> web.Application:
    """The app for ``engine``, keeping stored responses in ``store`` (by default one of the default TTL and
    capacity); starting the app starts loading the engine, stopping it stops the engine."""
    openai = OpenAIHandlers(engine)  # the chat template comes with the loaded model
    telemetry = TelemetryHandlers(engine)
    tracing.setup()  # only with OTEL_EXPORTER_OTLP_ENDPOINT set; before the middlewares are chosen
    # Tracing outermost, so that its span sees the status openai_errors answered with.
    app = web.Application(middlewares=[tracing.trace_completions, openai_errors] if tracing.ENABLED
                          else [openai_errors])
    app.router.add_post("/v1/completions", openai.completions)
    app.router.add_post("/v1/chat/completions", openai.chat_completions)
    app.router.add_post("/tokenize", openai.tokenize)
    app.router.add_get("/tokenizer", openai.tokenizer)
    responses = ResponsesHandlers(openai, store if store is not None else ResponseStore())
    app.router.add_post("/v1/responses", responses.create)
    app.router.add_get("/v1/responses/{id}", responses.retrieve)
    app.router.add_delete("/v1/responses/{id}", responses.delete)
    app.router.add_get("/v1/responses/{id}/conversation", responses.conversation)
    app.router.add_get("/v1/models", telemetry.models)
    app.router.add_get("/v1/models/{id:.+}", telemetry.model)  # ids may hold a slash ("org/name")
    app.router.add_get("/health", telemetry.health)
    app.router.add_get("/telemetry", telemetry.snapshot)
    app.router.add_get("/telemetry/stream", telemetry.stream)
    app.router.add_get("/metrics", telemetry.metrics)
    app.router.add_get("/kv/events", KVEventsHandler(engine.kv_events).stream)
    lora = LoraHandlers(engine)
    app.router.add_post("/v1/load_lora_adapter", lora.load)
    app.router.add_post("/v1/unload_lora_adapter", lora.unload)

    async def start(_: web.Application) -> None:
        engine.start()

    async def stop(_: web.Application) -> None:
        await engine.shutdown()
        await asyncio.to_thread(tracing.shutdown)  # the last batch is sent off the event loop

    app.on_startup.append(start)
    app.on_shutdown.append(stop)
    return app


class TelemetryHandlers:
    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        self.started = int(time.time())
        self._last_json: tuple[EngineReading | None, str] = (None, "")

    async def health(self, _: web.Request) -> web.Response:
        status = self.engine.status
        return web.json_response({"status": status}, status=200 if self.engine.healthy else 503)

    async def models(self, _: web.Request) -> web.Response:
        return web.Response(text=ModelList(data=self._cards()).model_dump_json(), content_type="application/json")

    async def model(self, http: web.Request) -> web.Response:
        """One model's card, as OpenAI's ``GET /v1/models/{id}``: the served model and its adapters have one."""
        cards, model_id = self._cards(), http.match_info["id"]
        card = next((card for card in cards if card.id == model_id), None)
        if card is None:
            raise ApiError(404, f"model: {model_id!r} is not served here; this engine serves {cards[0].id!r}",
                           param="model", code="model_not_found")
        return web.Response(text=card.model_dump_json(), content_type="application/json")

    def _cards(self) -> list[ModelCard]:
        """The base model's card, then each LoRA adapter's with ``parent`` naming the base, as vLLM lists them."""
        core = self.engine.core
        base = ModelCard(id=core.model_name, created=self.started, max_model_len=core.max_model_len)
        adapters = core.loras.names() if core.loras is not None else []
        return [base] + [ModelCard(id=name, created=self.started, max_model_len=core.max_model_len,
                                   parent=core.model_name) for name in adapters]

    async def snapshot(self, _: web.Request) -> web.Response:
        reading = await self.engine.recent_reading(SCRAPE_WAIT_S)
        return web.Response(text=self._json(reading), content_type="application/json")

    async def metrics(self, _: web.Request) -> web.Response:
        try:
            reading = await self.engine.recent_reading(SCRAPE_WAIT_S)
        except EngineUnavailable:
            reading = None  # still loading, or gone: the scrape says so with engine_healthy 0
        return web.Response(body=self.engine.metrics.render(reading), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def stream(self, http: web.Request) -> web.StreamResponse:
        """SSE of snapshots, with busy heartbeats during long steps and idle ones between (module docstring).
        Readings are asked for with ``refresh()``, never awaited, so a long step never silences the stream."""
        response = await open_stream(http)
        loop = asyncio.get_running_loop()
        try:
            with self.engine.subscription():
                newest = self.engine.published  # what is already out there: only newer readings are sent
                sent: EngineReading | None = None
                self.engine.refresh()  # the first snapshot: the state at the next step boundary
                sent_at = loop.time()
                while True:
                    reading = await self.engine.next_reading(newest, HEARTBEAT_S)
                    if reading is not None:
                        await send_data(response, self._json(reading))
                        newest = sent = reading
                        sent_at = loop.time()
                        continue
                    if (running_s := self.engine.step_running_s) is not None:
                        step = sent.snapshot.step if sent is not None else None
                        progress = StepProgress(step=step, step_running_s=round(running_s, 3))
                        await send_comment(response, "busy " + progress.model_dump_json())
                    else:
                        await send_comment(response, "heartbeat")
                        # (A running step publishes a reading as it ends: nothing to ask for meanwhile.)
                        if loop.time() - sent_at >= REFRESH_S:
                            self.engine.refresh()
        except EngineUnavailable as exc:
            with contextlib.suppress(ConnectionResetError):  # at shutdown the subscriber may be gone already
                await send_error(response, ApiError.from_engine(exc))
        except ConnectionResetError:
            pass  # the subscriber left
        return response

    def _json(self, reading: EngineReading) -> str:
        """The snapshot as JSON, serialized once however many subscribers send it."""
        if self._last_json[0] is not reading:
            self._last_json = (reading, reading.snapshot.model_dump_json())
        return self._last_json[1]


class EngineServer:
    """An ``AsyncEngine`` behind its app on ``host:port`` (port 0 picks a free one): what ``python -m engine``
    runs, and what the tests start in-process."""

    def __init__(self, config: EngineConfig, store: ResponseStore | None = None) -> None:
        self.engine = AsyncEngine(config)
        self.runner = web.AppRunner(create_app(self.engine, store), handler_cancellation=True, access_log=None,
                                    shutdown_timeout=SHUTDOWN_TIMEOUT_S)
        self.url = ""

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Listen (the model loads in the background) and return the base URL."""
        await self.runner.setup()
        site = web.TCPSite(self.runner, host, port)
        await site.start()
        bound_host, bound_port = self.runner.addresses[0][:2]
        self.url = f"http://[{bound_host}]:{bound_port}" if ":" in bound_host else f"http://{bound_host}:{bound_port}"
        return self.url

    async def wait_ready(self) -> None:
        await self.engine.wait_ready()

    async def drain(self, timeout: float) -> int:
        """SIGTERM: /health turns 503 ``draining``, new requests 503 ``engine_draining``; the requests in
        flight finish within ``timeout`` seconds, and those still running then end with the error
        ``resume_elsewhere`` (a guard resumes them on another replica). Returns how many ended so."""
        self.engine.start_draining()
        return await self.engine.drain(timeout)

    async def stop(self) -> None:
        await self.runner.cleanup()
