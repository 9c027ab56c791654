"""A closed-loop HTTP load generator in Python, for machines without ``wrk``: the same model and report.

``--connections`` clients each send the next request as soon as the previous answer has been read to its
end (for a stream, through ``[DONE]``), for ``--duration`` seconds, the first one after a random
0..``--stagger`` seconds. It prints one line, ``RESULT {json}``,
with the fields bench/guard_overhead.py reads from wrk: requests completed, duration, bytes, errors
(non-2xx counted as ``status``) and latency percentiles in microseconds. Being Python, it saturates long
before wrk does; the report says which generator produced a figure.

    .venv/bin/python bench/http_load.py --url URL --body-file body.json --header "Authorization: Bearer k"
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from pathlib import Path

import aiohttp
from latency import summarize


async def client(session: aiohttp.ClientSession, url: str, body: bytes, until: float, latencies: list[float],
                 counts: dict[str, int], stagger: float) -> None:
    await asyncio.sleep(random.uniform(0.0, stagger))
    while (start := time.perf_counter()) < until:
        try:
            async with session.post(url, data=body) as response:
                counts["bytes"] += len(await response.read())
                if response.status >= 300:
                    counts["status"] += 1
        except aiohttp.ClientError:
            counts["read"] += 1
            continue
        latencies.append(time.perf_counter() - start)


async def run(args: argparse.Namespace) -> dict:
    headers = dict(h.split(": ", 1) for h in args.header)
    headers.setdefault("Content-Type", "application/json")
    body = Path(args.body_file).read_bytes()
    latencies: list[float] = []
    counts = {"bytes": 0, "status": 0, "read": 0}
    connector = aiohttp.TCPConnector(limit=args.connections)
    async with aiohttp.ClientSession(connector=connector, headers=headers,
                                     timeout=aiohttp.ClientTimeout(total=args.timeout)) as session:
        start = time.perf_counter()
        until = start + args.duration
        await asyncio.gather(*(client(session, args.url, body, until, latencies, counts, args.stagger)
                               for _ in range(args.connections)))
        elapsed = time.perf_counter() - start
    figures = summarize(latencies)
    return {"requests": len(latencies), "duration_us": int(elapsed * 1e6), "bytes": counts["bytes"],
            "errors": {"connect": 0, "read": counts["read"], "write": 0, "status": counts["status"],
                       "timeout": 0},
            "latency_us": {key: 1e3 * (figures[f"{key}_ms"] or 0.0)
                           for key in ("mean", "p50", "p90", "p99", "max")}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", required=True)
    parser.add_argument("--body-file", required=True)
    parser.add_argument("--header", action="append", default=[], help="'Name: value', repeatable")
    parser.add_argument("--connections", type=int, default=64)
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument("--timeout", type=float, default=30.0)
    parser.add_argument("--stagger", type=float, default=0.0,
                        help="each connection's first request waits a random 0..stagger seconds")
    print("RESULT", json.dumps(asyncio.run(run(parser.parse_args()))), flush=True)


if __name__ == "__main__":
    main()
