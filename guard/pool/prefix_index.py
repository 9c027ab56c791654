"""Which prefixes one engine replica has cached, exactly: the block hashes of its prefix-cache index, kept
by its KV event stream (guard/pool/kv_events.py), and the hashes of a prompt to look up in it.

The guard hashes a prompt as the engine does (engine/kv/hashing.py: salted, chained, keyed by the LoRA
adapter the request names), so a prompt's leading hashes found in the index are the blocks the engine will
take from its cache, not a guess: with nothing changing in between,
``leading_cached(prompt_block_hashes(ids, block_size, salt, lora)) * block_size`` equals the cached tokens
the engine then reports for the request.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from engine.kv.hashing import extend_block_hashes


def prompt_block_hashes(token_ids: Sequence[int], block_size: int, cache_salt: str | None,
                        lora: str | None = None) -> list[bytes]:
    """The hashes the engine looks up for a prompt of ``token_ids``, in order: its full blocks, capped as
    ``KVCacheManager.find_cached_prefix`` caps them at ``(len(token_ids) - 1) // block_size``, because the
    last prompt token is always computed (its logits sample the first output token)."""
    hashes: list[bytes] = []
    extend_block_hashes(hashes, token_ids, block_size, cache_salt, lora)
    del hashes[(len(token_ids) - 1) // block_size :]
    return hashes


@dataclass(slots=True)
class PrefixIndex:
    """The block hashes one replica's prefix cache holds (its ``block_size`` with them).

    Invariant: while ``synced``, ``hashes`` is the engine's index as of the last event batch applied (behind
    the engine by the stream's latency only). Unsynced, before the first snapshot and from a disconnect
    until the next one, it is empty and predicts no hits: a stale copy could only mislead the router. Only
    the replica's ``KVEventSubscriber`` changes it; everyone else reads.
    """

    hashes: set[bytes] = field(default_factory=set)
    block_size: int = 0
    synced: bool = False

    def __len__(self) -> int:
        return len(self.hashes)

    def reset(self, hashes: Iterable[bytes], block_size: int) -> None:
        """Take a snapshot: the whole index, and the block size its hashes cover."""
        self.hashes = set(hashes)
        self.block_size = block_size
        self.synced = True

    def apply(self, stored: Iterable[bytes], removed: Iterable[bytes]) -> None:
        """Take one batch: the two lists are disjoint (engine/kv/events.py), so their order does not matter."""
        self.hashes.difference_update(removed)
        self.hashes.update(stored)

    def clear(self) -> None:
        """Forget everything until the next snapshot (the stream is down)."""
        self.hashes = set()
        self.synced = False

    def leading_cached(self, hashes: Sequence[bytes]) -> int:
        """How many of ``hashes`` (a prompt's, from ``prompt_block_hashes``), from the first, are all cached.

        A hash covers its whole prefix, so a cached one implies the ones before it were written; but the
        engine may have evicted a parent and kept the child, and its lookup stops at the first miss: so
        does this count."""
        if not self.synced:
            return 0
        count = 0
        for block_hash in hashes:
            if block_hash not in self.hashes:
                break
            count += 1
        return count
