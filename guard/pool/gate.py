"""The admission gate: requests are committed in KV blocks against the engine's live telemetry.

A request reserves the blocks it can ever need, ``ceil((prompt + max_tokens) / block_size)`` for its first
sequence plus the output blocks of each extra one (``n > 1`` shares the prompt). The gate commits it only if

    other + reserved + request  <=  threshold * num_blocks

where ``reserved`` sums the reservations of everything the guard has admitted (each an upper bound on what
the request can hold in the engine) and ``other`` is what the engine holds for traffic that did not come
through the guard (engine used blocks minus those of the guard's tenants). So the engine's own queue stays
short and it never has to preempt.

Part of a reservation may be *borrowed*: the blocks beyond its tenant's guaranteed share, lent out of idle
capacity (the dispatcher says how many, guard/admission/dispatch.py). A reservation that borrows must fit
the rule above whole. One that borrows nothing is within its tenant's guarantee, and borrowed blocks do not
stand in its way under the threshold: it fits when ``other + (reserved - borrowed) + request`` does and
everything reserved still fits the engine's whole pool (``other + reserved + request <= num_blocks``). So a
tenant waiting for its share reclaims the headroom the threshold keeps instead of queueing behind the
borrowers, and no reservation is ever made that the engine could not hold. Guaranteed reservations alone
never pass the threshold. Requests that borrow run at a lower engine priority (``BORROWED_PRIORITY``): if the
engine does run short (an output that outgrows its predicted reservation), it preempts them first.
``threshold`` is ``safe_utilization`` while the gate is open; once a request does not fit, the gate closes and
reopens only below ``resume_utilization`` (hysteresis), so that a pool hovering at the edge is not refilled by
a stream of small requests. A borrower that does not fit closes it to borrowers only: lent work that finds no
room does not lower what work within its guarantee may reserve (sheddable heads, offered after the critical
ones, otherwise held critical work to ``resume_utilization``). Telemetry that is missing, stale or unhealthy
counts as a full pool. A reservation is released exactly once, whatever ends the request.

Liveness and numbers are told apart, so that a busy engine is never taken for a down one. The engine's
telemetry stream sends snapshots at step boundaries and, while one step runs for seconds (a long prefill),
busy heartbeats saying how long it has run (engine/server/app.py). Then:

- ``alive`` (the engine is up, as far as its telemetry tells): a snapshot or a busy heartbeat came within
  ``telemetry_stale_s``, the last snapshot says healthy, and no step has run past ``step_hang_s``. A hung
  step is down however lively its heartbeats; a stream of plain heartbeats says nothing about the engine.
- ``usable`` (the numbers may be admitted against): alive, and the last snapshot still describes the engine:
  it arrived within ``telemetry_stale_s``, or a busy heartbeat since then names its ``step``. Such a
  heartbeat says no step boundary has passed since that snapshot, and the engine's blocks change only at
  step boundaries (the running step's blocks were allocated when it was scheduled; requests added, aborted
  or finished meanwhile take or free blocks at the next boundary). So during one long step the last
  snapshot plus the reservations bounds the pool as well as a fresh snapshot would (both lag the step in
  progress alike), and admission goes on. A busy heartbeat that names no step (a stream reconnected in the
  middle of a step has sent no snapshot yet) proves the engine alive, not the numbers current: the gate
  admits nothing until the next snapshot, without taking the engine for down.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

from engine.protocol import TelemetrySnapshot
from guard.config import Admission
from guard.pool.estimators import Pace

log = logging.getLogger("guard.pool.gate")

DRAIN_WINDOW_S = 10.0
# Added to the engine priority of a request that borrows (lower runs first): past every lane and the
# suspects' last lane, so the engine preempts every borrower before anyone within its guarantee.
BORROWED_PRIORITY = 100


def engine_priority(lane_priority: int, borrowed: int) -> int:
    """The engine priority a request runs at (lower first): its lane's, behind every lane when it borrows."""
    return lane_priority + (BORROWED_PRIORITY if borrowed else 0)


def blocks_for(block_size: int, prompt_tokens: int, max_tokens: int, n: int = 1) -> int:
    """Blocks a request can ever hold: its first sequence's, plus, for ``n > 1``, each fork's copy of the
    shared partial block (on its first write) and its own output blocks."""
    first = -(-(prompt_tokens + max_tokens) // block_size)
    return first + (n - 1) * (-(-max_tokens // block_size) + 1)


def batch_blocks_for(block_size: int, prompts_tokens: list[int], max_tokens: int, n: int = 1) -> int:
    """Blocks a batch of prompts can ever hold: each prompt is an engine request of its own, with its own
    partial blocks, so the sum of theirs. (A loop: asked on every request, and most have one prompt.)"""
    total = 0
    for prompt in prompts_tokens:
        total += blocks_for(block_size, prompt, max_tokens, n)
    return total


@dataclass(slots=True)
class Reservation:
    key: str
    tenant: str
    blocks: int
    borrowed: int = 0  # of ``blocks``, those beyond the tenant's guaranteed share


class AdmissionGate:
    def __init__(self, config: Admission, guard_tenants: set[str]) -> None:
        self.config = config
        self.guard_tenants = guard_tenants
        self.snapshot: TelemetrySnapshot | None = None
        self.received_at = 0.0  # when the snapshot arrived, or a busy heartbeat last vouched for it
        self.heard_at = 0.0  # when the engine's telemetry last said anything (a snapshot or a busy heartbeat)
        self.step_started: float | None = None  # when the step busy heartbeats report started; None between
        self.open = True  # the hysteresis (see the module docstring): closed to every reservation
        self.lending = True  # closed to those that borrow only
        # Of the room under each limit, the part this guard may commit alone: 1, unless guards that share
        # state (guard/state/) lost it and each must keep to its share of every engine.
        self.share = 1.0
        # What each other guard held on this engine, {guard: blocks}, as the shared ledger last showed it
        # (guard/state/sightings.py: its recent peak, set as the link goes down). While this guard keeps to its
        # share, another may still hold more than its own (it borrowed while Redis was up) and drains it only
        # as its requests end; its excess comes off this guard's share (``mine``).
        self.others: dict[str, int] = {}
        self.reservations: dict[str, Reservation] = {}
        self.reserved_by_tenant: dict[str, int] = {}
        self.reserved = 0  # the sum of reserved_by_tenant
        self.borrowed_by_tenant: dict[str, int] = {}
        self.borrowed = 0  # the sum of borrowed_by_tenant: reclaimable by reservations within a guarantee
        self.outside = 0  # blocks the last snapshot shows held by traffic that did not come through the guard
        # Blocks released per second over the last DRAIN_WINDOW_S in which the gate held any (busy from the
        # first reservation to the release that leaves none): every submit that queues asks for it.
        self._drained = Pace(DRAIN_WINDOW_S)

    # -- telemetry -------------------------------------------------------------------------------------
    def update(self, snapshot: TelemetrySnapshot) -> None:
        self.snapshot = snapshot
        self.received_at = self.heard_at = time.monotonic()
        self.step_started = None
        ours = sum(usage.blocks for name, usage in snapshot.tenants.items() if name in self.guard_tenants)
        self.outside = max(0, snapshot.used_blocks - ours)  # cached blocks are reclaimable: not outside use

    def busy(self, step: int | None, step_running_s: float) -> None:
        """A busy heartbeat: the engine is alive, in a step that has run ``step_running_s``, with no step
        boundary since its snapshot ``step`` (None: the stream has sent no snapshot yet)."""
        now = time.monotonic()
        hung_before = self.hung()
        self.heard_at = now
        self.step_started = now - step_running_s
        if self.snapshot is not None and step == self.snapshot.step:
            self.received_at = now
        if self.hung() and not hung_before:
            log.warning("the engine's step has run %.1f s, past step_hang_s (%g s): the engine counts as down",
                        step_running_s, self.config.step_hang_s)

    def telemetry_age(self) -> float:
        """Seconds since the numbers were last known to describe the engine (infinite before any snapshot)."""
        return time.monotonic() - self.received_at if self.snapshot is not None else math.inf

    def step_running_s(self) -> float:
        """How long the engine's running step has run, as its busy heartbeats tell (0 between steps)."""
        return 0.0 if self.step_started is None else time.monotonic() - self.step_started

    def hung(self) -> bool:
        return self.step_running_s() > self.config.step_hang_s

    def alive(self) -> bool:
        """The engine is up as far as its telemetry tells (see the module docstring)."""
        snapshot = self.snapshot
        if snapshot is None or not snapshot.healthy or snapshot.draining:  # a draining engine takes nothing new
            return False
        now = time.monotonic()  # asked several times per request: one clock read, ``hung`` inlined
        return (now - self.heard_at <= self.config.telemetry_stale_s
                and (self.step_started is None or now - self.step_started <= self.config.step_hang_s))

    def usable(self) -> bool:
        """Alive, with numbers that still describe the engine: without them the pool counts as full."""
        return self.alive() and self.telemetry_age() <= self.config.telemetry_stale_s

    # -- arithmetic ------------------------------------------------------------------------------------
    @property
    def budget(self) -> int:
        """Blocks the guard will commit at most (``safe_utilization * num_blocks``); 0 without telemetry."""
        if self.snapshot is None:
            return 0
        return int(self.config.safe_utilization * self.snapshot.num_blocks)

    def committed(self) -> int:
        return self.outside + self.reserved

    # -- reservations ----------------------------------------------------------------------------------
    def fits(self, blocks: int, borrowed: int = 0) -> bool:
        """Room for ``blocks`` more, ``borrowed`` of them beyond their tenant's guarantee, under the gate's
        current threshold (telemetry assumed usable)."""
        assert self.snapshot is not None
        threshold_room, pool_room = self.rooms(borrowed)
        # Asked for every reservation: no call at all in the usual case (the link up, or no shared state).
        threshold, pool = ((threshold_room, pool_room) if self.share >= 1.0
                           else (self.mine(threshold_room), self.mine(pool_room)))
        if borrowed:
            return self.reserved + blocks <= threshold
        # Within a guarantee, what others borrowed is reclaimable up to the engine's whole pool.
        return self.reserved - self.borrowed + blocks <= threshold and self.reserved + blocks <= pool

    def mine(self, room: int) -> float:
        """Of ``room``, what this guard's reservations may sum to: all of it, or while guards that share
        state cannot (``share`` < 1), its share less what the others hold beyond theirs. Each other guard
        then admits only while under its own share, so it holds at most the larger of its share and what it
        held when the ledger last answered; the guards together stay within ``room``."""
        if self.share >= 1.0:
            return room
        share = self.share * room
        return share - sum(max(0, held - share) for held in self.others.values())

    def rooms(self, borrowed: int = 0) -> tuple[int, int]:
        """What the guard's reservations may sum to: under the current threshold for a reservation that
        borrows ``borrowed`` blocks, and in the whole pool (each less the blocks held by traffic from outside
        the guard). Telemetry assumed usable."""
        assert self.snapshot is not None
        share = self.config.safe_utilization if self.open and (self.lending or not borrowed) else self.config.resume
        num_blocks = self.snapshot.num_blocks
        return int(share * num_blocks) - self.outside, num_blocks - self.outside

    def try_reserve(self, key: str, tenant: str, blocks: int, borrowed: int = 0) -> bool:
        """Commit ``blocks`` for request ``key`` if the pool allows; closes the gate when it does not."""
        if key in self.reservations:
            raise ValueError(f"reservation {key!r} already exists")
        if not self.usable():
            return False  # no news is not a full pool: the gate's hysteresis state stays as it was
        fits = self.fits(blocks, borrowed)
        self.decided(fits, borrowed)
        if fits:
            self.record(key, tenant, blocks, borrowed)
        return fits

    def decided(self, fitted: bool, borrowed: int) -> None:
        """The hysteresis after a reservation (``borrowed`` of its blocks lent) was decided, here or by the
        guards' shared ledger: any fit opens the gate; a miss closes it, to borrowers only if it borrowed."""
        if fitted:
            self.open = self.lending = True
        elif borrowed:
            self.lending = False
        else:
            self.open = False

    def record(self, key: str, tenant: str, blocks: int, borrowed: int = 0) -> None:
        """Account a reservation that was decided elsewhere (the guards' shared ledger, guard/state/)."""
        if key in self.reservations:
            raise ValueError(f"reservation {key!r} already exists")
        self.reservations[key] = reservation = Reservation(key, tenant, 0)
        self._add(reservation, blocks, borrowed)

    def try_grow(self, key: str, blocks: int, borrowed: int = 0) -> bool:
        """Add ``blocks`` (``borrowed`` of them beyond the tenant's guarantee) to a running request's
        reservation if the pool has idle room under ``safe_utilization``. The hysteresis threshold does not
        apply: the request runs already, and what it cannot reserve it takes from the engine anyway (growing
        late is better than not at all). False leaves it as it was."""
        reservation = self.reservations.get(key)
        if reservation is None or not self.usable() or self.snapshot is None:
            return False
        room = int(self.config.safe_utilization * self.snapshot.num_blocks) - self.outside
        if self.reserved + blocks > self.mine(room):
            return False
        self._add(reservation, blocks, borrowed)
        return True

    def _add(self, reservation: Reservation, blocks: int, borrowed: int) -> None:
        if not self.reserved:
            self._drained.busy(time.monotonic())
        tenant = reservation.tenant
        reservation.blocks += blocks
        reservation.borrowed += borrowed
        self.reserved_by_tenant[tenant] = self.reserved_by_tenant.get(tenant, 0) + blocks
        self.reserved += blocks
        if borrowed:
            self.borrowed_by_tenant[tenant] = self.borrowed_by_tenant.get(tenant, 0) + borrowed
            self.borrowed += borrowed

    def release(self, key: str) -> bool:
        """Give a reservation back; idempotent (False when there was nothing to release)."""
        reservation = self.reservations.pop(key, None)
        if reservation is None:
            return False
        _take(self.reserved_by_tenant, reservation.tenant, reservation.blocks)
        self.reserved -= reservation.blocks
        if reservation.borrowed:
            _take(self.borrowed_by_tenant, reservation.tenant, reservation.borrowed)
            self.borrowed -= reservation.borrowed
        now = time.monotonic()
        self._drained.add(reservation.blocks, now)
        if not self.reserved:
            self._drained.idle(now)
        return True

    def tenant_reserved(self, tenant: str) -> int:
        return self.reserved_by_tenant.get(tenant, 0)

    def tenant_borrowed(self, tenant: str) -> int:
        return self.borrowed_by_tenant.get(tenant, 0)

    def drain_rate(self) -> float:
        """Blocks released per second of the last ``DRAIN_WINDOW_S`` in which the gate held any, to the
        second (0 when none were): an idle spell, when nothing could end, does not lower it."""
        return self._drained.rate(time.monotonic())


def _take(counts: dict[str, int], tenant: str, blocks: int) -> None:
    """Subtract from a tenant's count, dropping the entry at 0 (a dict of tenants holding something)."""
    left = counts[tenant] - blocks
    if left:
        counts[tenant] = left
    else:
        del counts[tenant]
