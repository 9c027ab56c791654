"""The last ``RECORDS_KEPT`` decision records, packed (guard/records/record.py), in one buffer.

The buffer is a ring of ``capacity`` slots of ``SLOT_BYTES``, allocated (and its pages touched) once; the
next record is copied into the oldest slot. A record too large for a slot (one with an objective, a long
refusal message, a pool of many replicas) is kept beside the ring, for its slot, as one ``bytes``. An index
from request id to slot finds a record. So of a request, only its id outlives it here (why: "Kept packed"):
the index holds ints made once, not the slot numbers each request computed (a new object past 256).

Invariants: the slots hold the newest ``capacity`` records put; where an id was put more than once (a
client's own ``X-Request-Id`` reused), ``get`` and ``recent`` give its newest record only.
"""

from __future__ import annotations

from guard.records.record import DecisionRecord, unpack

RECORDS_KEPT = 10_000
# A record without an objective packs into ~280 bytes (a pool of one; ~50 more a scored replica), one with an
# objective into ~540, kept beside. Slots of 1 KiB, which hold both, cost unary 1 % more than 512 (bench/
# guard_ab.py, 20 rounds each against one head): twice the memory that each record's copy brings into the cache.
SLOT_BYTES = 512
PAGE_BYTES = 4096


class RecordStore:
    def __init__(self, capacity: int = RECORDS_KEPT) -> None:
        self.capacity = capacity
        self._buffer = bytearray(capacity * SLOT_BYTES)
        # Touch every page now: the kernel maps a fresh buffer's pages as they are first written, which the
        # first requests after a start would pay (a fault every 4 records).
        self._buffer[::PAGE_BYTES] = bytes(len(range(0, len(self._buffer), PAGE_BYTES)))
        self._beside: dict[int, bytes] = {}  # slot -> a record too large for it
        self._ids: list[str | None] = [None] * capacity  # whose record each slot holds
        self._slots: dict[str, int] = {}  # request id -> the slot of its newest record
        self._numbers = tuple(range(capacity))  # the slots' numbers, made once: the index holds these ints
        self._next = 0  # the slot the next record goes in: the oldest

    def __len__(self) -> int:
        """The records ``get`` finds."""
        return len(self._slots)

    def put(self, request_id: str, kept: bytes) -> None:
        """Keep ``kept`` (``pack`` of ``request_id``'s record) in place of the oldest."""
        slot, slots = self._next, self._slots
        evicted = self._ids[slot]
        if evicted is not None and slots.get(evicted) == slot:
            del slots[evicted]
        self._ids[slot] = request_id
        slots[request_id] = self._numbers[slot]
        self._next = slot + 1 if slot + 1 < self.capacity else 0
        if self._beside:
            self._beside.pop(slot, None)
        if len(kept) <= SLOT_BYTES:
            at = slot * SLOT_BYTES
            self._buffer[at:at + len(kept)] = kept
        else:
            self._beside[slot] = kept

    def get(self, request_id: str) -> DecisionRecord | None:
        slot = self._slots.get(request_id)
        return None if slot is None else self._record(slot)

    def recent(self, limit: int) -> list[DecisionRecord]:
        """The newest ``limit`` records, newest first."""
        found: list[DecisionRecord] = []
        for age in range(self.capacity):
            if len(found) >= limit:
                break
            slot = (self._next - 1 - age) % self.capacity
            if (request_id := self._ids[slot]) is None:  # never filled: nothing older
                break
            if self._slots.get(request_id) == slot:  # (not an older record of a reused id)
                found.append(self._record(slot))
        return found

    def _record(self, slot: int) -> DecisionRecord:
        kept = self._beside.get(slot)
        if kept is None:
            kept = bytes(self._buffer[slot * SLOT_BYTES:(slot + 1) * SLOT_BYTES])
        return unpack(kept)
