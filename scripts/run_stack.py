"""``make run``: the local stack: engine replica e0 on :8100, fallback engine on :8101, guard on :8000.

Every engine serves ``smollm2`` (SmolLM2-135M-Instruct, which ``make setup`` installs), so that a request
the guard degrades to the fallback is still answered in words. The fallback runs on the CPU with a small KV
pool: it is the small engine the guard sheds to, and on a GPU host it must not compete with the replicas
for device memory.

guard.example.yaml names a pool of two replicas, e0 on :8100 and e1 on :8102, which docker-compose.yml and
``make stack`` both run. ``make run`` starts e0 alone, a pool of one: on a CPU a SmolLM2 prefill holds a core
for seconds, so on the two cores of a small machine a second replica competes with the first and with the
fallback instead of adding capacity. ``--engine-port 8100 8102`` starts the whole pool.

Starts the engines side by side (their models load at once), then each other process once every one before
it answers ``/health``; prints the URLs and the demo API keys, and on
Ctrl-C (or when any process dies) stops them all, the guard first so that it drains its streams. The guard
refuses the placeholder secret: unless ``KVGUARD_SECRET`` names one, it gets a random one for this run in
its environment (never in a file), so the tenants' cache salts are new each run, as the engine's cache is.

``--port``, ``--engine-port`` (one port per replica to start, in guard.example.yaml's order),
``--fallback-port`` and ``--admin-port`` (the operator console's) move the stack (the test of ``make run``
runs it on free ports; a stack whose guard port moved puts its console on a free port too, unless
``--admin-port`` names one). Unless the stack is guard.example.yaml's own, the guard runs on a copy whose
listen and admin ports, replicas and fallback URL follow, written to a temporary directory that goes away
with the stack.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "guard.example.yaml"
MODEL = "smollm2"
FALLBACK_BLOCKS = 256  # 4,096 token slots of KV: room for a few short chats while the replicas are away
HEALTH_TIMEOUT_S = 300.0  # per process; loading a model on a busy CPU can take a while
Step = tuple[str, list[str], str]  # (name, command, health URL)


@dataclass(frozen=True, slots=True)
class Ports:
    guard: int = 8000
    engines: tuple[int, ...] = (8100,)  # one per replica started, in guard.example.yaml's order
    fallback: int = 8101
    admin: int = 8001  # the operator console (guard/console)


DEFAULTS = Ports()  # make run
POOL = Ports(engines=(8100, 8102))  # guard.example.yaml's own stack: make stack, docker-compose.yml


def local(port: int) -> str:
    return f"http://127.0.0.1:{port}"


def guard_config(ports: Ports, directory: Path) -> Path:
    """guard.example.yaml itself for its own stack; else a copy in ``directory`` that names only the replicas
    started, and follows ``ports``."""
    if ports == POOL:
        return CONFIG
    config = yaml.safe_load(CONFIG.read_text())
    replicas = config["engines"]
    if len(ports.engines) > len(replicas):
        sys.exit(f"run_stack: {CONFIG.name} names {len(replicas)} replicas, not {len(ports.engines)}")
    config["listen"]["port"] = ports.guard
    if "admin" in config:
        config["admin"]["port"] = ports.admin
    config["engines"] = [{**replica, "url": local(port)} for replica, port in zip(replicas, ports.engines)]
    for fallback in config.get("fallbacks", []):
        if fallback.get("url") == local(POOL.fallback):
            fallback["url"] = local(ports.fallback)
    path = directory / "guard.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def replica_names(config: Path) -> list[str]:
    return [replica["name"] for replica in yaml.safe_load(config.read_text())["engines"]]


def stack(ports: Ports = DEFAULTS, config: Path = CONFIG) -> list[Step]:
    """What ``make run`` starts, in order (stopped in reverse)."""
    engine = [sys.executable, "-m", "engine", "--model", MODEL]
    replicas = [(f"engine-{name}", [*engine, "--port", str(port)], local(port) + "/health")
                for name, port in zip(replica_names(config), ports.engines)]
    return [
        *replicas,
        ("fallback", [*engine, "--port", str(ports.fallback), "--device", "cpu",
                      "--num-blocks", str(FALLBACK_BLOCKS)], local(ports.fallback) + "/health"),
        ("guard", [sys.executable, "-m", "guard", "--config", str(config)], local(ports.guard) + "/health"),
    ]


def console_line(config: dict) -> str:
    """Where the operator console is, as the guard's ``admin:`` puts it ("" without one)."""
    admin = config.get("admin")
    if admin is None:
        return ""
    access = "an admin key required" if admin.get("api_keys") else "loopback, no key"
    url = f"http://{admin.get('host', '127.0.0.1')}:{admin.get('port', DEFAULTS.admin)}/"
    return f"  console    {url}  (the live operator console; {access})\n"


def up_message(ports: Ports = DEFAULTS, config: Path = CONFIG, more_urls: str = "") -> str:
    """What is printed once everything answers: the URLs, the demo keys (from ``config``), a first chat."""
    guard = yaml.safe_load(config.read_text())
    tenants = guard["tenants"]
    keys = ", ".join(f"{t['api_keys'][0]} ({t['name']})" for t in tenants)
    replicas = "".join(f"  engine {name}  {local(port)}       (/telemetry, /telemetry/stream, /metrics)\n"
                       for name, port in zip(replica_names(config), ports.engines))
    question = "What is the capital of France? Answer in one sentence."  # README: why the second sentence
    chat = {"model": MODEL, "messages": [{"role": "user", "content": question}],
            "max_tokens": 32, "temperature": 0}  # greedy: OpenAI's default of 1 rambles on a 135M model
    return (f"\nkvguard is up, serving {MODEL}:\n"
            f"  guard      {local(ports.guard)}/v1  (OpenAI-compatible; /metrics, /health)\n"
            + console_line(guard) + replicas +
            f"  fallback   {local(ports.fallback)}\n" + more_urls +
            f"demo API keys: {keys}\n"
            f"try: curl -s {local(ports.guard)}/v1/chat/completions -H 'Authorization: Bearer "
            f"{tenants[0]['api_keys'][0]}' -H 'Content-Type: application/json' -d '{json.dumps(chat)}'\n"
            "Ctrl-C stops everything.")


def free_port() -> int:
    """A port nothing listens on now (the OS picks it; the guard binds it moments later)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as response:
            return response.status == 200
    except OSError:
        return False


def main(processes: list[Step], message: str) -> int:
    """Run ``processes`` until Ctrl-C; print ``message`` once every one of them answers its health URL."""
    running: list[tuple[str, subprocess.Popen]] = []
    stop = False

    def request_stop(*_: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGINT, request_stop)
    signal.signal(signal.SIGTERM, request_stop)
    guard_env = {**os.environ, "KVGUARD_SECRET": os.environ.get("KVGUARD_SECRET") or secrets.token_hex(32)}

    def all_healthy(started: list[tuple[str, subprocess.Popen, str]]) -> bool:
        """Wait until each of ``started`` answers its health URL; False (and why, printed) if one cannot."""
        deadline = time.monotonic() + HEALTH_TIMEOUT_S
        for name, process, url in started:
            while not healthy(url):
                if stop or process.poll() is not None or time.monotonic() > deadline:
                    print(f"run_stack: {name} did not become healthy", file=sys.stderr)
                    return False
                time.sleep(0.2)
        return True

    try:
        starting: list[tuple[str, subprocess.Popen, str]] = []  # started, not yet seen healthy
        for name, command, url in processes:
            if command[1:3] != ["-m", "engine"]:  # an engine needs nothing; the rest waits for all before it
                if not all_healthy(starting):
                    return 1
                starting = []
            process = subprocess.Popen(command, cwd=ROOT, env=guard_env if name == "guard" else None)
            running.append((name, process))
            starting.append((name, process, url))
        if not all_healthy(starting):
            return 1
        print(message, flush=True)
        while not stop:
            for name, process in running:
                if process.poll() is not None:
                    print(f"run_stack: {name} exited with {process.returncode}; stopping", file=sys.stderr)
                    return 1
            time.sleep(0.5)
        return 0
    finally:
        for _, process in reversed(running):
            if process.poll() is None:
                process.send_signal(signal.SIGINT)
                try:
                    process.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    process.kill()


def cli(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=DEFAULTS.guard, help="the guard's port")
    parser.add_argument("--engine-port", type=int, nargs="+", default=list(DEFAULTS.engines),
                        help="one port per engine replica to start (e0, e1, ... of guard.example.yaml)")
    parser.add_argument("--fallback-port", type=int, default=DEFAULTS.fallback)
    parser.add_argument("--admin-port", type=int, default=None,
                        help=f"the operator console's port (default {DEFAULTS.admin}, or a free one when --port "
                        "moves the guard)")
    args = parser.parse_args(argv)
    admin = args.admin_port
    if admin is None:
        admin = DEFAULTS.admin if args.port == DEFAULTS.guard else free_port()
    ports = Ports(args.port, tuple(args.engine_port), args.fallback_port, admin)
    with tempfile.TemporaryDirectory(prefix="kvguard-run-") as directory:
        config = guard_config(ports, Path(directory))
        return main(stack(ports, config), up_message(ports, config))


if __name__ == "__main__":
    sys.exit(cli())
