"""A fast stand-in for the engine: just enough of its HTTP API for the guard, answered from memory.

bench/guard_overhead.py puts a proxy (the guard, nginx, or none) in front of it, so that what the proxy
adds is not hidden behind model time. A completion of a given length is the same bytes every time, so
relayed bodies can be compared byte for byte.

- ``GET /health``: 200 (the guard's health checks feed its circuit breaker).
- ``GET /telemetry/stream``: SSE of ``TelemetrySnapshot`` JSON, 20 per second (the engine's cadence while
  busy), with a pool so large that admission never waits.
- ``GET /tokenizer``: a byte tokenizer (one token per prompt byte), which the guard then runs itself;
  ``POST /tokenize``: ``{"count", "max_model_len", "tokens"}`` counted the same way, for clients that ask.
- ``POST /v1/completions``: non-streaming, one JSON completion of ``max_tokens`` tokens; streaming,
  ``max_tokens`` token events then ``data: [DONE]``, each event written on its own, ``interval_ms``
  (a body field the proxies pass through untouched) apart: 0 sends them back to back. With
  ``return_token_ids`` (a guard asks for it to move a stream), each event comes after its token id comment.

    .venv/bin/python bench/fast_upstream.py --port 8200
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import time

from aiohttp import web

from engine.prompting.chat_template import DEFAULT_TEMPLATE
from engine.protocol import TelemetrySnapshot, TokenizerInfo

NUM_BLOCKS = 1 << 24  # admission never limits
MAX_MODEL_LEN = 1 << 20
SNAPSHOT_INTERVAL_S = 0.05
# A token event as the engine writes it, ``"usage":null`` included (its chunks carry the key once usage was asked
# for, as OpenAI's do, and the guard asks for it on every stream): the bytes the guard's stream path reads.
EVENT = b'data: {"id":"cmpl-bench","object":"text_completion","created":0,"model":"tiny","choices":' \
        b'[{"index":0,"text":"x","logprobs":null,"finish_reason":null}],"usage":null}\n\n'
DONE = b"data: [DONE]\n\n"


def snapshot() -> bytes:
    reading = TelemetrySnapshot(
        time=time.time(), step=0, model="tiny", block_size=16, num_blocks=NUM_BLOCKS, free_blocks=NUM_BLOCKS,
        cached_blocks=0, swap_blocks=0, swap_used_blocks=0, num_running=0, num_waiting=0, num_swapped=0,
        preemptions_total=0, preemptions_recompute_total=0, preemptions_swap_total=0,
        prefix_cache_queries_total=0, prefix_cache_hits_total=0, prompt_tokens_total=0,
        generation_tokens_total=0, step_time_s=0.0, itl_s=0.0, tokens_per_s=0.0, bytes_moved_per_s=0.0,
        peak_bandwidth_bytes_per_s=1.0, bandwidth_utilization=0.0, healthy=True)
    return b"data: " + reading.model_dump_json().encode() + b"\n\n"


@functools.cache
def event_with_ids(token: int) -> bytes:
    """A token event after its id comment, built once: the guard that asked for ids costs this process no
    more per event than the one that did not (the two share it in bench/guard_ab.py)."""
    return b": token_ids 0 %d\n" % (120 + token) + EVENT


@functools.cache
def completion_body(tokens: int) -> bytes:
    return json.dumps({
        "id": "cmpl-bench", "object": "text_completion", "created": 0, "model": "tiny",
        "choices": [{"index": 0, "text": "x" * tokens, "logprobs": None, "finish_reason": "length"}],
        "usage": {"prompt_tokens": 8, "completion_tokens": tokens, "total_tokens": 8 + tokens},
    }).encode()


async def health(_: web.Request) -> web.Response:
    return web.json_response({"status": "ready"})


async def telemetry_stream(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    try:
        while True:
            await response.write(snapshot())
            await asyncio.sleep(SNAPSHOT_INTERVAL_S)
    except ConnectionError:
        return response


async def kv_events(request: web.Request) -> web.StreamResponse:
    """An empty prefix cache (docs/kv_events.md): the snapshot, then heartbeats, as an idle engine sends."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    try:
        await response.write(b'event: snapshot\ndata: {"seq": 0, "block_size": 16, "hashes": []}\n\n')
        while True:
            await asyncio.sleep(0.5)
            await response.write(b": heartbeat\n\n")
    except ConnectionError:
        return response


async def tokenizer(_: web.Request) -> web.Response:
    info = TokenizerInfo(model="tiny", max_model_len=MAX_MODEL_LEN, kind="bytes", chat_template=DEFAULT_TEMPLATE)
    return web.Response(text=info.model_dump_json(), content_type="application/json")


async def tokenize(request: web.Request) -> web.Response:
    body = await request.json()
    count = len(str(body.get("prompt", "")).encode())
    return web.json_response({"count": count, "max_model_len": MAX_MODEL_LEN, "tokens": list(range(count))})


async def completions(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    tokens = int(body.get("max_tokens") or 16)
    if not body.get("stream"):
        return web.Response(body=completion_body(tokens), content_type="application/json")
    interval = float(body.get("interval_ms") or 0) / 1e3
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    ids = body.get("return_token_ids") is True  # as an engine does, for a guard that may move the stream
    for token in range(tokens):
        await response.write(event_with_ids(token) if ids else EVENT)
        # A zero sleep still yields, so concurrent streams interleave their events as an engine's do.
        await asyncio.sleep(interval)
    await response.write(DONE)
    await response.write_eof()
    return response


def create_app() -> web.Application:
    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/telemetry/stream", telemetry_stream)
    app.router.add_get("/kv/events", kv_events)
    app.router.add_get("/tokenizer", tokenizer)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/v1/completions", completions)
    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    web.run_app(create_app(), host="127.0.0.1", port=args.port, print=None, access_log=None, backlog=4096)


if __name__ == "__main__":
    main()
