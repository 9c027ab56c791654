"""Which full blocks the prefix cache holds, as events: a hash is *stored* when it enters the block pool's
hash index and *removed* when it leaves it (its block is evicted). Torch-free.

The pool appends to the log as blocks come and go (one list append each, on the step's hot path); whoever
steps the engine drains it once per step into one ``KVEventBatch``, numbered by ``seq``: 1, 2, 3, ... with
no gaps, so a reader that misses one can tell.

A batch is *netted*: it is the difference between the index at this drain and at the previous one. A hash
that entered and left within one step (or left and came back) is in neither list. This relies on the
pool's own rule that a hash is stored only while absent and removed only while present, so its events
alternate, and their balance (stores minus removals) is -1, 0 or +1: the hash's net change. Hence
``stored`` and ``removed`` are disjoint, every stored hash was absent before the batch and every removed
one present, and a reader may apply the two lists in either order. A step whose events cancel out yields
no batch and uses no ``seq``.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass(slots=True, frozen=True)
class KVEventBatch:
    """The net change of the prefix-cache index between two drains; ``seq`` numbers the batches of one pool."""

    seq: int
    stored: list[bytes]
    removed: list[bytes]
    adapters: dict[bytes, str] = field(default_factory=dict)  # stored hash -> the LoRA adapter that made it


@dataclass(slots=True)
class KVEventLog:
    """The hashes stored and removed since the last ``drain``, in order; ``seq`` is the last batch's number."""

    stored: list[bytes] = field(default_factory=list)
    removed: list[bytes] = field(default_factory=list)
    adapters: dict[bytes, str] = field(default_factory=dict)  # stored hash -> its LoRA adapter (base: absent)
    seq: int = 0

    def drain(self) -> KVEventBatch | None:
        """The net change since the last drain as the next batch (None when there is none); empties the log."""
        stored, removed, adapters = self.stored, self.removed, self.adapters
        if not stored and not removed:
            return None
        self.stored, self.removed, self.adapters = [], [], {}
        if stored and removed:  # only then can a hash be in both: net them (module docstring)
            balance = Counter(stored)
            balance.subtract(removed)
            stored = [h for h, n in balance.items() if n > 0]
            removed = [h for h, n in balance.items() if n < 0]
            if not stored and not removed:
                return None
        self.seq += 1
        if adapters:  # those of hashes still stored after netting
            adapters = {h: adapters[h] for h in stored if h in adapters}
        return KVEventBatch(self.seq, stored, removed, adapters)
