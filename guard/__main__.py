"""``python -m guard --config guard.yaml [--workers N] [--drain-delay S]``: run the guard until SIGINT/SIGTERM,
then shut down gracefully; SIGHUP re-reads the file (guard/server/reload.py).

SIGTERM drains: ``/health`` turns 503 ``{"status": "draining"}`` at once, the guard goes on serving what it
is sent for ``--drain-delay`` seconds (default 0), long enough for a load balancer's health check to take
it out (deploy/haproxy.cfg's: ``inter 2s fall 2``, so 5 s), then closes its listener, lets running requests
(streams included) finish within ``limits.shutdown_timeout``, and exits 0. SIGINT, or a second SIGTERM,
skips the delay.

``--workers N`` (N > 1, which needs ``shared_state``) runs N guard processes on one port::

    python -m guard --workers 2          the supervisor: spawns the workers, forwards signals, reports deaths
      |-- worker 0   listen.port (SO_REUSEPORT) + its own /metrics, /health on --metrics-port + 0; the console
      '-- worker 1   listen.port (SO_REUSEPORT) + its own /metrics, /health on --metrics-port + 1

Each worker is a whole guard (this module again, with the hidden ``--worker-index``), sharing fairness, KV
budgets, limits and verdicts with the others through Redis (guard/state/) as separate guards do; the kernel
spreads new connections among the listeners. The supervisor forwards SIGTERM, SIGINT and SIGHUP to every
worker and exits once they have; a worker that dies on its own is reported and the others are stopped (exit
status 1), so that whatever supervises the guard (systemd, compose's restart policy) restarts it whole.
Workers run in their own session, so a terminal's Ctrl-C reaches them once, through the supervisor, and
they are sent SIGTERM if the supervisor dies (``PR_SET_PDEATHSIG``).

Metrics are per process: the listener's ``/metrics`` is whichever worker the kernel handed the connection,
so Prometheus scrapes each worker's own port instead, one ``instance`` per worker, exactly as it would scrape
separate guards. Only worker 0 runs the admin console (``admin:``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import gc
import importlib.util
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from aiohttp import web

from guard.config import ConfigError, GuardConfig, load_config
from guard.http.routes import health, metrics_endpoint
from guard.instance import STATE
from guard.pool.scheduling import profile_for
from guard.server.app import create_app
from guard.server.reload import reload_on_sighup
from guard.wire.connections import raise_descriptor_limit, serve

# Young objects allocated before the collector starts a pass. The default (700) suits programs whose objects
# die in order; here 64+ requests in flight allocate and free thousands at once, the count (allocations net
# of frees, never below 0 after a pass) keeps reaching 700, and the passes walked every in-flight request's
# objects ~80 times a second: 9% of the guard's CPU on small requests. At 10,000 a pass comes every second
# or so under load and most of a request's objects are gone before one does. Nothing here relies on the
# collector (aiohttp's objects die by reference counting), so garbage is only held a little longer.
GEN0_THRESHOLD = 10_000
METRICS_PORT_OFFSET = 10  # --workers N without --metrics-port: worker i's metrics on listen.port + 10 + i
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
STOP_GRACE_S = 5.0  # past limits.shutdown_timeout, before the supervisor kills a worker told to stop
PR_SET_PDEATHSIG = 1


def tune_collector() -> None:
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(GEN0_THRESHOLD, gen1, gen2)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m guard", description="kvguard: the admission-control proxy "
                                     "in front of the engine (OpenAI-compatible).")
    parser.add_argument("--config", required=True, help="YAML configuration file (see guard.example.yaml)")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    parser.add_argument("--workers", type=int, default=1, metavar="N",
                        help="guard processes sharing the listen port (SO_REUSEPORT); N > 1 needs shared_state")
    parser.add_argument("--metrics-port", type=int, metavar="PORT",
                        help="worker i serves its own /metrics and /health on PORT + i, on listen.host (default "
                        f"with --workers N > 1: listen.port + {METRICS_PORT_OFFSET}; 0: ports the OS picks, "
                        "printed)")
    parser.add_argument("--loop", choices=["auto", "uvloop", "asyncio"], default="auto",
                        help="the event loop: uvloop (auto: when installed) or the standard library's")
    parser.add_argument("--drain-delay", type=float, default=0.0, metavar="SECONDS",
                        help="on SIGTERM, /health answers 503 draining and the guard keeps serving for this long "
                        "before it closes its listener (a load balancer's health check moves clients off "
                        "meanwhile); running requests then get limits.shutdown_timeout (default 0)")
    parser.add_argument("--worker-index", type=int, help=argparse.SUPPRESS)  # set by the supervisor only
    parser.add_argument("--parent-pid", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.workers < 1:
        parser.error("--workers must be at least 1")
    if not args.drain_delay >= 0:
        parser.error(f"--drain-delay: must be >= 0 seconds, got {args.drain_delay}")
    if args.loop == "uvloop" and not uvloop_installed():
        parser.error("--loop uvloop: the uvloop package is not installed (pip install uvloop)")
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = load_config(args.config)
        try:  # its plugin names are checked where the plugins are registered (config sits below them)
            profile_for(config.routing)
        except ConfigError as exc:
            raise ConfigError(f"{args.config}: {exc}") from None
    except ConfigError as exc:
        print(f"guard: invalid configuration: {exc}", file=sys.stderr)
        return 2
    if args.workers > 1 and (problem := workers_problem(config)):
        print(f"guard: --workers {args.workers}: {problem}", file=sys.stderr)
        return 2
    if args.worker_index is not None:
        return worker(config, args)
    announce(config, args.workers)
    if args.workers > 1:
        base = config.listen.port + METRICS_PORT_OFFSET if args.metrics_port is None else args.metrics_port
        return supervise(args, base, stop_within=args.drain_delay + config.limits.shutdown_timeout + STOP_GRACE_S)
    return run(config, Path(args.config), metrics_port=args.metrics_port, loop=args.loop,
               drain_delay=args.drain_delay)


def uvloop_installed() -> bool:
    return importlib.util.find_spec("uvloop") is not None


def new_event_loop(choice: str) -> asyncio.AbstractEventLoop:
    """uvloop's loop (``auto``: when installed), else the standard library's. uvloop runs the guard's own
    per-request work unchanged but does the sockets, timers and callbacks in C: measured in
    docs/benchmarks.md ("Guard cost")."""
    if choice == "uvloop" or (choice == "auto" and uvloop_installed()):
        import uvloop  # only when chosen: an optional dependency

        return uvloop.new_event_loop()
    return asyncio.new_event_loop()


def workers_problem(config: GuardConfig) -> str | None:
    """Why ``config`` cannot run as several workers, or None."""
    if config.shared_state is None:
        return ("several workers need shared_state (shared_state: {redis_url: \"redis://HOST:6379/0\"} in the "
                "config): without it each worker would keep its own fairness, KV budget and limits, and "
                "together they would overcommit the engines")
    if config.listen.port == 0:
        return "several workers need a fixed listen.port to share (0 would give each a port of its own)"
    return None


def announce(config: GuardConfig, workers: int) -> None:
    engines = ", ".join(f"{b.name} {b.url}" for b in config.pool)
    processes = f"; {workers} workers sharing state through Redis" if workers > 1 else ""
    print(f"guard listening on http://{config.listen.host}:{config.listen.port} -> engines {engines} "
          f"(routing: {'a profile' if config.routing.profile else config.routing.policy}{processes})", flush=True)
    if (admin := config.admin) is not None:  # the site itself starts with the app (guard/console/app.py)
        access = "an admin key required" if admin.api_keys else "loopback, no key"
        owner = " (worker 0)" if workers > 1 else ""
        print(f"operator console on http://{admin.host}:{admin.port}/ ({access}){owner}", flush=True)


def run(config: GuardConfig, path: Path, *, console: bool = True, reuse_port: bool = False,
        metrics_port: int | None = None, name: str = "guard", loop: str = "auto", worker: int | None = None,
        drain_delay: float = 0.0) -> int:
    """One guard process, serving until a signal ends it."""
    raise_descriptor_limit()  # before create_app, which sizes the connection cap from it
    try:
        app = create_app(config, console=console, worker=worker)
    except OSError as exc:  # a file the configuration names that cannot be opened (decision_log)
        print(f"{name}: cannot start: {exc.strerror or exc}", file=sys.stderr)
        return 2
    if metrics_port is not None:
        serve_metrics(app, config.listen.host, metrics_port, name)
    reload_on_sighup(app, path)
    # What exists now (modules, pydantic schemas, the app) lives as long as the process: keep it out of the
    # collector's reach, so that a full collection walks only what requests left behind. Walking ~50k
    # startup objects made every gen-2 pass (one every few seconds under load) stall all streams 35-140 ms.
    gc.freeze()
    tune_collector()
    state = app[STATE]
    serve(app, config.listen.host, config.listen.port, shutdown_timeout=config.limits.shutdown_timeout,
          reuse_port=reuse_port, loop=new_event_loop(loop), drain_delay=drain_delay,
          on_drain=lambda: setattr(state, "draining", True))
    return 0


def serve_metrics(app: web.Application, host: str, port: int, name: str) -> None:
    """``/metrics`` and ``/health`` of this process alone on ``host:port``, beside the shared listener, from
    the time ``app`` starts (a port that cannot be bound stops the worker from starting)."""
    runners: list[web.AppRunner] = []

    async def start(app: web.Application) -> None:
        private = web.Application()
        private[STATE] = app[STATE]
        private.router.add_get("/metrics", metrics_endpoint)
        private.router.add_get("/health", health)
        runner = web.AppRunner(private, access_log=None, shutdown_timeout=1.0)
        await runner.setup()
        try:
            await web.TCPSite(runner, host, port).start()
        except OSError as exc:
            await runner.cleanup()
            raise OSError(exc.errno, f"{name}'s metrics listener {host}:{port} (--metrics-port): "
                                     f"{exc.strerror}") from exc
        runners.append(runner)
        print(f"{name} (pid {os.getpid()}): metrics on http://{host}:{runner.addresses[0][1]}/metrics",
              flush=True)

    async def stop(app: web.Application) -> None:
        for runner in runners:
            await runner.cleanup()

    app.on_startup.append(start)
    app.on_cleanup.append(stop)


# -- --workers N ----------------------------------------------------------------------------------------------
def worker(config: GuardConfig, args: argparse.Namespace) -> int:
    """Worker ``args.worker_index`` of a supervisor: one guard on the shared port."""
    die_with(args.parent_pid)
    index = args.worker_index
    return run(config, Path(args.config), console=index == 0, reuse_port=True, metrics_port=args.metrics_port,
               name=f"guard worker {index}", loop=args.loop, worker=index, drain_delay=args.drain_delay)


def die_with(parent: int | None) -> None:
    """Ask the kernel for SIGTERM when the supervisor dies (Linux), so that no worker outlives it holding the
    port and its lease; exit at once if it already has."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if parent is not None and os.getppid() != parent:
        sys.exit("guard worker: the supervisor is gone")


def supervise(args: argparse.Namespace, metrics_base: int, stop_within: float) -> int:
    """Spawn ``args.workers`` workers and wait for them (see the module docstring): 0 when they all ended
    cleanly on a forwarded signal, 1 when one died on its own. Once they are told to stop, those still
    running after ``stop_within`` seconds are killed (SIGKILL, said on stderr): the supervisor always ends."""
    workers: dict[int, int] = {}  # pid: index, of the workers still running
    stopping = False
    kill_at: float | None = None  # when the workers told to stop are killed, once they are

    def send(sig: signal.Signals) -> None:
        for pid in workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

    def forward(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = stopping or signum != signal.SIGHUP
        send(signal.Signals(signum))

    for sig in FORWARDED:
        signal.signal(sig, forward)
    for index in range(args.workers):
        command = [sys.executable, "-m", "guard", "--config", args.config, "--log-level", args.log_level,
                   "--workers", str(args.workers), "--worker-index", str(index), "--parent-pid", str(os.getpid()),
                   "--metrics-port", str(metrics_base + index if metrics_base else 0), "--loop", args.loop,
                   "--drain-delay", str(args.drain_delay)]
        workers[subprocess.Popen(command, start_new_session=True).pid] = index
    if stopping:  # a signal came while they were being spawned: the later ones missed it
        send(signal.SIGTERM)
    status = 0
    while workers:
        if stopping and kill_at is None:
            kill_at = time.monotonic() + stop_within
        pid, wait_status = _wait_child(kill_at)
        if pid == 0:  # past kill_at
            print(f"guard: workers {sorted(workers.values())} still running {stop_within:g} s after being told "
                  "to stop; killing them", file=sys.stderr, flush=True)
            send(signal.SIGKILL)
            kill_at = float("inf")
            continue
        if (index := workers.pop(pid, None)) is None:
            continue
        code = os.waitstatus_to_exitcode(wait_status)
        if stopping and code == 0:
            continue
        status = 1
        how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with status {code}"
        then = "" if stopping else "; stopping the other workers"
        print(f"guard: worker {index} (pid {pid}) {how}{then}", file=sys.stderr, flush=True)
        if not stopping:
            stopping = True
            send(signal.SIGTERM)
    return status


def _wait_child(until: float | None) -> tuple[int, int]:
    """``os.wait()``, or (0, 0) once ``until`` (monotonic) has passed with no child ended. A signal runs its
    handler, then the wait goes on (PEP 475)."""
    if until is None or until == float("inf"):
        return os.wait()
    while (ended := os.waitpid(-1, os.WNOHANG)) == (0, 0):
        if time.monotonic() >= until:
            return 0, 0
        time.sleep(0.05)
    return ended


if __name__ == "__main__":
    sys.exit(main())
