"""``python -m guard --config guard.yaml``: run the guard until SIGINT/SIGTERM, then shut down gracefully;
SIGHUP re-reads the file (guard/reload.py)."""

from __future__ import annotations

import argparse
import gc
import logging
import sys
from pathlib import Path

from guard.config import ConfigError, load_config
from guard.http.app import create_app
from guard.http.connections import raise_descriptor_limit, serve
from guard.reload import reload_on_sighup

# Young objects allocated before the collector starts a pass. The default (700) suits programs whose objects
# die in order; here 64+ requests in flight allocate and free thousands at once, the count (allocations net
# of frees, never below 0 after a pass) keeps reaching 700, and the passes walked every in-flight request's
# objects ~80 times a second: 9% of the guard's CPU on small requests. At 10,000 a pass comes every second
# or so under load and most of a request's objects are gone before one does. Nothing here relies on the
# collector (aiohttp's objects die by reference counting), so garbage is only held a little longer.
GEN0_THRESHOLD = 10_000


def tune_collector() -> None:
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(GEN0_THRESHOLD, gen1, gen2)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m guard", description="kvguard: the admission-control proxy "
                                     "in front of the engine (OpenAI-compatible).")
    parser.add_argument("--config", required=True, help="YAML configuration file (see guard.example.yaml)")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = load_config(args.config)
    except ConfigError as exc:
        print(f"guard: invalid configuration: {exc}", file=sys.stderr)
        return 2
    engines = ", ".join(f"{b.name} {b.url}" for b in config.pool)
    print(f"guard listening on http://{config.listen.host}:{config.listen.port} -> engines {engines} "
          f"(routing: {config.routing.policy})", flush=True)
    if (admin := config.admin) is not None:  # the site itself starts with the app (guard/console/app.py)
        access = "an admin key required" if admin.api_keys else "loopback, no key"
        print(f"operator console on http://{admin.host}:{admin.port}/ ({access})", flush=True)
    raise_descriptor_limit()  # before create_app, which sizes the connection cap from it
    app = create_app(config)
    reload_on_sighup(app, Path(args.config))
    # What exists now (modules, pydantic schemas, the app) lives as long as the process: keep it out of the
    # collector's reach, so that a full collection walks only what requests left behind. Walking ~50k
    # startup objects made every gen-2 pass (one every few seconds under load) stall all streams 35-140 ms.
    gc.freeze()
    tune_collector()
    serve(app, config.listen.host, config.listen.port, shutdown_timeout=config.limits.shutdown_timeout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
