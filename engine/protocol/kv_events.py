"""The KV-cache event stream, ``GET /kv/events`` (docs/kv_events.md): which full blocks an engine's prefix
cache holds, so that a router can count a request's exact prefix hits on each replica. A block hash is the
16-byte digest of engine/kv/hashing.py, sent as 32 lowercase hex digits.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

KV_SNAPSHOT_EVENT = "snapshot"
KV_BLOCKS_EVENT = "blocks"
_KV_WIRE = ConfigDict(extra="ignore", ser_json_bytes="hex", val_json_bytes="hex")  # the engine may say more
BlockHash = Annotated[bytes, Field(min_length=16, max_length=16)]


class KVCacheSnapshot(BaseModel):
    """The first event of every ``/kv/events`` stream: every hash in the prefix-cache index once the batches
    up to ``seq`` are applied (0: none yet), and the engine's ``block_size``."""

    model_config = _KV_WIRE

    seq: int = Field(ge=0)
    block_size: int = Field(gt=0)
    hashes: list[BlockHash]


class KVCacheBlocks(BaseModel):
    """One step's net change of the index; a stream sends them with ``seq`` rising by exactly 1.

    ``stored`` and ``removed`` are disjoint, each stored hash was absent before and each removed one present,
    so the two lists may be applied in either order; one of them is not empty."""

    model_config = _KV_WIRE

    seq: int = Field(ge=1)
    stored: list[BlockHash]
    removed: list[BlockHash]
    # LoRA adapter name -> the stored hashes its requests computed (absent: every stored hash is the base's).
    # The hash already keys the adapter (engine/kv/hashing.py); this says which one, for routers and operators.
    loras: dict[str, list[BlockHash]] = Field(default_factory=dict)
