"""Chained block hashes for automatic prefix caching, bound to a cache salt (tenure).

The hash of block ``i`` covers its tokens and the hash of block ``i - 1``, so equal hashes mean equal whole
prefixes, not just equal blocks. The first block's parent is the salt itself: requests with different salts
(different tenants) never produce the same hash and so never share KV, whatever their tokens. A LoRA
adapter's name enters the root the same way: the base model and each adapter compute different KV for the
same tokens, so their blocks are cached apart (a request without an adapter hashes exactly as before).
A cryptographic digest keeps accidental collisions (which would leak KV across tenants) out of reach.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence


def root_hash(cache_salt: str | None, lora: str | None = None) -> bytes:
    """The parent hash of a sequence's first block, for its salt and adapter (None: the base model)."""
    if lora is None:
        return hashlib.blake2b(b"kvguard-salt:" + (cache_salt or "").encode(), digest_size=16).digest()
    # Length-prefixed, so that no (salt, adapter) pair spells another's bytes.
    salt = (cache_salt or "").encode()
    key = b"kvguard-salt-lora:%d:" % len(salt) + salt + lora.encode()
    return hashlib.blake2b(key, digest_size=16).digest()


def block_hash(parent: bytes, token_ids: Sequence[int]) -> bytes:
    return hashlib.blake2b(parent + array("q", token_ids).tobytes(), digest_size=16).digest()


def extend_block_hashes(
    hashes: list[bytes], token_ids: Sequence[int], block_size: int, cache_salt: str | None,
    lora: str | None = None,
) -> None:
    """Append the hashes of every full block of ``token_ids`` not yet in ``hashes`` (in place)."""
    parent = hashes[-1] if hashes else root_hash(cache_salt, lora)
    for start in range(len(hashes) * block_size, len(token_ids) - block_size + 1, block_size):
        parent = block_hash(parent, token_ids[start : start + block_size])
        hashes.append(parent)
