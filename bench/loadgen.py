"""Closed-loop HTTP load from a separate process: ``wrk`` when installed, else bench/http_load.py.

Both take the same request (a POST body and headers), keep ``connections`` requests in flight for
``duration`` seconds and report the same fields: ``requests``, ``duration_us``, ``bytes``, ``errors``
(``status`` counts non-2xx answers) and ``latency_us`` (``mean``, ``p50``, ``p90``, ``p99``, ``max``) of
whole responses, a stream's included up to its last byte. wrk's figures come from a Lua ``done`` hook.

``stagger`` delays each connection's first request by a random 0..stagger seconds. Closed-loop streams of
one length that all start at once stay in lockstep, and a proxy then sees every stream begin in the same
few milliseconds: a burst no real population of streams produces, whose queueing would dominate p99.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

from stack import REPO, pinned

# wrk calls done() once at the end; the percentiles come from its HdrHistogram (microseconds).
WRK_SCRIPT = """
wrk.method = "POST"
wrk.body = [==[{body}]==]
{headers}
{stagger}
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'RESULT {{"requests": %d, "duration_us": %d, "bytes": %d, ' ..
    '"errors": {{"connect": %d, "read": %d, "write": %d, "status": %d, "timeout": %d}}, ' ..
    '"latency_us": {{"mean": %.1f, "p50": %d, "p90": %d, "p99": %d, "max": %d}}}}\\n',
    summary.requests, summary.duration, summary.bytes, e.connect, e.read, e.write, e.status, e.timeout,
    latency.mean, latency:percentile(50), latency:percentile(90), latency:percentile(99), latency.max))
end
"""
# wrk asks delay() (ms) before every request; only the first one of each connection is randomized.
WRK_STAGGER = """
local started = 0
delay = function()
  started = started + 1
  if started <= {connections} then return math.random(0, {stagger_ms}) end
  return 0
end
"""


def generator() -> str:
    """``wrk`` if it is on PATH, else ``python`` (bench/http_load.py)."""
    return "wrk" if shutil.which("wrk") else "python"


def run_load(kind: str, url: str, body: bytes, headers: dict[str, str], connections: int, duration: float,
             workdir: Path, cpus: str | None, stagger: float = 0.0) -> dict:
    """Run one load and return its result (see the module docstring); raises if the generator failed."""
    headers = {"Content-Type": "application/json", **headers}
    if kind == "wrk":
        # A file of its own: loads run side by side (bench/guard_overhead.py) would otherwise rewrite the
        # script under each other (a wrk that read it half-written sent bare GETs and printed no RESULT).
        script = workdir / f"load-{uuid.uuid4().hex[:8]}.lua"
        lines = "\n".join(f'wrk.headers["{name}"] = "{value}"' for name, value in headers.items())
        stagger_hook = WRK_STAGGER.format(connections=connections, stagger_ms=round(stagger * 1e3)) \
            if stagger else ""
        script.write_text(WRK_SCRIPT.format(body=body.decode(), headers=lines, stagger=stagger_hook))
        command = ["wrk", "-t1", f"-c{connections}", f"-d{max(1, round(duration))}s", "--timeout", "30s",
                   "-s", str(script), url]
    else:
        body_file = workdir / f"body-{uuid.uuid4().hex[:8]}.json"
        body_file.write_bytes(body)
        command = [sys.executable, str(REPO / "bench" / "http_load.py"), "--url", url, "--body-file",
                   str(body_file), "--connections", str(connections), "--duration", str(duration),
                   "--stagger", str(stagger),
                   *(arg for name, value in headers.items() for arg in ("--header", f"{name}: {value}"))]
    done = subprocess.run(pinned(command, cpus), capture_output=True, text=True, timeout=duration + 60,
                          check=False)
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise RuntimeError(f"{kind} failed (exit status {done.returncode}):\n{done.stdout}\n{done.stderr}")
