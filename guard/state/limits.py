"""Rate limits shared by every guard (``shared_state``): guard/admission/limits.py's windows in Redis.

Same semantics as one guard's limits (that module's docstring: a whole-second sliding minute, a request
charged at admission with its prompt and reserved output, settled once to what it used, the 429 with
``Retry-After`` 1..60 and the "request too large" case, ``x-ratelimit-*`` on every answer to a limited
tenant), with the windows in Redis and on Redis's clock (guard/state/scripts.py ``rate_charge``,
``rate_settle``), so a tenant served by several guards gets its limit once, not once per guard:

- a charge is one atomic step (``SharedState.ask``): every window of the tenant is checked and charged
  together, or none is;
- a settle is one fire-and-forget op on the link's wire (``SharedState.send``): nobody waits on it,
  and it runs after the charge it settles (that one was awaited);
- every charge Redis admits is also recorded, unchecked, on this guard's own windows and settled there, so
  that they hold what this guard admitted in the last minute when Redis goes away;
- a charge Redis admitted for a client that left during the round trip is refunded at once (nobody would
  settle it); a settle sent while the link is down is dropped, leaving the whole charge in Redis until it
  slides out (too much counted, never too little).

Redis down (``SharedState.ask`` answers None, at once while the link is down): the guard decides alone on
its own windows, each limit divided by ``live_guards`` (the number of guards last seen, rounded down: a
limit smaller than the number of guards admits nothing meanwhile), so the guards together stay within it;
``Retry-After``, the message and the headers say what this guard's share allows (guard/admission/limits.py
``charge_here``). When the link is up again, charging is shared again. Redis does not learn what guards
admitted alone, and one restarted empty forgets its minute, so in the minute around a change a tenant may
be admitted up to about twice its limit; never more, since each side of the change keeps within the limit
on its own.

Headers and metrics make no round trip of their own: they read ``Seen``, what Redis last answered this
guard about each window (with this guard's own settles applied since), and count a window whole once the
time Redis gave for it to empty has passed. Between answers they are this guard's view, which may lag what
other guards charged or refunded; while the link is down they read the local windows, as charging does.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from guard.admission.limits import WINDOW_S, Charge, Limited, Part, RateLimiter, duration, usage
from guard.config import Tenant
from guard.metrics import GuardMetrics
from guard.state.scripts import rate_key
from guard.state.shared import SharedState


@dataclass(slots=True)
class Seen:
    """One shared window as Redis last answered this guard: ``used`` then, and when (monotonic) it empties."""

    used: int
    empty_at: float

    def remaining(self, limit: int, now: float) -> int:
        return limit if now >= self.empty_at else max(0, limit - self.used)

    def reset(self, now: float) -> float:
        return max(0.0, self.empty_at - now)


class SharedCharge(Charge):
    """A charge admitted in Redis: settled there (one send) and on this guard's own windows (``Charge``)."""

    __slots__ = ("leaves_at", "limiter", "second", "tenant")

    def __init__(self, limited: Limited, parts: list[Part], limiter: SharedRateLimiter, tenant: str,
                 second: int, leaves_at: float) -> None:
        super().__init__(limited, parts)
        self.limiter = limiter
        self.tenant = tenant
        self.second = second  # the Redis second its entries were charged in
        self.leaves_at = leaves_at  # when (monotonic) that second leaves the window: no refund after

    def headers(self) -> dict[str, str]:
        return self.limiter.seen_headers(self.tenant, self.limited)

    def settle(self, tokens: int | None) -> None:
        super().settle(tokens)  # this guard's windows, and the settled-exactly-once check
        used, now = usage(tokens), time.monotonic()
        args: list[str | int] = []
        for kind, _, _, charged in self.parts:
            if delta := used[kind] - charged:
                args += [rate_key(self.tenant, kind), delta]
                self.limiter.note_settled(self.tenant, kind, delta, now < self.leaves_at, now)
        if args:
            self.limiter.shared.send("RATE_SETTLE", WINDOW_S, self.second, *args)


class SharedRateLimiter(RateLimiter):
    """``RateLimiter`` whose windows are every guard's, in Redis; its own windows are the fallback."""

    def __init__(self, tenants: Iterable[Tenant], metrics: GuardMetrics, shared: SharedState) -> None:
        self.shared = shared
        self.seen: dict[tuple[str, str], Seen] = {}  # (tenant, kind) -> its window as Redis last answered
        super().__init__(tenants, metrics)

    def configure(self, tenants: Iterable[Tenant]) -> None:
        """As ``RateLimiter.configure``; in Redis a window takes the limit each charge brings with it."""
        super().configure(tenants)
        self.seen = {(name, kind): seen for (name, kind), seen in self.seen.items()
                     if name in self.limited and kind in self.limited[name].windows}

    async def charge(self, tenant: Tenant, tokens: int) -> Charge | None:
        """``RateLimiter.charge`` in one ``RATE_CHARGE`` decision; on this guard's windows and share of each
        limit while Redis does not answer."""
        limited = self.limited.get(tenant.name)
        if limited is None:
            return None
        if not self.shared.up:  # no round trip to wait for
            return self.charge_here(tenant, tokens, self.shared.live_guards)
        need = {"requests": 1, "tokens": tokens}
        kinds = list(limited.windows)
        args: list[str | int] = [WINDOW_S]
        for kind in kinds:
            args += [rate_key(tenant.name, kind), limited.windows[kind].limit, need[kind]]
        charging = self.shared.ask("RATE_CHARGE", *args)
        try:
            answer = await asyncio.shield(charging)
        except asyncio.CancelledError:  # the client left while Redis decided: give back what it granted
            charging.add_done_callback(
                lambda done: self._undo(done, tenant.name, {kind: need[kind] for kind in kinds}))
            raise
        if answer is None:
            return self.charge_here(tenant, tokens, self.shared.live_guards)
        admitted, second, micros, refused = (int(value) for value in answer[:4])
        now = time.monotonic()
        for i, kind in enumerate(kinds):
            self.seen[tenant.name, kind] = Seen(int(answer[5 + 2 * i]), now + float(answer[6 + 2 * i]))
        if not admitted:
            kind = kinds[refused - 1]
            limit = limited.windows[kind].limit
            raise self.refuse(tenant.name, kind, limit, self.seen[tenant.name, kind].remaining(limit, now),
                              need[kind], float(answer[4]), self.seen_headers(tenant.name, limited))
        return SharedCharge(limited, self.record(limited, need, int(now)), self, tenant.name, second,
                            now + WINDOW_S + 1 - micros / 1e6)

    def _undo(self, charging: asyncio.Future[Any], tenant: str, charged: dict[str, int]) -> None:
        """Refund ``charged`` (per window) if Redis admitted it for a request that had already left (so
        will never settle it)."""
        if charging.cancelled() or charging.exception() is not None:
            return
        answer = charging.result()
        if answer is not None and int(answer[0]):
            refunds = [value for kind, amount in charged.items() for value in (rate_key(tenant, kind), -amount)]
            self.shared.send("RATE_SETTLE", WINDOW_S, int(answer[1]), *refunds)

    def note_settled(self, tenant: str, kind: str, delta: int, in_window: bool, now: float) -> None:
        """Apply this guard's own settle to what it last saw, as ``RATE_SETTLE`` applies it in Redis: the next
        answer from Redis replaces it with the truth, other guards' settles included."""
        seen = self.seen.get((tenant, kind))
        if seen is None:
            return
        if in_window:
            seen.used = max(0, seen.used + delta)
        elif delta > 0:  # a surplus charged now: the window holds it a minute more
            seen.used = delta + (seen.used if now < seen.empty_at else 0)
            seen.empty_at = now + WINDOW_S + 1

    def seen_headers(self, tenant: str, limited: Limited) -> dict[str, str]:
        """The ``x-ratelimit-*`` headers of ``tenant``'s limits as Redis last answered for them."""
        now = time.monotonic()
        headers = {}
        for kind, window in limited.windows.items():
            seen = self.seen.get((tenant, kind), Seen(0, now))
            headers[f"x-ratelimit-limit-{kind}"] = str(window.limit)
            headers[f"x-ratelimit-remaining-{kind}"] = str(seen.remaining(window.limit, now))
            headers[f"x-ratelimit-reset-{kind}"] = duration(seen.reset(now))
        return headers

    def levels(self) -> Iterator[tuple[str, str, int, int]]:
        """As ``RateLimiter.levels``, from what Redis last answered (see the module's docstring); with the
        link down, from this guard's windows and its share, as it then charges."""
        if not self.shared.up:
            return self.local_levels(self.shared.live_guards)
        return self._seen_levels()

    def _seen_levels(self) -> Iterator[tuple[str, str, int, int]]:
        now = time.monotonic()
        for name, limited in self.limited.items():
            for kind, window in limited.windows.items():
                seen = self.seen.get((name, kind), Seen(0, now))
                yield name, kind, window.limit, seen.remaining(window.limit, now)
