"""Per-tenant rate limits: requests (``rpm``) and tokens (``tpm``) per minute, charged at admission.

A limited tenant has a sliding window per limit: what its requests were charged, kept per whole second of
the monotonic clock as ``[second, amount]`` entries (at most 62 per window however many requests arrive, as
the gate keeps its drain rate) and their sum. An entry stays in the window through the ``WINDOW_S`` whole
seconds after its own, so a charge counts for 60 to 61 s: never less than a minute.

The pipeline charges a request once it has counted it and before it queues for fairness and the KV budget
(guard/http/pipeline.py): one request, and its prompt tokens plus the output tokens its reservation covers
(``max_tokens`` or the predicted output, times its sequences). Charged before it runs, a burst of concurrent
requests is held to the limit; a limit charged after the response lets the whole burst through. When the
request ends, its charge is settled to what the engine was sent: the request, and its prompt plus the output
tokens it produced; nothing for a request refused or failed before it reached an engine. Settling moves the
charge's own entry while that is in the window (a refund returns at once, a surplus counts from the charge's
second); once the entry has left the window, a refund has nothing left to give back and a surplus is charged
now.

Invariants:
- a window's ``used`` is the sum of its entries; every charge lands in its windows once and is settled once,
  so nothing drifts, however requests end;
- a request is admitted only if each of its tenant's windows, with its charge added, stays within its limit:
  in any 60 s a tenant is admitted at most ``rpm`` requests and charges of at most ``tpm`` tokens (a settled
  surplus can take a window past its limit; then nothing is admitted until enough has left it);
- a tenant without limits has no windows and costs one dict lookup per request.

A request over a limit is answered 429 ``rate_limit_exceeded`` with ``Retry-After``: the seconds until enough
has left the window for this request, rounded up, 1..60. A request whose tokens alone exceed ``tpm`` can
never be admitted; as OpenAI does ("Request too large"), it gets the same 429, with a message that says that
retrying will not help. Every answer to a limited tenant, 429s and successes, carries OpenAI's
``x-ratelimit-{limit,remaining,reset}-{requests,tokens}`` headers for the limits it has; a reset is the time
until the window is empty (the limit whole again), in OpenAI's duration format ("120ms", "6.5s", "1m0s").

``RateLimiter.charge`` is a coroutine so that the limiter of guards sharing state (guard/state/limits.py,
``SharedRateLimiter``: the same windows in Redis) has the same interface; this one never suspends. The
shared limiter falls back on these windows while Redis is down, each limit divided among the guards
(``charge_here`` with ``guards``), so the pieces it needs are methods here.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Iterable, Iterator

from guard.config import Tenant
from guard.errors import GuardError
from guard.metrics import GuardMetrics

WINDOW_S = 60
# Retry-After for a request that fits the limit but not this guard's share of it while the guards cannot share
# state: the link tries Redis again at least once a second (guard/state/shared.py, ``run``).
ALONE_RETRY_S = 1.0
UNITS = {"requests": "rpm", "tokens": "tpm"}  # a window's kind -> the config key of its limit


class Window:
    """One limit's sliding window; see the module's docstring."""

    __slots__ = ("entries", "limit", "used")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0  # the sum of the entries' amounts
        self.entries: deque[list[int]] = deque()  # [second, amount], oldest first; amounts are never negative

    def expire(self, second: int) -> None:
        """Drop the entries that have left the window by ``second``."""
        while self.entries and self.entries[0][0] < second - WINDOW_S:
            self.used -= self.entries.popleft()[1]

    def add(self, second: int, amount: int) -> list[int]:
        """Charge ``amount`` in ``second``; returns the entry that holds it."""
        if self.entries and self.entries[-1][0] == second:
            entry = self.entries[-1]
            entry[1] += amount
        else:
            entry = [second, amount]
            self.entries.append(entry)
        self.used += amount
        return entry

    def wait(self, need: int, now: float, limit: int | None = None) -> float:
        """Seconds until ``need`` more fits in the window (expired to ``now``) under ``limit`` (default: its
        own): 0 if it fits now, ``inf`` if it never will."""
        limit = self.limit if limit is None else limit
        excess = self.used + need - limit
        if excess <= 0:
            return 0.0
        if need > limit:
            return math.inf
        # used > limit - need >= 0, and the entries sum to used: some oldest ones make up the excess.
        for second, amount in self.entries:
            excess -= amount
            if excess <= 0:
                break
        return second + WINDOW_S + 1 - now

    def reset(self, now: float) -> float:
        """Seconds until the window (expired to ``now``) holds nothing."""
        newest = next((second for second, amount in reversed(self.entries) if amount), None)
        return 0.0 if newest is None else newest + WINDOW_S + 1 - now

    def remaining(self, limit: int | None = None) -> int:
        return max(0, (self.limit if limit is None else limit) - self.used)


class Limited:
    """A tenant with limits: a window for each (``requests`` for rpm, ``tokens`` for tpm)."""

    __slots__ = ("windows",)

    def __init__(self, windows: dict[str, Window]) -> None:
        self.windows = windows

    def headers(self, now: float, guards: int = 1) -> dict[str, str]:
        """OpenAI's ``x-ratelimit-*`` headers for the tenant's limits, as of ``now``; what remains is of this
        guard's share of each limit (1/``guards``: all of it unless it decides alone among several)."""
        second = int(now)
        headers = {}
        for kind, window in self.windows.items():
            window.expire(second)
            headers[f"x-ratelimit-limit-{kind}"] = str(window.limit)
            headers[f"x-ratelimit-remaining-{kind}"] = str(window.remaining(window.limit // guards))
            headers[f"x-ratelimit-reset-{kind}"] = duration(window.reset(now))
        return headers


# One window's part of a charge: (kind, window, entry, amount charged), the window as it was when charged.
Part = tuple[str, Window, list[int], int]


class Charge:
    """One admitted request's charge on its tenant's windows, from admission until ``settle``."""

    __slots__ = ("guards", "limited", "parts", "settled")

    def __init__(self, limited: Limited, parts: list[Part], guards: int = 1) -> None:
        self.limited = limited
        self.parts = parts
        self.guards = guards  # charged against 1/guards of each limit (see RateLimiter.charge_here)
        self.settled = False

    def headers(self) -> dict[str, str]:
        return self.limited.headers(time.monotonic(), self.guards)

    def settle(self, tokens: int | None) -> None:
        """Correct the charge to what the request used: ``tokens`` (prompt and output) that the engine was sent
        and produced, or None for a request that never reached an engine (its request and tokens come back)."""
        assert not self.settled, "a charge is settled exactly once"
        self.settled = True
        second = int(time.monotonic())
        used = usage(tokens)
        for kind, window, entry, charged in self.parts:
            delta = used[kind] - charged
            window.expire(second)
            if entry[0] >= second - WINDOW_S:  # the entry is still in the window
                entry[1] += delta
                window.used += delta
            elif delta > 0:
                window.add(second, delta)


class RateLimiter:
    """Every limited tenant's windows; ``charge`` is the pipeline's limits stage."""

    def __init__(self, tenants: Iterable[Tenant], metrics: GuardMetrics) -> None:
        self.metrics = metrics
        self.limited: dict[str, Limited] = {}  # only tenants with rpm or tpm
        self.configure(tenants)

    def configure(self, tenants: Iterable[Tenant]) -> None:
        """Take the tenants' limits. A window whose limit is still configured keeps what it holds, under its
        new limit; charges made before settle on the windows they were made on."""
        limited: dict[str, Limited] = {}
        for tenant in tenants:
            old = self.limited.get(tenant.name)
            windows: dict[str, Window] = {}
            for kind, limit in (("requests", tenant.rpm), ("tokens", tenant.tpm)):
                if limit is None:
                    continue
                window = windows[kind] = (old.windows.get(kind) if old is not None else None) or Window(limit)
                window.limit = limit
                self.metrics.child(self.metrics.ratelimit_rejections, tenant.name, kind)  # at 0 from the start
            if windows:
                limited[tenant.name] = Limited(windows)
        self.limited = limited

    async def charge(self, tenant: Tenant, tokens: int) -> Charge | None:
        """Charge one request of ``tokens`` (prompt plus the output its reservation covers) to ``tenant``;
        None for a tenant without limits. Raises ``GuardError`` 429 when a limit has no room for it."""
        return self.charge_here(tenant, tokens)

    def charge_here(self, tenant: Tenant, tokens: int, guards: int = 1) -> Charge | None:
        """``charge`` on this guard's own windows, against 1/``guards`` of each limit (rounded down, so that
        guards deciding alone stay within the limit together). A request within the limit but beyond the
        share can only wait for the guards to share state again: it is told to retry in ``ALONE_RETRY_S``."""
        limited = self.limited.get(tenant.name)
        if limited is None:
            return None
        now = time.monotonic()
        second = int(now)
        need = {"requests": 1, "tokens": tokens}
        waits = {}
        for kind, window in limited.windows.items():
            window.expire(second)
            waits[kind] = window.wait(need[kind], now, window.limit // guards)
            if math.isinf(waits[kind]) and need[kind] <= window.limit:
                waits[kind] = ALONE_RETRY_S
        kind = max(waits, key=waits.__getitem__)  # the limit that holds the request longest
        if waits[kind]:
            window = limited.windows[kind]
            raise self.refuse(tenant.name, kind, window.limit, window.remaining(window.limit // guards),
                              need[kind], waits[kind], limited.headers(now, guards), guards)
        return Charge(limited, self.record(limited, need, second), guards)

    @staticmethod
    def record(limited: Limited, need: dict[str, int], second: int) -> list[Part]:
        """Add ``need`` to each of the tenant's windows in ``second``, unchecked; returns the charge's parts."""
        for window in limited.windows.values():
            window.expire(second)  # keeps a window's entries to the minute, however it is charged
        return [(kind, window, window.add(second, need[kind]), need[kind])
                for kind, window in limited.windows.items()]

    def refuse(self, tenant: str, kind: str, limit: int, remaining: int, need: int, wait: float,
               headers: dict[str, str], guards: int = 1) -> GuardError:
        """The 429 for a request that ``kind``'s window holds ``wait`` s (``inf``: forever), counted."""
        self.metrics.child(self.metrics.ratelimit_rejections, tenant, kind).inc()
        return GuardError(429, refusal(tenant, kind, limit, remaining, need, wait, guards), headers=headers,
                          code="rate_limit_exceeded", retry_after=max(1, math.ceil(min(60, wait))))

    def levels(self) -> Iterator[tuple[str, str, int, int]]:
        """(tenant, kind, limit, remaining) of every limit as of now: the metrics read them when scraped."""
        return self.local_levels(1)

    def local_levels(self, guards: int) -> Iterator[tuple[str, str, int, int]]:
        """``levels`` of this guard's own windows, what remains being of 1/``guards`` of each limit."""
        second = int(time.monotonic())
        for name, limited in self.limited.items():
            for kind, window in limited.windows.items():
                window.expire(second)
                yield name, kind, window.limit, window.remaining(window.limit // guards)


def usage(tokens: int | None) -> dict[str, int]:
    """What a request used, per window kind: ``tokens`` the engine was sent and produced, or None for one that
    never reached an engine (it used nothing, not even its request)."""
    return {"requests": 0 if tokens is None else 1, "tokens": tokens or 0}


def refusal(tenant: str, kind: str, limit: int, remaining: int, need: int, wait: float, guards: int = 1) -> str:
    """The message of a 429: the limit by its config key, and when (or that never) the request would fit."""
    limit_text = f"{UNITS[kind]} limit of {limit} {kind} per minute"
    if math.isinf(wait):
        return (f"the request needs {need} tokens (prompt and maximum output), more than tenant {tenant!r}'s "
                f"{limit_text}: it can never be admitted, retrying will not help; lower max_tokens or shorten the "
                f"prompt")
    alone = (f" (the guards cannot share state now: this one admits 1/{guards} of the limit until they can)"
             if guards > 1 else "")
    if kind == "tokens":
        return (f"tenant {tenant!r} is over its {limit_text}{alone}: this request needs {need}, {remaining} "
                f"remain; retry in {math.ceil(wait)} s")
    return f"tenant {tenant!r} is over its {limit_text}{alone}; retry in {math.ceil(wait)} s"


def duration(seconds: float) -> str:
    """OpenAI's (Go's) duration format for ``x-ratelimit-reset-*``: "0s", "120ms", "6.5s", "1m0s"; rounded up
    to the millisecond, so a wait is never shown shorter than it is."""
    ms = math.ceil(seconds * 1000)
    if ms <= 0:
        return "0s"
    if ms < 1000:
        return f"{ms}ms"
    minutes, ms = divmod(ms, 60_000)
    secs = f"{ms // 1000}.{ms % 1000:03d}".rstrip("0").rstrip(".")
    return f"{minutes}m{secs}s" if minutes else f"{secs}s"
