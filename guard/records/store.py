"""The last ``RECORDS_KEPT`` decision records by request id.

Invariant: at most ``capacity`` records are held, the newest; a record whose id comes again (a client's own
``X-Request-Id`` reused) replaces the older one and counts as the newest.
"""

from __future__ import annotations

from collections import OrderedDict
from itertools import islice

from guard.records.record import DecisionRecord

RECORDS_KEPT = 10_000


class RecordStore:
    def __init__(self, capacity: int = RECORDS_KEPT) -> None:
        self.capacity = capacity
        self._records: OrderedDict[str, DecisionRecord] = OrderedDict()

    def __len__(self) -> int:
        return len(self._records)

    def put(self, record: DecisionRecord) -> None:
        records = self._records
        if record.request_id in records:
            del records[record.request_id]
        records[record.request_id] = record
        if len(records) > self.capacity:
            records.popitem(last=False)

    def get(self, request_id: str) -> DecisionRecord | None:
        return self._records.get(request_id)

    def recent(self, limit: int) -> list[DecisionRecord]:
        """The newest ``limit`` records, newest first."""
        return list(islice(reversed(self._records.values()), max(0, limit)))
