"""When a guard may start another batch line: only in capacity that other work leaves.

A line may start when none of this guard's lines still waits for a reservation (``running`` holds the
request ids of its lines; a line waits until its id is among the pool's reservations), nobody else's request
waits in the fair queue, the pool is in normal mode, fewer than ``max_in_flight`` lines run, and a usable
replica has room for ``need`` more lent blocks *plus the headroom other work may come back to claim*:
``need`` is the largest reservation of the guard's running lines (one block before any has run).

The headroom is what other work (everything on the replica but this guard's lines) reserved at its peak over
the last ``PEAK_WINDOW_S``, less what it reserves now. So the batch fills the budget only up to what other
work left at its recent peak, and a client's request arriving as the load returns to that peak finds its
blocks free instead of queueing behind batch lines that take seconds to end (the budget's threshold still
keeps ``1 - safe_utilization`` of the pool for bursts beyond the peak). Without the headroom, the batch
refilled every block a finished client request freed, and on the shared 2-core CPU the interactive tenant's
requests waited 13-74 ms (mean) in the fair queue beside a batch, against 0.4 ms alone (bench/batch.py's
``why``).

With ``max_slowdown`` (``batch.max_slowdown``), a replica also needs the decode step its sequences would run
at with one more line to stay within that ratio of the step without this guard's lines, as the replica's
latency model fits the step against the batch size (guard/pool/latency.py ``decode_step``): every running
sequence decodes in every step, so on an engine whose step grows with each sequence (a CPU's: 2.4 ms at 8,
3.9 ms at 28, 11.5 ms at 58 on the 2-core EPYC) a batch line lengthens every interactive request's steps,
and its TTFT, which is a few steps. On an engine whose step hardly grows (a GPU's) the bound never binds.

So a line is admitted at once, without queueing: a batch line never sits in the fair queue, where it would
send clients' requests down the queueing path behind it. The batch grows into idle blocks one admitted line
at a time and stops growing as soon as clients' requests queue; the blocks it holds are lent (the sheddable
class), so critical work takes them back and the engines preempt batch lines first. ``POLL_S`` is how soon a
freed block is seen; each look costs a scan of the reservations.
"""

from __future__ import annotations

import time
from collections import deque

from guard.instance import GuardState
from guard.pool.replica import Replica

POLL_S = 0.01
PEAK_WINDOW_S = 10.0  # how far back other work's peak reservation counts: long enough to span its bursts


class OtherPeak:
    """The most blocks other work reserved on one replica over the last ``PEAK_WINDOW_S`` (a monotonic
    deque of (time, blocks): each sample drops the older ones it exceeds, so the head is the window's max)."""

    def __init__(self) -> None:
        self.samples: deque[tuple[float, int]] = deque()

    def see(self, now: float, blocks: int) -> int:
        samples = self.samples
        while samples and samples[-1][1] <= blocks:
            samples.pop()
        samples.append((now, blocks))
        while samples[0][0] < now - PEAK_WINDOW_S:
            samples.popleft()
        return samples[0][1]


class Pacer:
    def __init__(self, state: GuardState, max_in_flight: int, max_slowdown: float | None = None) -> None:
        self.state = state
        self.max_in_flight = max_in_flight
        self.max_slowdown = max_slowdown
        self.running: set[str] = set()  # request ids of this guard's lines now in the pipeline
        self.need = 1  # blocks a line is expected to reserve: the largest of the running lines' reservations
        self.peaks: dict[str, OtherPeak] = {}  # per replica (by backend name)

    def room(self) -> bool:
        state = self.state
        # Other work's reservations are looked at first, whatever the answer: its peak is when it queues.
        now = time.monotonic()
        headroom = {replica.backend.name: self.headroom(replica, now) for replica in state.pool}
        if len(self.running) >= self.max_in_flight or state.dispatcher.fair.queued or state.modes.mode != "normal":
            return False
        reserved = state.pool.reservations()
        largest = 0
        for request_id in self.running:
            if (reservation := reserved.get(request_id)) is None:
                return False  # still on its way to a reservation: the next line waits for it
            largest = max(largest, reservation.blocks)
        self.need = largest or self.need
        return any(replica.usable() and replica.gate.fits(blocks := self.need + headroom[replica.backend.name], blocks)
                   and self.fast_enough(replica) for replica in state.pool)

    def fast_enough(self, replica: Replica) -> bool:
        """Whether one more line keeps ``replica``'s decode step within ``max_slowdown`` of the step without
        this guard's lines (see the module); always, unset or before the replica's step is known."""
        snapshot = replica.gate.snapshot
        if self.max_slowdown is None or snapshot is None:
            return True
        reservations = replica.gate.reservations
        mine = sum(1 for key in self.running if key in reservations)
        without = replica.latency.decode_step(max(1, snapshot.num_running - mine))
        return without <= 0 or replica.latency.decode_step(snapshot.num_running + 1) <= self.max_slowdown * without

    def headroom(self, replica: Replica, now: float) -> int:
        """Blocks other work (all but this guard's lines) reserved on ``replica`` at its recent peak beyond
        what it reserves now (see the module)."""
        gate = replica.gate
        mine = sum(gate.reservations[key].blocks for key in self.running if key in gate.reservations)
        other = gate.reserved - mine
        return self.peaks.setdefault(replica.backend.name, OtherPeak()).see(now, other) - other

    def take(self, request_id: str) -> bool:
        """Whether a line may start now; if so it counts as running (until ``done``): the look and the count
        are one step, so two batches on one guard never both take the same room."""
        if not self.room():
            return False
        self.running.add(request_id)
        return True

    def done(self, request_id: str) -> None:
        self.running.discard(request_id)
