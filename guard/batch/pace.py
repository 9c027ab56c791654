"""When a guard may start another batch line: only in capacity that other work leaves.

A line may start when none of this guard's lines still waits for a reservation (``running`` holds the
request ids of its lines; a line waits until its id is among the pool's reservations), nobody else's request
waits in the fair queue, the pool is in normal mode, fewer than ``max_in_flight`` lines run, and a usable
replica has room for ``need`` more lent blocks: the largest reservation of the guard's running lines (one
block before any has run). So a line is admitted at once, without queueing: a batch line never sits in the
fair queue, where it would send clients' requests down the queueing path behind it. The batch grows into
idle blocks one admitted line at a time and stops growing as soon as clients' requests queue; the blocks it
holds are lent (the sheddable class), so critical work takes them back and the engines preempt batch lines
first. ``POLL_S`` is how soon a freed block is seen; each look costs a scan of the reservations.
"""

from __future__ import annotations

from guard.instance import GuardState

POLL_S = 0.01


class Pacer:
    def __init__(self, state: GuardState, max_in_flight: int) -> None:
        self.state = state
        self.max_in_flight = max_in_flight
        self.running: set[str] = set()  # request ids of this guard's lines now in the pipeline
        self.need = 1  # blocks a line is expected to reserve: the largest of the running lines' reservations

    def room(self) -> bool:
        state = self.state
        if len(self.running) >= self.max_in_flight or state.dispatcher.fair.queued or state.modes.mode != "normal":
            return False
        reserved = state.pool.reservations()
        largest = 0
        for request_id in self.running:
            if (reservation := reserved.get(request_id)) is None:
                return False  # still on its way to a reservation: the next line waits for it
            largest = max(largest, reservation.blocks)
        self.need = largest or self.need
        return any(replica.usable() and replica.gate.fits(self.need, self.need) for replica in state.pool)

    def take(self, request_id: str) -> bool:
        """Whether a line may start now; if so it counts as running (until ``done``): the look and the count
        are one step, so two batches on one guard never both take the same room."""
        if not self.room():
            return False
        self.running.add(request_id)
        return True

    def done(self, request_id: str) -> None:
        self.running.discard(request_id)
