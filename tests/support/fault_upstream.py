"""A fake engine that misbehaves on request, for the reliability tests' upstream faults.

It is a fake because those faults cannot be produced otherwise: the real engine never answers with HTML or
with bytes that are not HTTP, never dies after exactly N events or holds back its first token on demand,
and its streams end at its 2048-token window, far inside the socket buffers a slow reader has to fill
before the guard notices it. Everything else answers the way the engine does (``/health``, ``/v1/models``,
``/tokenize`` with one token per prompt byte, ``/telemetry`` and ``/telemetry/stream``), so the guard
treats it as one. Every test that does not need a fault uses the real engine.

A completion misbehaves as its body's ``fault`` field says (the guard forwards fields it does not own
untouched, so concurrent requests can each fail their own way); without one it answers ``max_tokens``
token events then ``[DONE]`` (streamed) or one completion (unary):

- ``{"kind": "die_after", "events": N}``: N token events, then the connection closes mid-body (no final chunk).
- ``{"kind": "stall_after", "events": N}``: N token events, then silence on an open connection.
- ``{"kind": "first_token_delay", "seconds": S}``: headers at once, the first event S seconds later (for a
  unary request, the whole answer S seconds later, as the engine sends nothing before it is done).
- ``{"kind": "steady", "events": N, "interval": S}``: N events S seconds apart, then ``[DONE]``.
- ``{"kind": "endless"}``: events as fast as the connection takes them until the reader leaves.
- ``{"kind": "html", "status": C}``: an HTML error page with status C, as a misrouted load balancer sends.
- ``{"kind": "garbage"}``: random bytes labelled ``application/json``.
- ``{"kind": "not_http"}``: bytes that are not an HTTP response at all, then the connection closes.
- ``{"kind": "truncated"}``: a JSON answer whose connection closes halfway through the promised body.
- ``{"kind": "set_cookie", "value": V}``: a normal unary answer that also sets the cookie ``session=V``.

``refuse_after_tokenize()`` closes the listening socket right after the next ``/tokenize`` answer (open
connections, the telemetry stream among them, stay up), so the completion that follows is refused before a
byte of it is sent. Every answer but a stream closes its connection, so no idle keep-alive connection lets a
request slip past a closed listener.

Accounting mirrors the engine's, so the same "nothing lost" checks apply: each completion in flight holds
one block of ``NUM_BLOCKS`` in ``/telemetry`` until its handler ends, which for a stream is when either side
closes the connection.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections import Counter
from typing import Any

from aiohttp import web

from engine.protocol import TelemetrySnapshot

from .loop_thread import AppThread

NUM_BLOCKS = 4096
MAX_MODEL_LEN = 2048
SNAPSHOT_INTERVAL_S = 0.05


def token_event(index: int, padding: int = 0) -> bytes:
    """Token event ``index``: its bytes depend on nothing else, so a test can rebuild what it should get."""
    chunk = {"id": "cmpl-fake", "object": "text_completion", "created": 0, "model": "tiny",
             "choices": [{"index": 0, "text": f" t{index}" + "x" * padding, "logprobs": None, "finish_reason": None}]}
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


DONE = b"data: [DONE]\n\n"
HTML = b"<html><head><title>502 Bad Gateway</title></head><body><center><h1>502 Bad Gateway</h1></center>" \
       b"<hr><center>nginx</center></body></html>\n"


class FaultUpstream(AppThread):
    """The fake on a loopback port, served from its own event-loop thread (``with FaultUpstream() as up``)."""

    def __init__(self) -> None:
        super().__init__("fault-upstream", handler_cancellation=True, access_log=None)
        self.received: Counter[str] = Counter()  # path -> requests that reached a handler
        self.bodies: list[dict[str, Any]] = []  # every completion body, in arrival order
        self.headers: list[dict[str, str]] = []  # and its headers
        self.active = 0  # completion handlers running
        self.bytes_sent = 0  # body bytes of completions written (each write waits until the socket takes it)
        self._refuse_after_tokenize = False

    # -- what a test does (from its own thread) -----------------------------------------------------------
    def accept_connections(self) -> None:
        """Listen again on the same port."""
        self.run(self.listen(), timeout=30)

    def refuse_connections(self) -> None:
        """Close the listening socket; connections already open stay up."""
        self.run(self.stop_listening(), timeout=30)

    def refuse_after_tokenize(self) -> None:
        self._refuse_after_tokenize = True

    def telemetry(self) -> dict[str, Any]:
        return json.loads(self._snapshot().model_dump_json())

    # -- the app ------------------------------------------------------------------------------------------
    def make_app(self) -> web.Application:
        @web.middleware
        async def one_request_per_connection(request: web.Request, handler: Any) -> web.StreamResponse:
            response = await handler(request)
            if not response.prepared:
                response.force_close()
            return response

        app = web.Application(middlewares=[one_request_per_connection])
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/telemetry", self._telemetry)
        app.router.add_get("/telemetry/stream", self._telemetry_stream)
        app.router.add_post("/tokenize", self._tokenize)
        app.router.add_post("/v1/completions", self._completions)
        return app

    def _snapshot(self) -> TelemetrySnapshot:
        return TelemetrySnapshot(
            time=time.time(), step=0, model="tiny", block_size=16, num_blocks=NUM_BLOCKS,
            free_blocks=NUM_BLOCKS - self.active, cached_blocks=0, swap_blocks=0, swap_used_blocks=0,
            num_running=self.active, num_waiting=0, num_swapped=0, preemptions_total=0,
            preemptions_recompute_total=0, preemptions_swap_total=0, prefix_cache_queries_total=0,
            prefix_cache_hits_total=0, prompt_tokens_total=0, generation_tokens_total=0, step_time_s=0.0,
            itl_s=0.0, tokens_per_s=0.0, bytes_moved_per_s=0.0, peak_bandwidth_bytes_per_s=1.0,
            bandwidth_utilization=0.0, healthy=True)

    async def _health(self, _: web.Request) -> web.Response:
        return web.json_response({"status": "ready"})

    async def _models(self, _: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "tiny", "object": "model", "created": 0,
                                                              "owned_by": "fake", "max_model_len": MAX_MODEL_LEN}]})

    async def _telemetry(self, _: web.Request) -> web.Response:
        return web.Response(text=self._snapshot().model_dump_json(), content_type="application/json")

    async def _telemetry_stream(self, request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        try:
            while True:
                await response.write(b"data: " + self._snapshot().model_dump_json().encode() + b"\n\n")
                await asyncio.sleep(SNAPSHOT_INTERVAL_S)
        except ConnectionError:
            return response

    async def _tokenize(self, request: web.Request) -> web.Response:
        self.received[request.path] += 1
        body = await request.json()
        count = len(str(body.get("prompt", "")).encode())
        if self._refuse_after_tokenize:
            self._refuse_after_tokenize = False
            await self.stop_listening()
        return web.json_response({"count": count, "max_model_len": MAX_MODEL_LEN, "tokens": list(range(count))})

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        self.received[request.path] += 1
        body = await request.json()
        self.bodies.append(body)
        self.headers.append(dict(request.headers))
        self.active += 1
        try:
            return await self._answer(request, body, body.get("fault") or {})
        finally:
            self.active -= 1

    async def _answer(self, request: web.Request, body: dict[str, Any], fault: dict[str, Any]) -> web.StreamResponse:
        kind = fault.get("kind")
        if kind == "html":
            return web.Response(body=HTML, status=fault.get("status", 200), content_type="text/html")
        if kind == "garbage":
            return web.Response(body=os.urandom(512), content_type="application/json")
        if kind == "not_http":
            assert request.transport is not None
            request.transport.write(b"SSH-2.0-OpenSSH_9.2\r\n\x00\x01garbage\r\n\r\n")
            request.transport.close()
            return web.Response()  # never sent: the connection is gone
        if kind == "truncated":
            response = web.StreamResponse(headers={"Content-Type": "application/json", "Content-Length": "400"})
            await response.prepare(request)
            await response.write(b'{"id": "cmpl-fake", "object": "text_completion", "choices": [')
            assert request.transport is not None
            request.transport.close()
            return response
        if kind == "first_token_delay" and not body.get("stream"):
            await asyncio.sleep(fault["seconds"])
        if not body.get("stream"):
            tokens = int(body.get("max_tokens") or 16)
            headers = {"Set-Cookie": f"session={fault['value']}; Path=/"} if kind == "set_cookie" else None
            return web.json_response(headers=headers, data={
                "id": "cmpl-fake", "object": "text_completion", "created": 0, "model": "tiny",
                "choices": [{"index": 0, "text": "".join(f" t{i}" for i in range(tokens)), "logprobs": None,
                             "finish_reason": "length"}],
                "usage": {"prompt_tokens": 1, "completion_tokens": tokens, "total_tokens": tokens + 1}})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        response.force_close()
        await response.prepare(request)
        try:
            await self._stream(request, response, body, fault)
        except ConnectionError:
            pass  # the guard left
        return response

    async def _stream(self, request: web.Request, response: web.StreamResponse, body: dict[str, Any],
                      fault: dict[str, Any]) -> None:
        kind = fault.get("kind")
        if kind == "first_token_delay":
            await asyncio.sleep(fault["seconds"])
        events = fault.get("events", int(body.get("max_tokens") or 16))
        index = 0
        while kind == "endless" or index < events:
            # Endless events are big, so that filling a slow reader's socket buffers takes few writes.
            await self._write(response, token_event(index, padding=4096 if kind == "endless" else 0))
            index += 1
            if kind == "steady":
                await asyncio.sleep(fault["interval"])
        if kind == "die_after":  # as a killed process's socket closes: what was sent arrives, then EOF
            assert request.transport is not None
            request.transport.close()
            return
        if kind == "stall_after":
            await asyncio.Event().wait()  # until the guard gives up and closes the connection
        await self._write(response, DONE)
        await response.write_eof()

    async def _write(self, response: web.StreamResponse, data: bytes) -> None:
        await response.write(data)
        self.bytes_sent += len(data)
