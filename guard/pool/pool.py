"""The pool of engine replicas behind one guard, and the numbers the guard decides on for the pool as a
whole: what it may commit (the budgets of the replicas that are up), what it has committed, how fast
reservations drain. Each replica keeps its own gate and ledger (guard/pool/replica.py); a request is
reserved on exactly one replica (guard/admission/dispatch.py), so the pool's sums are the sums of theirs.

The pool is up while any replica is; a replica that is down adds nothing to the pool's budget or to its
committed blocks (its reservations still exist until their requests end, but no new one can go there).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Iterator

from guard.pool.gate import Reservation
from guard.pool.replica import Replica


class ReplicaPool:
    def __init__(self, replicas: list[Replica]) -> None:
        if not replicas:
            raise ValueError("a pool needs at least one replica")
        self.replicas = replicas
        self.by_name = {replica.name: replica for replica in replicas}

    def __iter__(self) -> Iterator[Replica]:
        return iter(self.replicas)

    def __len__(self) -> int:
        return len(self.replicas)

    def up(self) -> list[Replica]:
        return [replica for replica in self.replicas if replica.up()]

    def any_up(self) -> bool:
        return any(replica.up() for replica in self.replicas)

    def any_usable(self) -> bool:
        return any(replica.usable() for replica in self.replicas)

    def url(self) -> str:
        """A replica to ask what any replica would answer (its tokenizer, its models): the first that is up."""
        return next((r for r in self.replicas if r.up()), self.replicas[0]).url

    def start(self) -> None:
        """The guard starts serving: every replica's start window begins now."""
        now = time.monotonic()
        for replica in self.replicas:
            replica.started_at = now

    async def wait_while_starting(self) -> None:
        """While no replica has been heard from and the start window is not over, hold the request."""
        for replica in self.replicas:  # the usual case, asked on every request: one was heard from
            if replica.heard.is_set():
                return
        remaining = max(replica.start_left() for replica in self.replicas)
        if remaining:
            waits = [asyncio.ensure_future(replica.heard.wait()) for replica in self.replicas]
            try:
                await asyncio.wait(waits, timeout=remaining, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for wait in waits:
                    wait.cancel()

    # -- the pool's numbers ------------------------------------------------------------------------------
    def block_size(self) -> int | None:
        """The engines' block size (one model, one block size); None before any snapshot."""
        for replica in self.replicas:
            if (snapshot := replica.gate.snapshot) is not None:
                return snapshot.block_size
        return None

    # The sums asked on every request are loops: a generator's frame costs more than a pool's few replicas.
    def budget(self) -> int:
        """Blocks the guard may commit on the replicas that are up."""
        total = 0
        for replica in self.replicas:
            if replica.up():
                total += replica.gate.budget
        return total

    def largest_budget(self) -> int:
        """The most one request can ever be given: it runs on one replica (0 before any snapshot)."""
        largest = 0
        for replica in self.replicas:
            if (budget := replica.gate.budget) > largest:
                largest = budget
        return largest

    def committed(self) -> int:
        return sum(replica.gate.committed() for replica in self.replicas if replica.up())

    def borrowed(self) -> int:
        """Of ``committed``, the blocks reserved beyond their tenants' guarantees (reclaimable)."""
        return sum(replica.gate.borrowed for replica in self.replicas if replica.up())

    def num_blocks(self) -> int:
        return sum(r.gate.snapshot.num_blocks for r in self.replicas if r.up() and r.gate.snapshot is not None)

    def load(self) -> tuple[bool, int, int]:
        """``(any_up(), committed() - borrowed(), num_blocks())`` in one pass: the mode machine's inputs,
        read on every request (each of the three alone asks every replica whether it is up)."""
        up, held, num_blocks = False, 0, 0
        for replica in self.replicas:
            if replica.up():
                gate = replica.gate
                up, held = True, held + gate.committed() - gate.borrowed
                if gate.snapshot is not None:
                    num_blocks += gate.snapshot.num_blocks
        return up, held, num_blocks

    def tenant_reserved(self, tenant: str) -> int:
        total = 0
        for replica in self.replicas:
            total += replica.gate.tenant_reserved(tenant)
        return total

    def tenant_guaranteed(self, tenant: str) -> int:
        """Blocks the tenant holds within its guaranteed share: its reservations less what they borrow."""
        total = 0
        for replica in self.replicas:
            gate = replica.gate
            total += gate.tenant_reserved(tenant) - gate.tenant_borrowed(tenant)
        return total

    def reserved_by_tenant(self) -> dict[str, int]:
        totals: dict[str, int] = {}
        for replica in self.replicas:
            for tenant, blocks in replica.gate.reserved_by_tenant.items():
                totals[tenant] = totals.get(tenant, 0) + blocks
        return totals

    def reservations(self) -> dict[str, Reservation]:
        return {key: r for replica in self.replicas for key, r in replica.gate.reservations.items()}

    def expected_wait(self, blocks_ahead: int) -> float | None:
        """Seconds for ``blocks_ahead`` blocks to drain at the pool's measured rate; None before any."""
        rate = sum(replica.gate.drain_rate() for replica in self.replicas)
        return blocks_ahead / rate if rate > 0 else None

    def retry_after(self, blocks_ahead: int) -> int:
        """``Retry-After`` in whole seconds, 1..60, from the measured drain rate (5 before any measurement)."""
        wait = self.expected_wait(blocks_ahead)
        return 5 if wait is None else max(1, min(60, math.ceil(wait)))
