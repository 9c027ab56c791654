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

    def wait(self, need: int, now: float) -> float:
        """Seconds until ``need`` more fits in the window (expired to ``now``): 0 if it fits now, ``inf`` if it
        never will."""
        excess = self.used + need - self.limit
        if excess <= 0:
            return 0.0
        if need > self.limit:
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

    def remaining(self) -> int:
        return max(0, self.limit - self.used)


class Limited:
    """A tenant with limits: a window for each (``requests`` for rpm, ``tokens`` for tpm)."""

    __slots__ = ("windows",)

    def __init__(self, windows: dict[str, Window]) -> None:
        self.windows = windows

    def headers(self, now: float) -> dict[str, str]:
        """OpenAI's ``x-ratelimit-*`` headers for the tenant's limits, as of ``now``."""
        second = int(now)
        headers = {}
        for kind, window in self.windows.items():
            window.expire(second)
            headers[f"x-ratelimit-limit-{kind}"] = str(window.limit)
            headers[f"x-ratelimit-remaining-{kind}"] = str(window.remaining())
            headers[f"x-ratelimit-reset-{kind}"] = duration(window.reset(now))
        return headers


class Charge:
    """One admitted request's charge on its tenant's windows, from admission until ``settle``."""

    __slots__ = ("limited", "parts", "settled")

    def __init__(self, limited: Limited, parts: list[tuple[str, Window, list[int], int]]) -> None:
        self.limited = limited
        self.parts = parts  # (kind, window, entry, amount charged): the windows as they were when charged
        self.settled = False

    def headers(self) -> dict[str, str]:
        return self.limited.headers(time.monotonic())

    def settle(self, tokens: int | None) -> None:
        """Correct the charge to what the request used: ``tokens`` (prompt and output) that the engine was sent
        and produced, or None for a request that never reached an engine (its request and tokens come back)."""
        assert not self.settled, "a charge is settled exactly once"
        self.settled = True
        second = int(time.monotonic())
        used = {"requests": 0 if tokens is None else 1, "tokens": tokens or 0}
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

    def charge(self, tenant: Tenant, tokens: int) -> Charge | None:
        """Charge one request of ``tokens`` (prompt plus the output its reservation covers) to ``tenant``;
        None for a tenant without limits. Raises ``GuardError`` 429 when a limit has no room for it."""
        limited = self.limited.get(tenant.name)
        if limited is None:
            return None
        now = time.monotonic()
        second = int(now)
        need = {"requests": 1, "tokens": tokens}
        waits = {}
        for kind, window in limited.windows.items():
            window.expire(second)
            waits[kind] = window.wait(need[kind], now)
        kind = max(waits, key=waits.__getitem__)  # the limit that holds the request longest
        if waits[kind]:
            self.metrics.child(self.metrics.ratelimit_rejections, tenant.name, kind).inc()
            raise GuardError(429, refusal(tenant.name, kind, limited.windows[kind], need[kind], waits[kind]),
                             code="rate_limit_exceeded", retry_after=max(1, math.ceil(min(60, waits[kind]))),
                             headers=limited.headers(now))
        return Charge(limited, [(kind, window, window.add(second, need[kind]), need[kind])
                                for kind, window in limited.windows.items()])

    def levels(self) -> Iterator[tuple[str, str, int, int]]:
        """(tenant, kind, limit, remaining) of every limit as of now: the metrics read them when scraped."""
        second = int(time.monotonic())
        for name, limited in self.limited.items():
            for kind, window in limited.windows.items():
                window.expire(second)
                yield name, kind, window.limit, window.remaining()


def refusal(tenant: str, kind: str, window: Window, need: int, wait: float) -> str:
    """The message of a 429: the limit by its config key, and when (or that never) the request would fit."""
    limit = f"{UNITS[kind]} limit of {window.limit} {kind} per minute"
    if math.isinf(wait):
        return (f"the request needs {need} tokens (prompt and maximum output), more than tenant {tenant!r}'s "
                f"{limit}: it can never be admitted, retrying will not help; lower max_tokens or shorten the prompt")
    if kind == "tokens":
        return (f"tenant {tenant!r} is over its {limit}: this request needs {need}, {window.remaining()} remain; "
                f"retry in {math.ceil(wait)} s")
    return f"tenant {tenant!r} is over its {limit}; retry in {math.ceil(wait)} s"


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
