"""Stored responses (``store: true``): what ``GET /v1/responses/{id}`` answers and ``previous_response_id``
continues, for a while.

Each entry is a finished response and its whole conversation as chat messages (the history a continuation
runs after: its input, everything before it, and its output), under the tenant that made it. Invariants:

- a tenant sees only its own entries: another tenant's id reads exactly as an unknown one (no probing);
- an entry lives ``ttl_s`` after it was stored, then reads as unknown and is dropped;
- at most ``capacity`` entries: storing one more drops the oldest (entries are kept in storing order, which
  is expiry order too, so dropping expired ones looks at the oldest only).

``python -m engine --responses-ttl S --max-stored-responses N`` sets both. The store lives in the engine
process (one event loop: no lock), so a restart forgets it, and a pool's replicas each keep their own: the
guard finds a response on the replica that has it (guard/http/responses.py ``ask_replicas``).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from engine.protocol import ChatMessage, ResponseObject

DEFAULT_TTL_S = 3600.0
DEFAULT_CAPACITY = 10_000


@dataclass(frozen=True, slots=True)
class StoredResponse:
    tenant: str | None
    response: ResponseObject
    conversation: tuple[ChatMessage, ...]  # what a continuation runs after
    expires: float


class ResponseStore:
    def __init__(self, ttl_s: float = DEFAULT_TTL_S, capacity: int = DEFAULT_CAPACITY,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if ttl_s <= 0 or capacity < 1:
            raise ValueError(f"responses store: ttl_s must be > 0 and capacity >= 1, got {ttl_s}, {capacity}")
        self.ttl_s, self.capacity, self.clock = ttl_s, capacity, clock
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        self._expire()
        return len(self._entries)

    def put(self, tenant: str | None, response: ResponseObject, conversation: list[ChatMessage]) -> None:
        self._expire()
        self._entries[response.id] = StoredResponse(tenant, response, tuple(conversation), self.clock() + self.ttl_s)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def get(self, response_id: str, tenant: str | None) -> StoredResponse | None:
        """The entry, if it exists, has not expired and belongs to ``tenant``."""
        self._expire()
        entry = self._entries.get(response_id)
        return entry if entry is not None and entry.tenant == tenant else None

    def delete(self, response_id: str, tenant: str | None) -> bool:
        if self.get(response_id, tenant) is None:
            return False
        del self._entries[response_id]
        return True

    def _expire(self) -> None:
        now = self.clock()
        while self._entries:
            oldest = next(iter(self._entries.values()))
            if oldest.expires > now:
                break
            self._entries.popitem(last=False)
