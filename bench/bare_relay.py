"""The least an aiohttp proxy can do: a reference point for bench/guard_overhead.py, not a product.

One aiohttp server, one ``ClientSession`` with a keep-alive pool, and per request exactly what any aiohttp
proxy must do: read the body, POST it upstream, and copy the answer back (whole, or chunk by chunk for an
event stream). No auth, validation, token counting, queueing, admission, timeouts or metrics. What it
costs per request is the floor of the guard's cost on the same machine, so the guard's figure minus this
one is what the guard's own decisions cost.

    .venv/bin/python bench/bare_relay.py --port 8300 --upstream http://127.0.0.1:8200
"""

from __future__ import annotations

import argparse
import gc

import aiohttp
from aiohttp import web

UPSTREAM = web.AppKey("upstream", str)
SESSION = web.AppKey("session", aiohttp.ClientSession)


async def relay(request: web.Request) -> web.StreamResponse:
    body = await request.read()
    headers = {"Content-Type": "application/json", "Accept-Encoding": "identity"}
    async with request.app[SESSION].post(request.app[UPSTREAM] + request.path, data=body,
                                         headers=headers) as upstream:
        if not upstream.content_type.startswith("text/event-stream"):
            return web.Response(body=await upstream.read(), status=upstream.status,
                                content_type=upstream.content_type)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        while chunk := await upstream.content.readany():
            await response.write(chunk)
        await response.write_eof()
        return response


async def health(_: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


def create_app(upstream: str) -> web.Application:
    app = web.Application()
    app[UPSTREAM] = upstream.rstrip("/")

    async def session(app: web.Application):
        connector = aiohttp.TCPConnector(limit=4096, limit_per_host=0)
        async with aiohttp.ClientSession(connector=connector, auto_decompress=False,
                                         cookie_jar=aiohttp.DummyCookieJar()) as client:
            app[SESSION] = client
            yield

    app.cleanup_ctx.append(session)
    app.router.add_post("/v1/completions", relay)
    app.router.add_get("/health", health)
    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", required=True)
    args = parser.parse_args()
    app = create_app(args.upstream)
    gc.freeze()  # as the guard does (guard/__main__.py), collector threshold included
    gc.set_threshold(10_000, *gc.get_threshold()[1:])
    web.run_app(app, host="127.0.0.1", port=args.port, print=None, access_log=None)


if __name__ == "__main__":
    main()
