"""nginx as the reference reverse proxy: one worker, keep-alive to the upstream, no buffering, no logs.

The configuration is what an operator would write to put nginx in front of an SSE-streaming engine:
HTTP/1.1 with a keep-alive pool to the upstream (``Connection: ""``), ``proxy_buffering off`` so each
event is forwarded as it arrives, and ``access_log off`` (the guard is run without its access log too).

``answers`` makes nginx answer some paths itself, from memory, instead of proxying them: an upstream whose
hot path costs a load-side core next to nothing (bench/guard_scale.py), while everything else (health,
telemetry, tokenizer) is still the Python upstream's.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from stack import Service, free_port, pinned, start

CONFIG = """
worker_processes 1;
daemon off;
pid {workdir}/nginx.pid;
error_log {workdir}/nginx-error.log warn;
events {{ worker_connections 8192; }}
http {{
  access_log off;
  client_body_temp_path {workdir}/client_body;
  proxy_temp_path {workdir}/proxy;
  upstream engine {{ server {upstream}; keepalive 256; }}
  server {{
    listen 127.0.0.1:{port} backlog=4096;{answers}
    location / {{
      proxy_pass http://engine;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;
      proxy_read_timeout 300s;
    }}
  }}
}}
"""


def available() -> bool:
    return shutil.which("nginx") is not None


ANSWER = """
    location = {path} {{
      default_type application/json;
      return 200 '{body}';
    }}"""


def start_nginx(workdir: Path, upstream_url: str, cpus: str | None, answers: dict[str, bytes] | None = None) -> Service:
    """nginx proxying to ``upstream_url``, except the paths in ``answers``: their bodies it sends itself (200,
    JSON, for any method)."""
    port = free_port()
    config = workdir / "nginx.conf"
    upstream = upstream_url.removeprefix("http://")
    for body in (answers or {}).values():  # a quote would end nginx's string, a '$' start a variable
        if b"'" in body or b"$" in body or b"\\" in body:
            raise ValueError(f"nginx cannot return this body verbatim: {body[:80]!r}")
    canned = "".join(ANSWER.format(path=path, body=body.decode()) for path, body in (answers or {}).items())
    config.write_text(CONFIG.format(workdir=workdir, upstream=upstream, port=port, answers=canned))
    error_log = workdir / "nginx-error.log"
    command = pinned(["nginx", "-p", str(workdir), "-e", str(error_log), "-c", str(config)], cpus)
    return start("nginx", command, f"http://127.0.0.1:{port}", workdir)
