"""The view of a sequence that the KV cache manager works with, and nothing more.

The manager needs a sequence's identity (its block tables are keyed by it), its tokens, salt and adapter (to hash
full blocks), how many of its tokens have KV, and the chained hashes computed for it so far. It reads all of
these and only ever extends ``block_hashes`` in place; requests, sampling and queue state stay out of
``engine.kv``, so that the KV layer stands without the scheduler that drives it.
"""

from __future__ import annotations

from typing import Protocol


class KVSequence(Protocol):
    @property
    def seq_id(self) -> int: ...

    @property
    def token_ids(self) -> list[int]: ...

    @property
    def num_computed_tokens(self) -> int:
        """Tokens whose KV is in the cache (or will be, once the scheduled step has run)."""
        ...

    @property
    def block_hashes(self) -> list[bytes]:
        """Hashes of the sequence's leading full blocks; the manager appends as blocks fill."""
        ...

    @property
    def cache_salt(self) -> str | None: ...

    @property
    def lora(self) -> str | None:
        """The adapter's name, None for the base model: it enters the block hashes with the salt."""
        ...
