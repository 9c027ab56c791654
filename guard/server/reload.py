"""SIGHUP: re-read the config file the guard was started with and apply it to the running guard.

What a reload changes: ``tenants`` (keys, weights, lanes, ``max_queue``, ``max_blocks_share``, ``rpm`` and
``tpm``) and ``lanes``. Every other key is fixed for the life of the process (the listener, the engines and
fallbacks, admission, upstream, routing and limits settings, the secret): a file that changes one of them is
refused whole, its message naming each such key, so that a guard never runs half the new file. A file that
does not load (unreadable, invalid YAML, an unknown key, a bad value) is refused the same way. A refusal is
logged as an error naming the problem and counted as ``guard_config_reloads_total{result="invalid"}``; the
guard goes on with the configuration it had. ``guard_config_info{hash}`` names the one that runs.

Invariants:
- ``apply`` never awaits: it runs within one callback of the event loop, so every request sees the old
  configuration or the new one, never a mix of both.
- A request keeps what it was admitted with: its ticket holds its ``Tenant`` and ``Lane`` objects, its
  rate-limit charge the windows it was made on. The new keys, weights, lanes and limits apply from the next
  request on; a removed key is refused (401) from then on.
- A tenant the file removes finishes what it has: its running requests run to their end, its queued ones
  are admitted in turn (refusing them would break requests the guard had accepted), and its queue is
  dropped once empty (guard/admission/dispatch.py, "retired").
- A kept tenant keeps its history: its fairness counter, its Fill-and-Squeeze signals and verdict (a reload
  launders no attacker) and its rate-limit windows, under its new settings.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from pathlib import Path

from aiohttp import web

from guard.auth import KeyStore
from guard.config import ConfigError, GuardConfig, config_hash, load_config
from guard.instance import STATE, GuardState

log = logging.getLogger("guard.server.reload")

RELOADABLE = frozenset({"tenants", "lanes"})  # every other key needs a restart, including any added later


def restart_only_changes(running: GuardConfig, new: GuardConfig) -> list[str]:
    """The keys outside ``RELOADABLE`` whose values differ between the two configurations."""
    return [key for key in type(running).model_fields
            if key not in RELOADABLE and getattr(running, key) != getattr(new, key)]


def apply(state: GuardState, config: GuardConfig) -> None:
    """Make ``config`` the running configuration in one step (see the module's invariants). ``config`` must
    differ from the running one only in ``RELOADABLE`` keys."""
    weights = {t.name: t.weight for t in config.tenants}
    state.config, state.keys = config, KeyStore(config.tenants, config.secret)
    state.dispatcher.reconfigure(config)
    state.escalation.reconfigure(weights, config.lanes)
    state.limiter.configure(config.tenants)
    state.metrics.show_config(config_hash(config))


def reload_file(state: GuardState, path: Path) -> bool:
    """Load ``path`` and apply it, or refuse it (logged, counted) and keep the running configuration.
    Synchronous, file read included (a small file): it must not yield to the loop before ``apply`` is done."""
    try:
        config = load_config(path)
        if fixed := restart_only_changes(state.config, config):
            raise ConfigError(f"{path}: {', '.join(fixed)}: cannot change without a restart (a reload changes "
                              f"only {' and '.join(sorted(RELOADABLE))}); nothing was applied")
    except ConfigError as exc:
        state.metrics.config_reloads.labels("invalid").inc()
        state.metrics.config_reload_ok.set(0)
        log.error("config reload refused, the running configuration (hash %s) stays: %s",
                  config_hash(state.config), exc)
        state.events.record("reload", result="refused")  # not the message: a YAML error quotes the file
        return False
    apply(state, config)
    state.metrics.config_reloads.labels("ok").inc()
    state.metrics.config_reload_ok.set(1)
    state.events.record("reload", result="ok", hash=config_hash(config), tenants=[t.name for t in config.tenants])
    log.info("config reloaded from %s (hash %s): tenants %s", path, config_hash(config),
             ", ".join(t.name for t in config.tenants))
    return True


def reload_on_sighup(app: web.Application, path: Path) -> None:
    """From the time ``app`` starts, SIGHUP reloads ``path``. The handler is the loop's, so a reload runs as
    a callback of the loop between two others, never in the middle of a request's step."""

    async def install(app: web.Application) -> None:
        asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, reload_file, app[STATE], path)

    app.on_startup.append(install)
